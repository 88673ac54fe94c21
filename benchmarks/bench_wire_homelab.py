"""Loss curves on homelab's devices over Wi-Fi: the fp32 plan against compressed links, trained long.

    sudo python benchmarks/bench_wire_homelab.py --demo out/demo-slowlink [--steps 200] [--runs pp_fp32,pp_lossy]
    sudo python benchmarks/bench_wire_homelab.py --quick --out /tmp/q   # the demo's --quick plans, 3 steps each

``torchpp demo --scenario slowlink --out DIR`` profiles homelab's laptop and three Pis on 10-20 Mbit/s
links (configs/cluster/slowlink.json), plans qwen3-homelab twice from the same measurements (fp32,
and ``--allow-lossy bf16,int8``) and trains each 6 steps. This trains those plans for hundreds of
steps on real text (byte tokens of the vim manual, or ``--text``), every run ``python -m
torchpp.train`` started by ``torchpp cluster run --plan`` on the same emulated cluster, so a
loss curve says whether the compressed links still train and a clock says what they buy:

- ``pp_fp32``: the fp32 plan (``DIR/plan/plan.json``);
- ``pp_lossy``: the planner's lossy plan as it is (``DIR/plan_lossy/plan.json``);
- ``pp_bf16``: the lossy plan's split with every link (and a lossy tied-weight all-reduce) in bf16
  instead, unpriced (the planner chose what ``pp_lossy`` says).
- ``pp_split_fp32``: the lossy plan's split with everything in fp32, unpriced: the control that
  tells the wire formats' effect on the loss from the split's (a split alone changes no loss in
  exact arithmetic, but the order of floating-point sums may differ).

qwen3-homelab fits no single host, so there is no data-parallel run (and no DiLoCo). Writes
``<out>/``: ``results.json``, ``summary.md``, ``loss_vs_time.png``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

RUNS = ("pp_fp32", "pp_lossy", "pp_bf16", "pp_split_fp32")


def make_plans(demo: Path, work: Path) -> dict[str, Path]:
    """The demo's two plans and the bf16 variant of the lossy one (module docstring)."""
    from torchpp.formats import Plan, Sync

    plans = {"pp_fp32": demo / "plan" / "plan.json", "pp_lossy": demo / "plan_lossy" / "plan.json"}
    for name, path in plans.items():
        if not path.exists():
            raise SystemExit(f"{path}: not found; run `torchpp demo --scenario slowlink --out {demo}` first "
                             f"(it writes the {name} plan there)")
    work.mkdir(parents=True, exist_ok=True)
    for name, fmt in (("pp_bf16", "bf16"), ("pp_split_fp32", None)):
        plan = Plan.load(plans["pp_lossy"])
        for s in plan.stages:
            s.wire = fmt if s is not plan.stages[-1] else None
            if s.sync is not None and s.sync.lossy:
                s.sync = None if fmt is None else Sync(kind="allreduce", wire=fmt)
        if plan.tied_sync is not None and plan.tied_sync.lossy:
            plan.tied_sync = None if fmt is None else Sync(kind="allreduce", wire=fmt)
        plan.predicted = None  # not what the planner priced
        plans[name] = plan.save(work / f"plan_{name}.json")
    return plans


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--demo", type=Path, default=None,
                    help="the output folder of `torchpp demo --scenario slowlink` (--quick: made here if not given)")
    ap.add_argument("--quick", action="store_true",
                    help="plans of `torchpp demo --scenario slowlink --quick` (a tiny model), 3 steps each: checks that "
                         "it runs, measures nothing")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated subset of {','.join(RUNS)}")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=20, help="learning-rate warm-up steps")
    ap.add_argument("--target-step", type=int, default=200, help="N of 'time to fp32's step-N loss'")
    ap.add_argument("--window", type=int, default=25, help="steps of the loss moving average")
    ap.add_argument("--text", default=None, help="a text file or folder of .txt (default: the vim manual)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/bench_wire_homelab"), help="plans, traces and logs")
    ap.add_argument("--run-timeout", type=float, default=3600.0, help="seconds per run before it is killed")
    ap.add_argument("--out", type=Path, default=None,
                    help="results (default benchmarks/results/bench_wire/homelab_wifi; --quick: <work>/out)")
    a = ap.parse_args(argv)
    if a.quick:
        a.steps, a.window, a.target_step, a.warmup = 3, 1, 3, 1
    if a.out is None:
        a.out = a.work / "out" if a.quick else ROOT / "benchmarks" / "results" / "bench_wire" / "homelab_wifi"
    if a.demo is None and not a.quick:
        raise SystemExit("--demo: expected the output folder of `torchpp demo --scenario slowlink` (or --quick)")
    from bench_wire import _text
    from bench_wire_cluster import plot, run_one, summarize, table

    from torchpp.cluster import cluster, tc
    from torchpp.cluster.config import ClusterConfig

    names = [x for x in a.runs.split(",") if x]
    bad = [x for x in names if x not in RUNS]
    if bad:
        raise SystemExit(f"--runs: expected names from {','.join(RUNS)}, got {bad[0]!r}")
    os.environ["PYTHONPATH"] = str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")
    a.out.mkdir(parents=True, exist_ok=True)
    a.work.mkdir(parents=True, exist_ok=True)
    text = _text(a.text, a.quick, a.work)  # the vim manual joined into one file, else the test corpus
    if a.demo is None:  # --quick
        a.demo = a.work / "demo"
        subprocess.run([sys.executable, "-m", "torchpp", "demo", "--scenario", "slowlink", "--quick", "--out",
                        str(a.demo)], check=True, stdout=subprocess.DEVNULL)
    plans = make_plans(a.demo, a.work)
    saved = a.out / "results.json"
    results = json.loads(saved.read_text())["runs"] if saved.exists() else {}
    cfg = ClusterConfig.load(ROOT / "configs" / "cluster" / "slowlink.json")
    dropped = cfg.needs_netem and not tc.netem_available()
    if dropped:
        cfg = cfg.without_netem()
    cluster.up(cfg)
    try:
        for name in names:
            r = run_one(cfg.name, name, plans[name], a, text, a.work, layers=None)
            results[name] = r
            saved.write_text(json.dumps({"cluster": "slowlink", "runs": results}, indent=1))
            print(f"{name}: {len(r['losses'])} steps, final loss {r['losses'][-1]:.4f}, median step "
                  f"{r['median_step_s']:.3f} s, {r['bytes_per_step'] / 1e3:.1f} kB/step, run {r['run_wall_s']:.0f} s",
                  flush=True)
    finally:
        cluster.down(cfg.name)
    summary = summarize(results, a.target_step, a.window)
    where = ("the emulated slowlink cluster (configs/cluster/slowlink.json: homelab's laptop and three Pis, "
             "links of 10-20 Mbit/s" + (", without its delays: this kernel has no netem" if dropped else "") + ")")
    saved.write_text(json.dumps({"cluster": "slowlink", "runs": results, "summary": summary}, indent=1))
    (a.out / "summary.md").write_text(table(summary, "10-20 Mbit/s", a.window, where=where))
    plot(results, a.out, a.window, "10-20 Mbit/s", columns=((0, "pp", "qwen3-homelab on slowlink"),))
    print(table(summary, "10-20 Mbit/s", a.window, where=where))
    return 0


if __name__ == "__main__":
    sys.exit(main())
