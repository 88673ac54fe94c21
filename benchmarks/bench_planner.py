"""Planner benchmarks: planning time at 8 × 28 and 64 × 96, and the gap to exhaustive search.

    PYTHONPATH=. python benchmarks/bench_planner.py [--instances 12] [--skip-large]

Planning time: synthetic clusters shaped like Qwen3-0.6B on CPU hosts (a tail costing about ten
decoder layers, hosts 0.5–3× the reference speed with 2–16 GiB, links 0.1–1 Gbit/s), global
batch 32 / 64. Targets: < 1 s and < 10 s. Wall and CPU time are both printed: on a shared
machine the CPU time of this process is the figure that does not depend on other load.

Gap: random small instances (3–4 devices, 4–5 layers, tight memory, uneven links); the
exhaustive search tries every micro-batch size, every sequence of disjoint device sets (any
order, any subset, idle devices allowed) and every contiguous layer split, gives each plan
Algorithm 1 shares and the recompute MILP, and prices it by replaying its action lists — the
same pricing the planner's answer gets. Target: planner / exhaustive <= 1.02.
"""
from __future__ import annotations

import argparse
import itertools
import random
import statistics
import sys
import time

from torchpp.formats import GB, Bandwidth
from torchpp.cost import Links, MemoryEstimator, Profiles
from torchpp.sim.measured import price
from torchpp.planner.search import InfeasibleError, Problem, StageChoice, Tables, build_plan, search
from torchpp.planner.synthetic import layers_file, random_instance


def qwen_like(rng: random.Random, hosts: int, layers: int) -> tuple[list, Bandwidth, dict]:
    names = [f"cpu{i}" for i in range(hosts)]
    layer_s = 0.8  # one decoder layer forward for 4 samples of 512 tokens on the reference host
    files = [layers_file(h, num_layers=layers, speed=rng.choice([0.5, 1.0, 1.5, 2.0, 3.0]), batch=4, seq_len=512,
                         layer_fwd_s=[layer_s * rng.uniform(0.95, 1.05) for _ in range(layers)],
                         embed_fwd_s=0.05, tail_fwd_s=10 * layer_s, layer_param_bytes=62_923_776,
                         embed_param_bytes=622_329_856, tail_param_bytes=622_333_952,
                         act_bytes_per_sample=512 * 1024 * 4) for h in names]
    rates = {Bandwidth.key(a, b): rng.choice([0.1, 0.5, 1.0]) * 1e9 / 8 for a in names for b in names if a != b}
    mem = {h: rng.choice([2, 4, 8, 16]) * GB for h in names}
    return files, Bandwidth(bytes_per_sec=rates, latency_s={k: 2e-4 for k in rates}), mem


def timing(hosts: int, layers: int, G: int, seed: int = 0) -> tuple[float, float, str, float]:
    files, bw, mem = qwen_like(random.Random(seed), hosts, layers)
    pb = Problem(profiles=Profiles.from_layers(files), links=Links(bw), hosts=[f.host for f in files], budget=mem,
                 memory=MemoryEstimator.analytic(), global_batch=G)
    t0, c0 = time.perf_counter(), time.process_time()
    res = search(pb)
    return time.perf_counter() - t0, time.process_time() - c0, res.mode, res.step_time_s


def exhaustive(pb: Problem) -> float:
    t = Tables(pb)
    N, L = len(pb.hosts), t.L
    best = float("inf")
    for b in [x for x in range(1, pb.global_batch + 1) if pb.global_batch % x == 0]:
        for S in range(1, min(N, L) + 1):
            for labels in itertools.product(range(S + 1), repeat=N):
                groups = [[d for d in range(N) if labels[d] == s] for s in range(S)]
                if not all(groups) or any(len(g) > b for g in groups):
                    continue
                order = [d for g in groups for d in g]
                pos, stages_hosts = 0, []
                for g in groups:
                    stages_hosts.append((pos, pos + len(g)))
                    pos += len(g)
                for cuts in itertools.combinations(range(1, L), S - 1):
                    bounds = (0, *cuts, L)
                    stages = [StageChoice(cut=(bounds[i], bounds[i + 1]), hosts=stages_hosts[i], recompute_all=False,
                                          cost=0.0) for i in range(S)]
                    plan = build_plan(pb, t, order, stages, b, "exhaustive")
                    if plan is None:
                        continue
                    best = min(best, price(plan, pb.profiles, pb.links)[0])
    return best


def gap(instances: int, seed: int = 7) -> list[float]:
    rng = random.Random(seed)
    ratios = []
    while len(ratios) < instances:
        N, L = rng.randint(3, 4), rng.randint(4, 5)
        files, bw, mem = random_instance(rng, hosts=N, layers=L, batch=2)
        pb = Problem(profiles=Profiles.from_layers(files), links=Links(bw), hosts=[f.host for f in files],
                     budget=mem, memory=MemoryEstimator.analytic(), global_batch=rng.choice([2, 4]))
        try:
            got = search(pb).step_time_s
        except InfeasibleError:
            continue
        ex = exhaustive(pb)
        ratios.append(got / ex)
        print(f"  instance {len(ratios):>2}: {N} devices, {L} layers, G={pb.global_batch}: planner {got:.4g} s, "
              f"exhaustive {ex:.4g} s, ratio {got / ex:.4f}", flush=True)
    return ratios


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--instances", type=int, default=12)
    ap.add_argument("--skip-large", action="store_true")
    a = ap.parse_args()
    print("planning time")
    for hosts, layers, G, target in ((8, 28, 32, 1.0), (64, 96, 64, 10.0))[: 1 if a.skip_large else 2]:
        secs, cpu, mode, step = timing(hosts, layers, G)
        print(f"  {hosts:>2} devices x {layers:>2} layers (G={G}): {secs:.3f} s wall, {cpu:.3f} s CPU "
              f"(target < {target:g} s) "
              f"[{mode}], predicted step {step:.4g} s", flush=True)
    print("gap to exhaustive search over every device order and subset (priced)")
    r = gap(a.instances)
    if r:
        print(f"  worst {max(r):.4f}, mean {statistics.mean(r):.4f}, instances at 1.0000: "
              f"{sum(x <= 1 + 1e-9 for x in r)}/{len(r)} (target worst <= 1.02)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
