"""bench_wire on real shaped links: seed 003's cluster (configs/cluster/pi3.json) at a link rate.

    sudo python benchmarks/bench_wire.py --cluster [--rate 10mbit] [--steps 250] [--runs pp_fp32,pp_int8]

Every run is ``python -m torchpp.train`` started by ``torchpp cluster run --plan`` on the emulated
cluster (one network namespace and CPU cgroup per Pi, every link shaped by tc to ``--rate``), so
the time is what the step takes on those links, not bytes divided by a rate. Same model, seed,
data (byte tokens of real text) and optimizer for every run; only the plan's wire fields differ:

- pipeline (seed 003's: qwen3-small cut to 3 layers, 3 stages, 3 micro-batches of 2 x 64 tokens):
  ``pp_fp32``; ``pp_bf16`` (links and the tied-weight all-reduce in bf16); ``pp_int8`` (links in
  int8, the tied-weight all-reduce in int8 with error feedback); ``pp_int8_psgd`` (links in int8,
  the tied-weight all-reduce by PowerSGD of rank 4; ``pp_int8_psgd8``: of rank 8); ``pp_rows``
  (fp32 links, the tied weight synced exactly by the rows a step touches) and ``pp_int8_rows``
  (the same with int8 links), priced with the distinct byte tokens of a step on the text;
  ``pp_group_fp32`` and ``pp_group_rows``: two stages, the first a data-parallel group of pi0 and
  pi1, the tied weight all-reduced over the three ranks or synced by its rows (broadcasts);
- data parallel (2 replicas on pi0 and pi1, qwen3-tiny): ``dp_fp32`` (a gradient all-reduce every
  step) and ``dp_diloco<H>`` (inner AdamW, every H steps an outer SGD step of ``--outer-lr`` and
  Nesterov ``--outer-momentum`` on the replicas' mean change, sent in int8).

Wall-clock is rank 0's measured step time (metrics.jsonl), summed; the bytes per step are read from
a traced step (every send and every all-reduce as encoded). With ``--plan-lossy
bf16,int8,powersgd`` every host is first profiled and the links probed on the cluster,
``torchpp plan --allow-lossy`` plans from those files, that plan runs as ``pp_planned``, and every
pipeline run's plan is priced by the same measurements (predicted vs measured step; the probe's
links with the burst each passes after a rest). Every host's CPU quota runs over ``--cpu-period-ms``
periods (3 ms): a host is a slower CPU at every instant, as a Pi is, and computes at the speed its
profile measured (at the kernel's 100 ms a rank that waits on its links computes in bursts at a
whole core's speed).
Writes ``<out>/cluster_<rate>/``: ``results.json``, ``summary.md``, ``loss_vs_time.png``.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PP = dict(model="qwen3-small", layers=3, global_batch=6, seq_len=64, microbatches=3)
"""Seed 003's pipeline (benchmarks/seed003_experiments.py)."""
DP = dict(model="qwen3-tiny", layers=4, global_batch=8, seq_len=64)
"""A data-parallel model small enough for hundreds of steps over 10 Mbit/s on this machine."""
PROFILE_ITERS = 10
"""Timed iterations per block in the cluster's ``torchpp profile``: with 3 (until this measurement),
one layer's samples on a loaded machine ranged 5-48 ms and its mean priced the middle stage's
backward at 2-3x what the traced steps took."""


def distinct_per_step(text: Path, samples: int = 200, seed: int = 0) -> int:
    """The distinct byte tokens a pipeline step touches on ``text``, on average over ``samples`` steps of
    random windows: what a ``rows`` tied sync moves each way (the plan's ``tied_sync.rows``)."""
    import random

    data = text.read_bytes()
    rng, n, T = random.Random(seed), PP["global_batch"], PP["seq_len"]
    counts = []
    for _ in range(samples):
        seen: set[int] = set()
        for _ in range(n):
            i = rng.randrange(0, max(1, len(data) - T))
            seen.update(data[i:i + T])
        counts.append(len(seen))
    return round(statistics.mean(counts))


def make_plans(tmp: Path, H: list[int], outer_lr: float, outer_momentum: float, rows: int = 0) -> dict[str, Path]:
    from torchpp.formats import Plan, Sync

    def plan(out: Path, *args: str) -> Plan:  # kept from an earlier run in the same --work
        if out.exists():
            return Plan.load(out)
        subprocess.run([sys.executable, "-m", "torchpp", "plan", *args, "--out", str(out)], check=True, cwd=ROOT,
                       stdout=subprocess.DEVNULL)
        return Plan.load(out)

    pp_args = ["--model", PP["model"], "--layers", str(PP["layers"]), "--global-batch", str(PP["global_batch"]),
               "--seq-len", str(PP["seq_len"]), "--hosts", "pi0,pi1,pi2", "--strategy", "pp", "--stages", "3",
               "--microbatches", str(PP["microbatches"])]
    base = tmp / "pp_fp32.json"
    plan(base, *pp_args)
    out = {"pp_fp32": base}
    for name, link, tied in (("pp_bf16", "bf16", Sync(kind="allreduce", wire="bf16")),
                             ("pp_int8", "int8", Sync(kind="allreduce", wire="int8")),
                             ("pp_int8_psgd", "int8", Sync(kind="powersgd")),
                             ("pp_int8_psgd8", "int8", Sync(kind="powersgd", rank=8)),
                             ("pp_rows", None, Sync(kind="rows", rows=rows)),
                             ("pp_int8_rows", "int8", Sync(kind="rows", rows=rows))):
        p = Plan.load(base)
        for s in p.stages[:-1]:
            s.wire = link
        p.tied_sync = tied
        out[name] = tmp / f"{name}.json"
        p.save(out[name])
    # the first stage a data-parallel group (pi0 and pi1), the last on pi2: the tied weight all-reduced
    # densely over the three ranks, or synced by its rows as broadcasts over them
    from torchpp.plans import make_plan

    for name, tied in (("pp_group_fp32", None), ("pp_group_rows", Sync(kind="rows", rows=rows))):
        p = make_plan(Plan.load(base).model, seq_len=PP["seq_len"], global_batch=PP["global_batch"],
                      num_microbatches=PP["microbatches"], layer_ranges=[(0, 2), (2, PP["layers"])],
                      group_sizes=[2, 1], hosts=["pi0", "pi1", "pi2"])
        p.tied_sync = tied
        out[name] = tmp / f"{name}.json"
        p.save(out[name])
    dp_args = ["--model", DP["model"], "--layers", str(DP["layers"]), "--global-batch", str(DP["global_batch"]),
               "--seq-len", str(DP["seq_len"]), "--hosts", "pi0,pi1", "--strategy", "dp", "--devices", "2",
               "--microbatches", "1"]
    dbase = tmp / "dp_fp32.json"
    plan(dbase, *dp_args)
    out["dp_fp32"] = dbase
    for h in H:
        p = Plan.load(dbase)
        p.stages[0].sync = Sync(kind="diloco", H=h, wire="int8", outer_lr=outer_lr, outer_momentum=outer_momentum)
        out[f"dp_diloco{h}"] = tmp / f"dp_diloco{h}.json"
        p.save(out[f"dp_diloco{h}"])
    return out


def measure_and_plan(cluster_name: str, work: Path, allow: str, alone: bool = False, rows: int = 0) -> dict:
    """The planning loop on the running cluster: ``torchpp profile`` of seed 003's model (its
    per-byte codec CPU included) on every host at once (``alone``: one after the other),
    ``torchpp bandwidth probe`` over the shaped links, then ``torchpp plan --allow-lossy`` from
    those files. Returns the planned plan's path and the costs
    (to price the fixed runs' plans with the same measurements)."""
    from torchpp.cluster import cluster
    from torchpp.planner import api

    d = work / "planning"
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    hosts = ["pi0", "pi1", "pi2"]
    prof = [sys.executable, "-m", "torchpp", "profile", "--model", PP["model"], "--layers", str(PP["layers"]),
            "--seq-len", str(PP["seq_len"]), "--batch", "1,2", "--iters", str(PROFILE_ITERS), "--warmup", "2",
            "--threads", "1", "--quiet", "--host", "{host}", "--out", str(d / "layers_{host}.json")]
    # the probe's own defaults (three sizes at 10 Mbit/s): the tied all-reduce's seconds are its rate's
    probe = [sys.executable, "-m", "torchpp", "bandwidth", "probe", "--out-dir", str(d / "probe")]
    steps = [("profile", prof)]
    if alone:  # one host at a time: no profile competes with another for this machine's cores
        steps = [(f"profile_{h}", ["sh", "-c", f'[ "{{host}}" = {h} ] || exit 0; exec {shlex.join(prof)}'])
                 for h in hosts]
    for what, argv in (*steps, ("probe", probe)):
        rc, res = cluster.run(cluster_name, argv, d / "logs" / what, timeout=1200)
        if rc != 0:
            bad = next(r for r in res if r.returncode != 0)
            raise RuntimeError(f"{what}: exit {rc}; {bad.log}:\n{cluster.tail(bad.log)}")
    devices = d / "devices.json"
    devices.write_text(json.dumps({h: {"memory_gb": 2, "rank": i} for i, h in enumerate(hosts)}))
    layers = [d / f"layers_{h}.json" for h in hosts]
    subprocess.run([sys.executable, "-m", "torchpp", "plan", "--layers", *map(str, layers), "--bandwidth",
                    str(d / "probe" / "bandwidth.json"), "--devices", str(devices), "--global-batch",
                    str(PP["global_batch"]), "--seq-len", str(PP["seq_len"]), "--allow-lossy", allow,
                    "--tied-rows", str(rows),
                    "--out-dir", str(d / "plan")], check=True, cwd=ROOT)
    costs = api.load(api.PlanInputs(layers=layers, bandwidth=d / "probe" / "bandwidth.json", devices=devices))
    return {"plan": d / "plan" / "plan.json", "costs": costs}


def reprice(results: dict, plans: dict[str, Path], costs) -> None:
    """Every pipeline run's plan priced by the planner from the cluster's measurements (``costs``)."""
    from torchpp.formats import Plan
    from torchpp.planner.api import predict_plan

    for name, r in results.items():
        if name.startswith("pp") and name != "pp_planned" and name in plans:
            r["predicted_step_s"] = predict_plan(Plan.load(plans[name]), costs)["step_time_s"]


def outer_bytes(plan: Path) -> float:
    """DiLoCo's bytes per step, every replica's outer message (the traced steps skip the gradient
    all-reduce and hold no outer step): its weights as the sync's wire sends them, over H."""
    from torchpp.formats import Plan, wire_bytes
    from torchpp.models.presets import build_model

    p = Plan.load(plan)
    s = p.stages[0].sync
    if s is None or s.kind != "diloco":
        return 0
    n = sum(t.numel() for t in build_model(p.model.name, seed=0, num_layers=p.model.num_layers).parameters())
    return len(p.stages[0].devices) * wire_bytes(s.wire, n, 256) / s.H


def traced_bytes(trace_dir: Path, step: int) -> int:
    """Bytes every rank put on the wire in one traced step: p2p sends as encoded, and each rank's
    all-reduce payload as encoded (every group here has two members: a ring all-reduce of two, and
    an all-gather of two, send each member's buffer once)."""
    from torchpp.trace.analyze import wire_bytes

    return wire_bytes(json.loads(f.read_text()) for f in trace_dir.glob(f"timeline_step{step}_rank*.json"))


def run_one(cluster_name: str, name: str, plan: Path, args, text: Path, out: Path, layers: int | None = -1) -> dict:
    """Train ``plan`` for ``args.steps`` on the cluster; ``layers``: the model's decoder layers kept
    (-1: seed 003's pipeline or data-parallel model's, by the run's name; None: the whole model)."""
    from torchpp.cluster import cluster

    d = out / name
    shutil.rmtree(d, ignore_errors=True)
    if layers == -1:
        layers = (PP if name.startswith("pp") else DP)["layers"]
    trace_steps = (2, 3)
    argv = train_argv(plan, args, text, out, d, layers) + ["--trace-dir", str(d / "trace"),
                                                           "--trace-steps", ",".join(map(str, trace_steps))]
    load0 = os.getloadavg()
    t0 = time.monotonic()
    rc, res = cluster.run(cluster_name, argv, d / "hosts", timeout=args.run_timeout, plan=plan)
    wall = time.monotonic() - t0
    if rc != 0:
        bad = next(r for r in res if r.returncode != 0)
        raise RuntimeError(f"{name}: exit {rc}; {bad.log}:\n{cluster.tail(bad.log)}")
    recs = step_records(d)
    times = [float(r["step_time_s"]) for r in recs]
    r = {"plan": str(plan), "losses": [float(x["loss"]) for x in recs], "step_times_s": times,
         "median_step_s": statistics.median(times[1:]), "run_wall_s": wall,
         "bytes_per_step": traced_bytes(d / "trace", 3) or outer_bytes(plan), "loadavg_before": load0,
         "loadavg_after": os.getloadavg(),
         "predicted_step_s": _predicted(plan)}
    (d / "result.json").write_text(json.dumps(r, indent=1))
    return r


def train_argv(plan: Path, args, text: Path, work: Path, d: Path, layers: int | None, seed: int = 0) -> list[str]:
    """Every rank's ``torchpp.train`` command of a run (the cluster's and the local seed runs' alike)."""
    return [sys.executable, "-m", "torchpp.train", "--plan", str(plan), *(["--layers", str(layers)] if layers else []),
            "--data", str(text), "--tokenizer", "bytes", "--data-cache", str(work / "cache"),
            "--steps", str(args.steps), "--lr", str(args.lr), "--warmup-steps", str(args.warmup), "--seed", str(seed),
            "--threads", "1", "--timeout-s", "300", "--log-dir", str(d), "--no-output"]


def step_records(d: Path) -> list[dict]:
    """The per-step records (loss, step time) a run wrote to ``d/metrics.jsonl``."""
    recs = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
    return [r for r in recs if "step" in r and "loss" in r]


def _predicted(plan: Path) -> float | None:
    from torchpp.formats import Plan

    pred = Plan.load(plan).predicted
    return None if not pred else pred.get("step_time_s") if isinstance(pred, dict) else getattr(pred, "step_time_s", None)


def smooth(xs: list[float], w: int) -> list[float]:
    from bench_wire import _smooth  # the same trailing mean as the compute-bound runs (its caller's folder is on the path)

    return _smooth(xs, w)


def summarize(results: dict, target_step: int, window: int) -> dict:
    """Per run against its fp32 baseline (pp_fp32 or dp_fp32): the smoothed loss at the baseline's
    last step (equal tokens), the measured wall-clock to reach the baseline's smoothed loss at
    ``target_step``, bytes per step, and the planner's predicted step beside the measured median."""
    out = {}
    for name, r in results.items():
        base = results.get("pp_fp32" if name.startswith("pp") else "dp_fp32")
        if base is None:
            continue
        sm, sb = smooth(r["losses"], window), smooth(base["losses"], window)
        n = min(target_step, len(sb), len(sm)) - 1
        reach = next((i for i, x in enumerate(sm) if x <= sb[n]), None)
        tb = sum(base["step_times_s"][:n + 1])
        tr = None if reach is None else sum(r["step_times_s"][:reach + 1])
        m = min(len(sm), len(sb)) - 1
        pred = r.get("predicted_step_s")
        out[name] = {"steps": len(r["losses"]), "loss": sm[m], "baseline_loss": sb[m], "loss_vs_baseline": sm[m] / sb[m] - 1,
                     "target_step": n + 1, "target_loss": sb[n], "reaches_at_step": None if reach is None else reach + 1,
                     "time_to_target_s": tr, "baseline_time_to_target_s": tb, "speedup": tb / tr if tr else None,
                     "bytes_per_step": r["bytes_per_step"], "fewer_bytes": base["bytes_per_step"] / max(1, r["bytes_per_step"]),
                     "median_step_s": r["median_step_s"], "predicted_step_s": pred,
                     "predicted_vs_measured": None if not pred else pred / r["median_step_s"] - 1,
                     "loadavg": [r["loadavg_before"][0], r["loadavg_after"][0]]}
    return out


def table(summary: dict, rate: str, window: int, cpu_period_ms: float = 100.0, where: str | None = None) -> str:
    where = where or (f"the emulated seed-003 cluster (pi3.json: 3 namespaces, 0.6 core each over "
                      f"{cpu_period_ms:g} ms CPU quota periods), every link {rate} (tc)")
    lines = [f"Measured on {where}; losses smoothed over {window} steps; wall-clock = rank 0's measured steps, summed.", "",
             "| run | steps | loss at equal tokens | vs fp32 | bytes/step | fewer bytes | median step | predicted step "
             "| time to fp32's step-N loss (speed-up) | load avg (before, after) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in summary.items():
        t = ("not reached" if r["time_to_target_s"] is None
             else f"{r['time_to_target_s']:.0f} s at step {r['reaches_at_step']} ({r['speedup']:.2f}x)")
        fewer = f"{r['fewer_bytes']:.1f}x" if r["bytes_per_step"] else "-"
        pred = "-" if r["predicted_step_s"] is None else (f"{r['predicted_step_s']:.3f} s "
                                                          f"({100 * r['predicted_vs_measured']:+.1f}%)")
        lines.append(f"| {name} | {r['steps']} | {r['loss']:.4f} | {100 * r['loss_vs_baseline']:+.2f}% | "
                     f"{r['bytes_per_step'] / 1e3:.1f} kB | {fewer} | "
                     f"{r['median_step_s']:.3f} s | {pred} | "
                     f"N={r['target_step']}: {t} | {r['loadavg'][0]:.1f}, {r['loadavg'][1]:.1f} |")
    return "\n".join(lines) + "\n"


def plot(results: dict, out: Path, window: int, rate: str,
         columns: tuple = ((0, "pp", "pipeline links (seed 003)"), (1, "dp", "data-parallel sync"))) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(columns), figsize=(5.5 * len(columns), 8), squeeze=False)
    for col, prefix, title in columns:
        for name, r in results.items():
            if name.startswith(prefix):
                t, acc = [], 0.0
                for x in r["step_times_s"]:
                    acc += x
                    t.append(acc)
                axes[0][col].plot(t, smooth(r["losses"], window), label=name)
                axes[1][col].plot(range(1, len(r["losses"]) + 1), smooth(r["losses"], window), label=name)
        axes[0][col].set(xlabel=f"measured seconds at {rate}", ylabel="training loss (smoothed)", title=title)
        axes[1][col].set(xlabel="step (equal tokens)", ylabel="training loss (smoothed)")
        for ax in axes[:, col]:
            ax.legend()
    fig.tight_layout()
    fig.savefig(out / "loss_vs_time.png", dpi=110)
    plt.close(fig)


def main(args) -> int:
    """``bench_wire.py --cluster``: bring the cluster up at ``args.rate``, run ``args.runs``, take it down."""
    from torchpp.cluster import cluster, tc
    from torchpp.cluster.config import ClusterConfig
    from torchpp.cluster.units import parse_rate

    os.environ["PYTHONPATH"] = str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")
    out = Path(args.out) / f"cluster_{args.rate}"
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    text = work / "text.txt"
    if not text.exists():
        src = Path(args.text) if args.text else Path("/usr/share/vim/vim90/doc")
        text.write_text(src.read_text() if src.is_file() else
                        "\n".join(p.read_text(errors="replace") for p in sorted(src.glob("*.txt"))))
    rows = distinct_per_step(text)
    plans = make_plans(work, [int(h) for h in args.H_list.split(",")], args.outer_lr, args.outer_momentum, rows)
    names = args.runs.split(",") if args.runs else list(plans)
    saved = out / "results.json"
    results = json.loads(saved.read_text())["runs"] if saved.exists() else {}
    cfg = ClusterConfig.load(ROOT / "configs" / "cluster" / "pi3.json").with_rate(parse_rate(args.rate))
    cfg = dataclasses.replace(cfg, cpu_period_ms=args.cpu_period_ms)
    if cfg.needs_netem and not tc.netem_available():
        cfg = cfg.without_netem()
    cluster.up(cfg)
    try:
        got = None
        if args.plan_lossy:
            try:
                got = measure_and_plan(cfg.name, work, args.plan_lossy, not args.profile_together, rows)
            except (RuntimeError, subprocess.CalledProcessError) as e:  # the fixed runs still run
                print(f"planning on the cluster failed: {e}", flush=True)
                names = [n for n in names if n != "pp_planned"]
        if got is not None:
            plans["pp_planned"] = got["plan"]
            names += [] if "pp_planned" in names else ["pp_planned"]
        for name in names:
            r = run_one(cfg.name, name, plans[name], args, text, work)
            results[name] = r
            saved.write_text(json.dumps({"rate": args.rate, "runs": results}, indent=1))
            print(f"{name}: {len(r['losses'])} steps, final loss {r['losses'][-1]:.4f}, median step "
                  f"{r['median_step_s']:.3f} s, {r['bytes_per_step'] / 1e3:.1f} kB/step, run {r['run_wall_s']:.0f} s",
                  flush=True)
    finally:
        cluster.down(cfg.name)
    if got is not None:
        reprice(results, plans, got["costs"])
    window = args.window
    summary = summarize(results, args.target_step, window)
    saved.write_text(json.dumps({"rate": args.rate, "cpu_period_ms": args.cpu_period_ms, "pp": PP, "dp": DP,
                                 "runs": results, "summary": summary}, indent=1))
    (out / "summary.md").write_text(table(summary, args.rate, window, args.cpu_period_ms))
    plot(results, out, window, args.rate)
    print(table(summary, args.rate, window, args.cpu_period_ms))
    return 0
