"""Does it still train? fp32 vs bf16 vs int8 pipeline links, and fp32 DDP vs DiLoCo, on real text.

Every run is a real torchpp training run (``torchpp.runtime.trainer.train`` on gloo ranks, the
plan's wire fields applied by the runtime) of the same model from the same seed on the same
batches of real text (UTF-8 bytes of the vim manual on this machine, or any ``--text``; byte
tokens, the runtime's own reader). Two experiments, two ranks each:

- pipeline: 2 stages; the link carries fp32, bf16 or int8 (gradients with error feedback);
- data parallel: 2 replicas; fp32 gradient all-reduce every step (DDP) or DiLoCo (inner AdamW,
  outer Nesterov SGD every H steps, the parameter change all-reduced in int8).

Link rate is **emulated, not imposed**: each run's bytes on the wire per step (activations and
gradients as the runtime encoded them, read from a traced step; the all-reduce's ring bytes from
the parameter bytes) are divided by the rate and added to the run's median measured step time (its
warm-up step left out; a median, because the machine is shared), as if no transfer overlapped
compute (the same assumption for every run). The measured step includes the runtime's real
encode/decode. So "a step at 10 Mbit/s" = median measured step + bytes / 1.25 MB/s.

Outputs in ``--out``: ``results.json`` (every step's loss and time, bytes per step), ``summary.md``
(the table), ``loss_vs_time_<rate>.png``, ``loss_vs_tokens.png`` and ``bytes_per_step.png``.

    python benchmarks/bench_wire.py [--steps 250] [--out benchmarks/results/bench_wire] [--quick]
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEXTS = [Path("/usr/share/vim/vim90/doc"), ROOT / "tests" / "data" / "corpus.txt"]
RATES_MBIT = (10, 100)
MODEL, SEQ, BATCH, MICRO = "qwen3-tiny", 64, 8, 4


def _text(given: str | None, quick: bool, tmp: Path) -> Path:
    """A text file of prose: ``given``, else the vim manual (a few MB), else the test corpus."""
    if given:
        return Path(given)
    src = TEXTS[1] if quick else next((p for p in TEXTS if p.exists()), TEXTS[1])
    if src.is_dir():
        out = tmp / "text.txt"
        out.write_text("\n".join(p.read_text(errors="replace") for p in sorted(src.glob("*.txt"))))
        return out
    return src


def _plans(tmp: Path, H: int, outer_lr: float, outer_momentum: float) -> dict[str, Path]:
    from torchpp.formats import Sync
    from torchpp.models.presets import load_config, model_info
    from torchpp.planner.simple import make_plan

    info = model_info(load_config(MODEL), MODEL)
    out = {}
    for name, wire in (("pp_fp32", None), ("pp_bf16", "bf16"), ("pp_int8", "int8")):
        p = make_plan(info, seq_len=SEQ, global_batch=BATCH, num_microbatches=MICRO, layer_ranges=[(0, 2), (2, 4)],
                      group_sizes=[1, 1], schedule="1f1b")
        p.stages[0].wire = wire
        out[name] = p
    for name, sync in (("dp_fp32", None), (f"dp_diloco{H}", Sync(kind="diloco", H=H, wire="int8", outer_lr=outer_lr,
                                                                 outer_momentum=outer_momentum))):
        p = make_plan(info, seq_len=SEQ, global_batch=BATCH, num_microbatches=MICRO // 2, layer_ranges=[(0, 4)],
                      group_sizes=[2], schedule="1f1b")
        p.stages[0].sync = sync
        out[name] = p
    paths = {}
    for name, p in out.items():
        paths[name] = tmp / f"{name}.json"
        p.save(paths[name])
    return paths


def _run_rank(rank: int, world: int, case: dict) -> None:
    from torchpp.runtime.trainer import TrainConfig, train

    s = train(TrainConfig(**case["config"]))
    if rank == 0:
        Path(case["result"]).write_text(json.dumps({"losses": s.losses, "step_times_s": s.step_times_s}))


def _wire_bytes(trace_dir: Path) -> int:
    """Bytes one traced step put on the pipeline link (every rank's sends, as encoded)."""
    from torchpp.trace.analyze import wire_bytes

    return wire_bytes((json.loads(f.read_text()) for f in trace_dir.rglob("timeline_step*_rank*.json")),
                      kinds=("send_act", "send_grad"))


def _param_bytes(plan_path: Path) -> int:
    from torchpp.models.presets import build_model

    return sum(p.numel() * 4 for p in build_model(MODEL, seed=0).parameters())


def run(args: argparse.Namespace) -> dict:
    from torchpp.formats import Plan
    from torchpp.runtime.launch import RankPool

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="bench_wire_"))
    text = _text(args.text, args.quick, tmp)
    plans = _plans(tmp, args.H, args.outer_lr, args.outer_momentum)
    if args.runs:
        plans = {k: v for k, v in plans.items() if k in args.runs.split(",")}
    old = out / "results.json"
    results = json.loads(old.read_text())["runs"] if args.runs and old.exists() else {}
    with RankPool(2, threads=1) as pool:
        for name, plan in plans.items():
            res = tmp / f"{name}.result.json"
            cfg = dict(plan=plan, steps=args.steps, data=str(text), tokenizer="bytes", lr=args.lr, warmup_steps=min(20, args.steps // 10),
                       seed=0, threads=1, timeout_s=120.0,
                       trace_dir=tmp / f"tr_{name}", trace_steps=(2,))
            pool.run(_run_rank, {"config": cfg, "result": str(res)}, world=2, timeout_s=3000, pg_timeout_s=120)
            r = json.loads(res.read_text())
            pb = _param_bytes(plan)
            sync = Plan.load(plan).stages[0].sync
            if name.startswith("pp"):
                r["bytes_per_step"] = _wire_bytes(tmp / f"tr_{name}")
            elif sync is None:  # ring all-reduce of 2 replicas: each sends its whole gradient once
                r["bytes_per_step"] = pb
            else:  # int8 codes plus one fp32 scale per 256 values, all-gathered every H steps
                r["bytes_per_step"] = (pb // 4 + 4 * math.ceil(pb / 4 / 256)) / sync.H
            results[name] = r
            print(f"{name}: final loss {r['losses'][-1]:.4f}, {r['bytes_per_step'] / 1e3:.1f} kB/step on the wire, "
                  f"median step {sorted(r['step_times_s'])[len(r['step_times_s']) // 2] * 1e3:.1f} ms measured",
                  flush=True)
    summary = summarize(results, args)
    (out / "results.json").write_text(json.dumps({"settings": vars(args) | {"text": str(text), "model": MODEL,
                                                                           "seq_len": SEQ, "global_batch": BATCH},
                                                  "runs": results, "summary": summary}, indent=1, default=str))
    (out / "summary.md").write_text(table(summary, args))
    plot(results, out, args)
    print(table(summary, args))
    return summary


def mean_and_error(xs: list[float]) -> tuple[float, float | None]:
    """Mean of a run's per-seed gaps and its standard error (None from one seed): one seed's gap can
    be noise, so the benchmarks that repeat runs over training seeds report both."""
    import statistics

    return statistics.fmean(xs), statistics.stdev(xs) / len(xs) ** 0.5 if len(xs) > 1 else None


def _smooth(xs: list[float], w: int) -> list[float]:
    out, acc = [], 0.0
    for i, x in enumerate(xs):
        acc += x
        if i >= w:
            acc -= xs[i - w]
        out.append(acc / min(i + 1, w))
    return out


def _times(r: dict, rate_mbit: float) -> list[float]:
    """Cumulative emulated seconds after each step at ``rate_mbit``: the run's median measured step
    (its first step, the warm-up, and the load of a shared machine left out) plus its bytes over the link."""
    steps = sorted(r["step_times_s"][1:] or r["step_times_s"])
    step = steps[len(steps) // 2] + r["bytes_per_step"] / (rate_mbit * 1e6 / 8)
    return [step * (i + 1) for i in range(len(r["losses"]))]


def summarize(results: dict, args: argparse.Namespace) -> dict:
    """Per run against its fp32 baseline: loss at equal tokens (the last step, smoothed), bytes per step
    and, per rate, the emulated time to reach the baseline's final smoothed loss."""
    w = max(1, min(args.window, args.steps // 4))
    out = {}
    for name, r in results.items():
        base = results["pp_fp32" if name.startswith("pp") else "dp_fp32"]
        sm, sb = _smooth(r["losses"], w), _smooth(base["losses"], w)
        n = min(args.target_step, len(sb)) - 1
        target = sb[n]
        reach = next((i for i, x in enumerate(sm) if x <= target), None)
        row = {"loss": sm[-1], "baseline_loss": sb[-1], "loss_vs_baseline": sm[-1] / sb[-1] - 1,
               "target_step": n + 1, "target_loss": target,
               "bytes_per_step": r["bytes_per_step"], "bytes_reduction": base["bytes_per_step"] / r["bytes_per_step"],
               "reaches_baseline_at_step": None if reach is None else reach + 1}
        for rate in RATES_MBIT:
            tb = _times(base, rate)[n]
            tr = _times(r, rate)[reach] if reach is not None else None
            row[f"time_to_baseline_loss_s@{rate}"] = tr
            row[f"speedup@{rate}"] = tb / tr if tr else None
        out[name] = row
    return out


def table(summary: dict, args: argparse.Namespace) -> str:
    lines = [f"{args.steps} steps of {MODEL}, {BATCH} x {SEQ} byte tokens per step, 2 ranks; losses smoothed over "
             f"{max(1, min(args.window, args.steps // 4))} steps; time = median measured step + bytes / rate (emulated link)",
             "", "| run | loss at equal tokens | vs fp32 | bytes/step | fewer bytes | "
             + " | ".join(f"time to fp32's step-{min(args.target_step, args.steps)} loss @{r} Mbit/s (speed-up)"
                          for r in RATES_MBIT) + " |",
             "|---|---|---|---|---|" + "---|" * len(RATES_MBIT)]
    for name, r in summary.items():
        cells = []
        for rate in RATES_MBIT:
            t = r[f"time_to_baseline_loss_s@{rate}"]
            cells.append("not reached" if t is None else f"{t:.1f} s ({r[f'speedup@{rate}']:.2f}x)")
        lines.append(f"| {name} | {r['loss']:.4f} | {100 * r['loss_vs_baseline']:+.2f}% | {r['bytes_per_step'] / 1e3:.1f} kB"
                     f" | {r['bytes_reduction']:.1f}x | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(results: dict, out: Path, args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    w = max(1, min(args.window, args.steps // 4))
    tokens = BATCH * SEQ
    for rate in RATES_MBIT:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for ax, prefix, title in ((axes[0], "pp", "pipeline link"), (axes[1], "dp", "data-parallel sync")):
            for name, r in results.items():
                if name.startswith(prefix):
                    ax.plot(_times(r, rate), _smooth(r["losses"], w), label=name)
            ax.set(xlabel=f"emulated seconds at {rate} Mbit/s", ylabel="training loss (smoothed)", title=title)
            ax.legend()
        fig.tight_layout()
        fig.savefig(out / f"loss_vs_time_{rate}mbit.png", dpi=110)
        plt.close(fig)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, prefix in ((axes[0], "pp"), (axes[1], "dp")):
        for name, r in results.items():
            if name.startswith(prefix):
                ax.plot([tokens * (i + 1) for i in range(len(r["losses"]))], _smooth(r["losses"], w), label=name)
        ax.set(xlabel="tokens", ylabel="training loss (smoothed)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(out / "loss_vs_tokens.png", dpi=110)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(7, 3.5))
    names = list(results)
    ax.bar(names, [results[n]["bytes_per_step"] / 1e3 for n in names])
    ax.set(ylabel="kB on the wire per step", yscale="log")
    fig.tight_layout()
    fig.savefig(out / "bytes_per_step.png", dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=250)
    ap.add_argument("--H", type=int, default=8, help="DiLoCo's period")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--outer-lr", type=float, default=1.0, help="DiLoCo's outer learning rate")
    ap.add_argument("--outer-momentum", type=float, default=0.0, help="DiLoCo's outer Nesterov momentum")
    ap.add_argument("--runs", default=None, help="only these runs (e.g. dp_diloco4), merged into --out's results.json")
    ap.add_argument("--target-step", type=int, default=200,
                    help="the step N whose fp32 loss the other runs must reach (the Done-when's N)")
    ap.add_argument("--window", type=int, default=25, help="steps of the loss moving average")
    ap.add_argument("--text", default=None, help="a text file (default: the vim manual, else tests/data/corpus.txt)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "bench_wire"))
    ap.add_argument("--quick", action="store_true", help="a few steps on the test corpus (for the tests)")
    c = ap.add_argument_group("--cluster: real tc-shaped links (benchmarks/bench_wire_cluster.py; root)")
    c.add_argument("--cluster", action="store_true", help="run on seed 003's emulated cluster instead of emulating the link")
    c.add_argument("--rate", default="10mbit", help="every link's rate")
    c.add_argument("--H-list", default="16", help="DiLoCo periods to run (comma-separated)")
    c.add_argument("--warmup", type=int, default=20, help="learning-rate warm-up steps")
    c.add_argument("--plan-lossy", default=None, metavar="bf16,int8,powersgd",
                   help="profile and probe on the cluster, plan with --allow-lossy this, run that plan as pp_planned")
    c.add_argument("--profile-together", action="store_true",
                   help="--plan-lossy: profile every host at once (default: one at a time, as separate machines "
                        "would be: at once they share this machine's cores and price compute high)")
    c.add_argument("--work", default="/tmp/bench_wire_cluster", help="plans, traces and logs")
    c.add_argument("--run-timeout", type=float, default=3600.0, help="seconds per run before it is killed")
    c.add_argument("--cpu-period-ms", type=float, default=3.0,
                   help="every host's CPU quota period: short, so a host is a slower CPU at every instant as a Pi "
                        "is (at the kernel's 100 ms a rank that waits on its links computes in bursts at a whole "
                        "core's speed, faster than its busy profile)")
    args = ap.parse_args(argv)
    if args.cluster:
        sys.path.insert(0, str(ROOT / "benchmarks"))
        from bench_wire_cluster import main as cluster_main

        return cluster_main(args)
    if args.quick:
        args.steps = min(args.steps, 6)
        args.H = min(args.H, 2)
    run(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
