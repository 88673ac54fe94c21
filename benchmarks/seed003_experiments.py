"""Seed 003 on an emulated cluster: a 3-stage pipeline vs 3-rank data parallelism at three
link rates (10 Mbit/s, 100 Mbit/s, 1 Gbit/s), same model, same global batch.

    sudo python benchmarks/seed003_experiments.py            # about 5 minutes on 2 cores
    sudo python benchmarks/seed003_experiments.py --quick --out /tmp/seed003

``--quick``: one rate (1 Gbit/s), qwen3-tiny, 3 steps, the probe at two small message sizes: the same
runs and outputs in seconds, not a measurement.

For each rate: bring up `configs/cluster/pi3.json` with every link at that rate, measure the
links with `torchpp bandwidth probe`, run `python -m torchpp.train` once with a pp plan and
once with a dp plan (`torchpp plan`), one process per plan rank on its host
(`torchpp cluster run --plan`; `--launcher torchrun` starts torchrun on every host instead, as
seed 003 does),
take the step time as rank 0 timed it (metrics.jsonl; median over steps 2.., the first is
warm-up) and, as a cross-check, the span of each merged timeline (`timeline_step<N>_all.json`,
first to last event of any rank), take the cluster down.
Writes into --out: `results.csv`, `results.md` (the table), `step_time_vs_rate.png`, the
merged timelines under `timelines/`, plans, and each host's log under `logs/`.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from torchpp.cluster import cluster, tc  # noqa: E402
from torchpp.cluster.config import ClusterConfig  # noqa: E402
from torchpp.cluster.units import parse_rate  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=Path, default=ROOT / "configs" / "cluster" / "pi3.json")
    p.add_argument("--rates", default="10mbit,100mbit,1gbit")
    p.add_argument("--model", default="qwen3-small", help="preset (qwen3-small: 7.3M parameters, hidden 256)")
    p.add_argument("--layers", type=int, default=3, help="decoder layers kept (a multiple of 3 splits evenly)")
    p.add_argument("--global-batch", type=int, default=6, help="samples per step (divisible by 3)")
    p.add_argument("--microbatches", type=int, default=3, help="pipeline micro-batches per step")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=4, help="training steps per run (the first is warm-up)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per training run before it is killed")
    p.add_argument("--out", type=Path, default=ROOT / "out" / "seed003")
    p.add_argument("--no-probe", action="store_true", help="skip measuring each rate with `torchpp bandwidth probe`")
    p.add_argument("--launcher", choices=["plan", "torchrun"], default="plan",
                   help="plan: one python process per plan rank (`cluster run --plan`); torchrun: torchrun "
                        "--nproc-per-node 1 on every host, as seed 003 starts it")
    p.add_argument("--probe-sizes", default="64K,512K,2M,8M", help="message sizes of `torchpp bandwidth probe`")
    p.add_argument("--quick", action="store_true", help="1gbit only, qwen3-tiny, 3 steps, two small probe sizes: checks "
                   "that it runs, no measurement")
    args = p.parse_args(argv)
    if args.quick:
        args.rates, args.model, args.seq_len, args.steps, args.probe_sizes = "1gbit", "qwen3-tiny", 16, 3, "64K,512K"
    return args


def make_plans(args: argparse.Namespace, hosts: list[str], out: Path) -> dict[str, Path]:
    common = ["--model", args.model, "--layers", str(args.layers), "--global-batch", str(args.global_batch),
              "--seq-len", str(args.seq_len), "--hosts", ",".join(hosts)]
    plans = {"pp": out / "plan_pp.json", "dp": out / "plan_dp.json"}
    for mode, extra in (("pp", ["--strategy", "pp", "--stages", str(len(hosts)),
                                "--microbatches", str(args.microbatches)]),
                        ("dp", ["--strategy", "dp", "--devices", str(len(hosts)), "--microbatches", "1"])):
        subprocess.run([sys.executable, "-m", "torchpp", "plan", *common, *extra, "--out", str(plans[mode])],
                       check=True, cwd=ROOT)
    return plans


def train_argv(args: argparse.Namespace, plan: Path, trace_dir: Path, log_dir: Path) -> list[str]:
    head = ([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1"]
            if args.launcher == "torchrun" else [sys.executable])  # plan: ranks come from `cluster run --plan`
    return [*head, "-m", "torchpp.train", "--plan", str(plan), "--model", args.model, "--layers", str(args.layers),
            "--data", "synthetic", "--steps", str(args.steps), "--threads", "1", "--timeout-s", str(args.timeout),
            "--trace-dir", str(trace_dir), "--trace-steps", ",".join(str(s) for s in range(2, args.steps + 1)),
            "--log-dir", str(log_dir), "--no-output"]


def metric_step_times(log_dir: Path) -> dict[int, float]:
    """Step -> seconds, as rank 0 timed each optimizer step (metrics.jsonl)."""
    out = {}
    path = log_dir / "metrics.jsonl"
    for line in path.read_text().splitlines() if path.exists() else []:
        rec = json.loads(line)
        if "step" in rec and "step_time_s" in rec:
            out[int(rec["step"])] = float(rec["step_time_s"])
    return out


def step_times(trace_dir: Path) -> dict[int, float]:
    """Step -> seconds from the first to the last event of any rank, in the merged timelines."""
    from torchpp.trace.analyze import analyze, events_from_trace
    from torchpp.trace.chrome import load_trace
    out = {}
    for path in sorted(trace_dir.rglob("timeline_step*_all.json")):
        step = int(path.name.removeprefix("timeline_step").split("_")[0])
        out[step] = analyze(events_from_trace(load_trace(path))).step_time_s
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ["PYTHONPATH"] = str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")
    t_start = time.monotonic()
    base = ClusterConfig.load(args.config)
    hosts = [h.name for h in base.hosts]
    args.out.mkdir(parents=True, exist_ok=True)
    plans = make_plans(args, hosts, args.out)
    netem = tc.netem_available()
    rows = []
    for rate_text in args.rates.split(","):
        rate = parse_rate(rate_text)
        cfg = base.with_rate(rate)
        if cfg.needs_netem and not netem:
            cfg = cfg.without_netem()
        print(f"== {rate_text}: cluster {cfg.name} up ({len(hosts)} hosts, every link {rate / 1e6:g} Mbit/s"
              f"{'' if netem else ', no delay: this kernel has no netem'})", flush=True)
        cluster.up(cfg)
        try:
            probed = None
            if not args.no_probe:
                pdir = args.out / "probe" / rate_text
                rc, res = cluster.run(cfg.name, [sys.executable, "-m", "torchpp", "bandwidth", "probe", "--out-dir",
                                                 str(pdir), "--sizes", args.probe_sizes, "--pair-budget", "4",
                                                 "--repeats", "2", "--pings", "5"],
                                      args.out / "logs" / f"probe_{rate_text}", timeout=300)
                if rc == 0:
                    from torchpp.formats import Bandwidth
                    rates = Bandwidth.load(pdir / "bandwidth.json").bytes_per_sec.values()
                    probed = statistics.median(rates) * 8 / 1e6
                    print(f"   probe: median link {probed:.1f} Mbit/s", flush=True)
            for mode in ("pp", "dp"):
                tag = f"{mode}_{rate_text}"
                trace_dir, logs, metrics = (args.out / "traces" / tag, args.out / "logs" / tag,
                                            args.out / "metrics" / tag)
                for d in (trace_dir, metrics):
                    shutil.rmtree(d, ignore_errors=True)
                t0 = time.monotonic()
                rc, res = cluster.run(cfg.name, train_argv(args, plans[mode], trace_dir, metrics), logs,
                                      timeout=args.timeout, plan=plans[mode] if args.launcher == "plan" else None)
                wall = time.monotonic() - t0
                if rc != 0:
                    bad = next(r for r in res if r.returncode != 0)
                    print(f"{tag}: failed (exit {rc}); last lines of {bad.log}:\n{cluster.tail(bad.log)}")
                    return rc
                timed = metric_step_times(metrics)
                spans = step_times(trace_dir)
                measured = [t for s, t in sorted(timed.items()) if s >= 2]
                if not measured or not spans:
                    print(f"{tag}: no step times in {metrics}/metrics.jsonl or no timelines in {trace_dir}")
                    return 1
                row = {"mode": mode, "rate_mbit": rate / 1e6, "step_time_s": round(statistics.median(measured), 4),
                       "min_step_s": round(min(measured), 4), "steps_used": len(measured),
                       "timeline_span_s": round(statistics.median(spans.values()), 4), "run_wall_s": round(wall, 1),
                       "probe_mbit": None if probed is None else round(probed, 2),
                       "delay": "config" if netem else "none (no netem)"}
                rows.append(row)
                print(f"   {mode}: step {row['step_time_s']:.3f}s (median of {len(measured)}), "
                      f"run {wall:.0f}s", flush=True)
                tl = args.out / "timelines"
                tl.mkdir(exist_ok=True)
                for path in trace_dir.rglob("timeline_step*_all.json"):
                    shutil.copy(path, tl / f"{tag}_{path.name}")
        finally:
            cluster.down(cfg.name)
    write_outputs(rows, args)
    print(f"seed 003 done in {time.monotonic() - t_start:.0f}s")
    return 0


def base_hosts(args: argparse.Namespace):
    return ClusterConfig.load(args.config).hosts


def write_outputs(rows: list[dict], args: argparse.Namespace) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(args.out / "results.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    rates = sorted({r["rate_mbit"] for r in rows})
    by = {(r["mode"], r["rate_mbit"]): r["step_time_s"] for r in rows}
    lines = [f"Seed 003 on `{args.config.name}`: {args.model} ({args.layers} layers), global batch "
             f"{args.global_batch}, seq {args.seq_len}, PP with {args.microbatches} micro-batches; "
             f"median step time over steps 2..{args.steps}.",
             f"Hosts: {', '.join(f'{h.name} ({h.cpu:g} core, {h.memory / 2**30:g} GiB)' for h in base_hosts(args))}; "
             f"every link at the rate of the row; launcher: {args.launcher}; delays: "
             f"{rows[0]['delay']}.", "",
             "| link | probed (Mbit/s) | PP 3-stage step (s) | DP 3-rank step (s) | DP / PP | "
             "timeline span PP / DP (s) |", "|---|---|---|---|---|---|"]
    span = {(r["mode"], r["rate_mbit"]): r["timeline_span_s"] for r in rows}
    probe = {r["rate_mbit"]: r["probe_mbit"] for r in rows}
    for rate in rates:
        pp, dp = by.get(("pp", rate)), by.get(("dp", rate))
        pr = "-" if probe.get(rate) is None else f"{probe[rate]:.1f}"
        lines.append(f"| {rate:g} Mbit/s | {pr} | {pp:.3f} | {dp:.3f} | {dp / pp:.2f} | "
                     f"{span[('pp', rate)]:.3f} / {span[('dp', rate)]:.3f} |")
    (args.out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    fig, ax = plt.subplots(figsize=(6, 4))
    for mode, label in (("pp", "pipeline (3 stages)"), ("dp", "data parallel (3 ranks)")):
        ax.plot(rates, [by[(mode, r)] for r in rates], marker="o", label=label)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("link rate (Mbit/s)")
    ax.set_ylabel("step time (s)")
    ax.set_title(f"{args.model}, {args.config.stem}: step time vs link rate")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out / "step_time_vs_rate.png", dpi=120)
    print(f"wrote {args.out / 'results.csv'}, results.md, step_time_vs_rate.png, timelines/")


if __name__ == "__main__":
    sys.exit(main())
