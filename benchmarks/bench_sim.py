"""Simulations per second of `torchpp simulate` (the numbers the sweep command lives on).

Prices real sweep jobs (every priority scenario of a few environments) on one core and on
all cores through the sweep's own process pool, checks that both give identical completion
times, and prints configurations/s for 4 stages × 8 micro-batches (congestion off and on)
and 16 × 64, for the default ``schedule`` policy and the ``seed002`` compatibility policy.

    PYTHONPATH=. python benchmarks/bench_sim.py [--workers 2] [--quick]
"""
from __future__ import annotations

import argparse
import os
import time

from torchpp.formats import SimParams, SimSettings
from torchpp.sim.sweep import _chunks, map_chunks, scenarios


def jobs_for(stages: int, n: int, count: int) -> list:
    scs = scenarios(0.1)
    envs = [SimParams(stages=stages, n=n, sync_freq=sf, bwd_len=b, prop_len=pl)
            for sf in (1, 2, 4) for b in (2.0, 3.0) for pl in (0.5, 1.0, 2.0) if sf <= n]
    out = [(p, sc) for p in envs for sc in scs]
    return out[:count]


def measure(jobs: list, settings: SimSettings, workers: int, chunk: int = 64) -> tuple[float, list[float]]:
    chunks = list(_chunks(jobs, chunk))
    t0 = time.perf_counter()
    res = [t for ts in map_chunks(chunks, settings, workers) for t in ts]
    return len(jobs) / (time.perf_counter() - t0), res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--quick", action="store_true", help="fewer configurations per row")
    args = ap.parse_args()
    scale = 0.25 if args.quick else 1.0
    rows = [("schedule", 4, 8, False, 1760), ("schedule", 4, 8, True, 1760), ("schedule", 16, 64, False, 88),
            ("schedule", 16, 64, True, 88), ("seed002", 4, 8, False, 352), ("seed002", 4, 8, True, 176)]
    print(f"{'policy':<9} {'shape':>7} {'congestion':>10} {'configs':>7} {'1 core/s':>9} "
          f"{f'{args.workers} cores/s':>10} {'speed-up':>8}  identical")
    for policy, stages, n, cong, count in rows:
        jobs = jobs_for(stages, n, max(8, int(count * scale)))
        st = SimSettings(policy=policy, congestion=cong)
        measure(jobs[:8], st, 1)  # warm the compiled-schedule cache and imports
        r1, a = measure(jobs, st, 1)
        rn, b = measure(jobs, st, args.workers)
        same = all((x == y) or (x != x and y != y) for x, y in zip(a, b)) and len(a) == len(b)
        print(f"{policy:<9} {f'{stages}x{n}':>7} {str(cong):>10} {len(jobs):>7} {r1:>9.0f} {rn:>10.0f} "
              f"{rn / r1:>8.2f}  {same}")


if __name__ == "__main__":
    main()
