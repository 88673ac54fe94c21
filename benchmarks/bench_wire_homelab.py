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
- ``pp_fp32_mb``: the fp32 plan with micro-batches twice as large (half as many; or half as large
  where their count is odd): the same samples, model and optimizer, only the order of the
  floating-point sums differs. Its gap to ``pp_fp32`` is the noise floor of a loss comparison at
  this step: a lossy run's gap means something only beyond it.

``--local-seeds 0,1,2`` trains the runs on local processes instead, once per seed (model init and
batches), and writes ``<out>/seeds.json``, ``seeds.md`` and ``loss_by_seed.png``: each run's gap to
the fp32 plan of the same seed, per seed and their mean. The links change no arithmetic, so a local
run's losses equal the cluster's of the same seed bit for bit (its times mean nothing); this is the
cheap way to see whether a gap is the format's or the seed's.

qwen3-homelab fits no single host, so there is no data-parallel run (and no DiLoCo). Writes
``<out>/``: ``results.json``, ``summary.md``, ``loss_vs_time.png``.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

RUNS = ("pp_fp32", "pp_lossy", "pp_bf16", "pp_split_fp32", "pp_fp32_mb")


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
    plans["pp_fp32_mb"] = reordered_sums(Plan.load(plans["pp_fp32"])).save(work / "plan_pp_fp32_mb.json")
    return plans


def reordered_sums(plan):
    """``plan`` with micro-batches twice as large (half as many), or half as large where their count
    is odd: the same arithmetic summed in another order (module docstring, ``pp_fp32_mb``)."""
    from torchpp.formats import split_samples
    from torchpp.schedules import build

    m, b = plan.num_microbatches, plan.micro_batch_size
    for size, count in ([(2 * b, m // 2)] if m % 2 == 0 else []) + ([(b // 2, 2 * m)] if b % 2 == 0 else []):
        p = copy.deepcopy(plan)
        p.micro_batch_size, p.num_microbatches = size, count
        for s in p.stages:
            for d, n in zip(s.devices, split_samples(p.micro_batch_size, [d.share for d in s.devices])):
                d.samples = n
        p.predicted = None
        try:
            build(p)
        except ValueError:
            continue  # the schedule does not take that count (interleaved rounds)
        return p
    raise SystemExit(f"pp_fp32_mb: the fp32 plan's {m} micro-batches of {b} can be neither doubled nor halved "
                     "under its schedule")


def run_local(name: str, plan: Path, seed: int, a, text: Path) -> list[float]:
    """``plan`` trained on local processes from ``seed``: every step's loss (module docstring)."""
    from bench_wire_cluster import step_records, train_argv

    from torchpp.formats import Plan

    d = a.work / "seeds" / f"{name}_s{seed}"
    d.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "torchpp.runtime.local_cli", "--nproc-per-node", str(Plan.load(plan).world_size),
            "--", *train_argv(plan, a, text, a.work, d, None, seed)]
    with open(d / "log", "w") as log:
        rc = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, timeout=a.run_timeout).returncode
    if rc != 0:
        raise RuntimeError(f"{name} seed {seed}: exit {rc}; see {d / 'log'}")
    return [float(r["loss"]) for r in step_records(d)]


def seed_gaps(runs: dict[str, dict[str, list[float]]], window: int) -> dict[str, dict]:
    """Per run and seed, the smoothed loss at the last common step against ``pp_fp32``'s of the same
    seed; and per run the mean gap over the seeds that have both."""
    from bench_wire import _smooth, mean_and_error

    out = {}
    for name, by_seed in runs.items():
        gaps = {}
        for seed, losses in by_seed.items():
            base = runs.get("pp_fp32", {}).get(seed)
            if base is None or name == "pp_fp32":
                continue
            n = min(len(base), len(losses))
            gaps[seed] = _smooth(losses[:n], window)[-1] / _smooth(base[:n], window)[-1] - 1
        if gaps:
            g = list(gaps.values())
            mean, se = mean_and_error(g)
            out[name] = {"gaps": gaps, "mean": mean, "min": min(g), "max": max(g), "standard_error": se}
    return out


def seeds_table(gaps: dict[str, dict], steps: int, window: int) -> str:
    seeds = sorted({s for g in gaps.values() for s in g["gaps"]}, key=int)
    lines = [f"Loss at equal tokens (mean of the last {window} of {steps} steps) against the fp32 plan of the same "
             "seed, every run on local processes (the same losses the cluster gives; links change no arithmetic). "
             "pp_fp32_mb changes only the order of the sums: its gaps are the noise floor.", "",
             "| run | " + " | ".join(f"seed {s}" for s in seeds) + " | mean | standard error | range |",
             "|---|" + "---|" * (len(seeds) + 3)]
    for name, g in gaps.items():
        cells = [f"{g['gaps'][s]:+.2%}" if s in g["gaps"] else "-" for s in seeds]
        se = "-" if g["standard_error"] is None else f"{g['standard_error']:.2%}"
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {g['mean']:+.2%} | {se} | {g['min']:+.2%} .. {g['max']:+.2%} |")
    return "\n".join(lines) + "\n"


def plot_seeds(runs: dict[str, dict[str, list[float]]], out: Path, window: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from bench_wire import _smooth

    seeds = sorted({s for r in runs.values() for s in r}, key=int)
    fig, axes = plt.subplots(1, len(seeds), figsize=(5 * len(seeds), 4), squeeze=False)
    for ax, seed in zip(axes[0], seeds):
        for name, by_seed in runs.items():
            if seed in by_seed:
                ax.plot(range(1, len(by_seed[seed]) + 1), _smooth(by_seed[seed], window), label=name)
        ax.set(title=f"seed {seed}", xlabel="step (equal tokens)", ylabel="training loss (smoothed)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(out / "loss_by_seed.png", dpi=110)
    plt.close(fig)


def local_seeds(names: list[str], plans: dict[str, Path], seeds: list[int], a, text: Path) -> int:
    """``--local-seeds``: every run of ``names`` once per seed on local processes; the gaps' table."""
    saved = a.out / "seeds.json"
    settings = {"steps": a.steps, "lr": a.lr, "warmup": a.warmup, "text": str(text)}
    old = json.loads(saved.read_text()) if saved.exists() else {}
    runs = old.get("runs", {}) if old.get("settings") == settings else {}  # kept only if trained the same way
    for seed in seeds:
        for name in names:
            if len(runs.get(name, {}).get(str(seed), [])) >= a.steps:
                continue  # kept from an earlier invocation with the same settings
            runs.setdefault(name, {})[str(seed)] = run_local(name, plans[name], seed, a, text)
            saved.write_text(json.dumps({"settings": settings, "runs": runs}, indent=1))
            print(f"{name} seed {seed}: final loss {runs[name][str(seed)][-1]:.4f}", flush=True)
    gaps = seed_gaps(runs, a.window)
    saved.write_text(json.dumps({"settings": settings, "window": a.window, "runs": runs, "gaps": gaps}, indent=1))
    text_table = seeds_table(gaps, a.steps, a.window)
    (a.out / "seeds.md").write_text(text_table)
    plot_seeds(runs, a.out, a.window)
    print(text_table)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--demo", type=Path, default=None,
                    help="the output folder of `torchpp demo --scenario slowlink` (--quick: made here if not given)")
    ap.add_argument("--quick", action="store_true",
                    help="plans of `torchpp demo --scenario slowlink --quick` (a tiny model), 3 steps each: checks that "
                         "it runs, measures nothing")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated subset of {','.join(RUNS)}")
    ap.add_argument("--local-seeds", default=None,
                    help="comma-separated seeds: train every run on local processes once per seed, losses only "
                         "(seeds.md: each run's gap to fp32 per seed)")
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
                        str(a.demo), *(["--local"] if a.local_seeds else [])], check=True, stdout=subprocess.DEVNULL)
    plans = make_plans(a.demo, a.work)
    if a.local_seeds:
        return local_seeds(names, plans, [int(x) for x in a.local_seeds.split(",") if x.strip()], a, text)
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
