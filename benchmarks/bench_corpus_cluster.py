"""A real corpus against synthetic tokens on the emulated homelab cluster, same plan, same hosts.

The demo plans and trains on synthetic tokens; a user's corpus must change nothing a run can
measure but what is learnt: no host runs out of memory under its limit, each rank's peak memory
stays as predicted, and tokens/s stays that of synthetic data (a rank copies its step's rows out
of the memory-mapped ``tokens.bin``; nothing else differs). This takes a finished demo's
measurements and plan (``torchpp demo --out DIR``), brings the cluster up once and trains the plan
alternately on synthetic tokens and on the corpus (S C C S ...), each run predicted, traced and
analysed as the demo does (``Demo.train``), then prints tokens/s per run, the ratio of the
medians, and each run's worst-rank memory error.

    python benchmarks/bench_corpus_cluster.py --demo out/demo --corpus corpus   # root: the emulated cluster
    python benchmarks/bench_corpus_cluster.py --demo out/demo --corpus corpus --quick   # local, 1 round, 3 steps
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def measured(out: Path) -> "object":
    """The measurement files a finished demo left in ``out`` (see ``Demo.measure_and_plan``)."""
    from torchpp.demo import Measured

    m = Measured(files=sorted((out / "hosts").glob("layers_*.json")), capacities=out / "capacities.json",
                 bandwidth=out / "bandwidth" / "bandwidth.json", memory=out / "memory_model.json",
                 devices=out / "devices.json", plan=out / "plan" / "plan.json")
    missing = [str(p) for p in (m.capacities, m.bandwidth, m.memory, m.devices, m.plan, *m.files) if not p.exists()]
    if missing or not m.files:
        sys.exit(f"bench_corpus_cluster: error: --demo {out}: not a finished demo's directory (missing "
                 f"{', '.join(missing) or 'hosts/layers_*.json'}); run `torchpp demo --out {out}` first")
    return m


def main() -> int:
    from torchpp.demo import DemoConfig, check_corpus, demo_hosts
    from torchpp.formats import Plan

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--demo", type=Path, required=True, help="a finished `torchpp demo --out` directory")
    ap.add_argument("--corpus", required=True, help="a corpus from `torchpp data prepare`")
    ap.add_argument("--plan", type=Path, default=None, help="the plan to train (default: the demo's plan/plan.json)")
    ap.add_argument("--rounds", type=int, default=2, help="S C C S blocks (each: one run per data)")
    ap.add_argument("--steps", type=int, default=8, help="steps per run (the first is warm-up)")
    ap.add_argument("--local", action="store_true", help="local processes (for a smoke run; no limits apply)")
    ap.add_argument("--hosts", type=int, default=2, help="local processes with --local")
    ap.add_argument("--out", type=Path, default=None, help="also write the figures as JSON here")
    ap.add_argument("--quick", action="store_true", help="--local, one round of 3 steps: checks that it runs")
    a = ap.parse_args()
    if a.quick:
        a.local, a.rounds, a.steps = True, 1, 3
    m = measured(a.demo)
    plan_path = a.plan or m.plan
    plan = Plan.load(plan_path)
    model = plan.model.name
    corpus = check_corpus(a.corpus, model)
    cfg = dataclasses.replace(DemoConfig(), model=model, steps=a.steps, seq_len=plan.seq_len,
                              global_batch=plan.global_batch)
    order = [d for _ in range(a.rounds) for d in ("synthetic", corpus, corpus, "synthetic")]
    out = a.demo / "corpus_bench"
    runs = []
    with demo_hosts(cfg, out, a.local, a.hosts) as demo:
        demo.p.total = demo.p.done + 3 * len(order) + (0 if demo.hosts.mode == "local processes" else 1)
        for i, data in enumerate(order):
            demo.cfg.data = data
            r = demo.train(f"{i:02d}_{'synthetic' if data == 'synthetic' else 'corpus'}", plan_path, m)
            runs.append({"data": data, "step_s": r.measured_step_s, "spread": r.spread,
                         "tokens_per_s": plan.global_batch * plan.seq_len / r.measured_step_s,
                         "predicted_step_s": r.predicted_step_s, "memory_error": r.memory_error,
                         "memory_mib": r.memory_mib})
    syn = statistics.median(r["tokens_per_s"] for r in runs if r["data"] == "synthetic")
    cor = statistics.median(r["tokens_per_s"] for r in runs if r["data"] != "synthetic")
    print(f"\n{'run':<4} {'data':<10} {'step s':>8} {'spread':>7} {'tokens/s':>9} {'memory error (worst rank)':>26}")
    for i, r in enumerate(runs):
        mem = "-" if r["memory_error"] is None else f"{100 * r['memory_error']:+.1f}%"
        print(f"{i:<4} {'synthetic' if r['data'] == 'synthetic' else 'corpus':<10} {r['step_s']:>8.3f} "
              f"{100 * r['spread']:>6.1f}% {r['tokens_per_s']:>9.1f} {mem:>26}")
    print(f"corpus / synthetic tokens/s (medians of {len(runs) // 2} runs each): {cor / syn:.3f}")
    worst = max((abs(r["memory_error"]) for r in runs if r["memory_error"] is not None), default=None)
    if worst is not None:
        print(f"worst per-rank memory error over every run: {100 * worst:.1f}%")
    if a.out:
        a.out.write_text(json.dumps({"runs": runs, "ratio": cor / syn, "worst_memory_error": worst}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
