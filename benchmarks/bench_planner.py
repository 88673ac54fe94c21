"""Planner benchmarks: planning time at 8 × 28 and 64 × 96, and the gap to exhaustive search.

    PYTHONPATH=. python benchmarks/bench_planner.py [--instances 12] [--skip-large]
    PYTHONPATH=. python benchmarks/bench_planner.py --quick [--gantts /tmp/gantts]   # checks that it runs

``--quick``: 8 × 28 only, one random cluster, one instance against exhaustive search (with
``--gantts``: 1f1b and zbv only). Seconds, not a measurement.

Planning time: synthetic clusters shaped like Qwen3-0.6B on CPU hosts (a tail costing about ten
decoder layers, hosts 0.5–3× the reference speed with 2–16 GiB, links 0.1–1 Gbit/s), global
batch 32 / 64. Targets: < 1 s and < 10 s. Wall and CPU time are both printed: on a shared
machine the CPU time of this process is the figure that does not depend on other load.

Every search runs under ``--schedule 1f1b`` and ``auto`` (every kind, chunked placements
included); beside each, the planner's step over a proven lower bound (planner/bound.py, an LP
relaxation). Seed 000's 4-host instance: planning time, the plan, and seed 000's own plan priced
the same way (target ratio <= 0.5). The gap to brute force over every kind is tests/test_planner_chunks.py.

``plan --schedule auto`` as a user runs it (the planning API: search, prediction, plan_meta): the
CPU seconds of each of ``--random`` (20) random clusters of 2–8 hosts × 4–48 layers, the first
third of 2–3 hosts, against 1 s each, and of 64 hosts × 96 layers against 10 s; with each, the size
of its plan.json and plan_meta.json (target <= 100 kB).

Gap: random small instances (3–4 devices, 4–5 layers, tight memory, uneven links); the
exhaustive search tries every micro-batch size, every sequence of disjoint device sets (any
order, any subset, idle devices allowed) and every contiguous layer split, gives each plan
Algorithm 1 shares and the recompute MILP, and prices it by replaying its action lists — the
same pricing the planner's answer gets. Target: planner / exhaustive <= 1.02.

Device orders: past ``exact_devices`` (5) the 1F1B DP sees three device orders (speed, memory,
link-greedy) and the order search around the best plan's (planner/reorder.py); on ``--orders`` (8)
random 6-device Qwen-like clusters, its step over the same search given all 720 orders, and the
three orders' alone. Target: <= 1.05.

``--certify N``: `plan --certify` on seed 000's 8-host instance and N random 8-host clusters, each
plan's step over the bound proven for every plan of its space (planner/certify.py; target 5%).
``--certify-small N``: the same on N random 3-6-host clusters, where a large gap has pointed at
plans the search missed. ``--exact N``: N random 2-5-host clusters planned with and without the
exact enumeration of the one-chunk kinds (planner/exact.py): the step ratio and the CPU it added.
"""
from __future__ import annotations

import argparse
import itertools
import random
import statistics
import sys
import time

from torchpp.cost import Links, MemoryEstimator, Profiles
from torchpp.sim.measured import price
from torchpp.planner.types import InfeasibleError, Problem, StageChoice
from torchpp.planner.tables import Tables
from torchpp.planner.build import build_plan
from torchpp.planner.search import search
from torchpp.planner.bound import lower_bound
from torchpp.planner.synthetic import qwen_like, random_instance, seed000_instance, seed000_plan


def timing(hosts: int, layers: int, G: int, seed: int = 0, schedule: str = "auto"
           ) -> tuple[float, float, str, float, float]:
    """Wall and CPU seconds of one search, its mode, its step and the proven lower bound."""
    files, bw, mem = qwen_like(random.Random(seed), hosts, layers)
    pb = Problem(profiles=Profiles.from_layers(files), links=Links(bw), hosts=[f.host for f in files], budget=mem,
                 memory=MemoryEstimator.analytic(), global_batch=G, schedule=schedule)
    t0, c0 = time.perf_counter(), time.process_time()
    res = search(pb)
    lb = lower_bound(pb.profiles, pb.hosts, pb.budget, pb.memory, G)
    return time.perf_counter() - t0, time.process_time() - c0, f"{res.plan.schedule}; {res.mode}", res.step_time_s, lb


def plan_cpu(hosts: int, layers: int, G: int, seed: float) -> tuple[float, int, int, str, int] | None:
    """``plan --schedule auto`` through the planning API (search, prediction, plan_meta; the files are
    then written apart, outside the timing) on a ``qwen_like`` cluster: CPU seconds, plan.json and
    plan_meta.json bytes, the chosen kind and the plans priced; None when no plan fits."""
    import tempfile
    from pathlib import Path

    from torchpp.formats import write_json
    from torchpp.planner import api

    files, bw, mem = qwen_like(random.Random(seed), hosts, layers)
    costs = api.Costs(profiles=Profiles.from_layers(files), links=Links(bw), hosts=[f.host for f in files],
                      budget=mem, memory=MemoryEstimator.analytic())
    c0 = time.process_time()
    try:
        res = api.plan(costs, api.PlanOptions(global_batch=G, schedule="auto"))
    except InfeasibleError:
        return None
    cpu = time.process_time() - c0
    with tempfile.TemporaryDirectory() as tmp:
        plan_bytes = res.plan.save(Path(tmp) / "plan.json").stat().st_size
        meta_bytes = write_json(Path(tmp) / "plan_meta.json", res.meta).stat().st_size
    return cpu, plan_bytes, meta_bytes, res.plan.schedule, res.meta["search"]["priced"]


def random_sweep(count: int, seed: int = 11) -> list[tuple[int, int, float, int]]:
    """``plan --schedule auto`` (:func:`plan_cpu`) on ``count`` random clusters of 2–8 hosts and
    4–48 layers, the first third of 2 or 3 hosts (the clusters most people have, where every kind is
    searched exhaustively over device groups): per instance the CPU seconds and the plan files'
    sizes. Targets: every instance <= 1 s CPU, every plan.json and plan_meta.json <= 100 kB."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        hosts = (2, 3)[i] if i < 2 else rng.choice((2, 3, 3)) if i < max(2, count // 3) else rng.randint(2, 8)
        layers = rng.randint(4, 48)
        at = rng.random()
        G = rng.choice([8, 16, 32])
        got = plan_cpu(hosts, layers, G, at)
        if got is None:
            print(f"  instance {i + 1:>2}: {hosts} hosts x {layers:>2} layers, G={G}: no plan fits", flush=True)
            continue
        cpu, plan_bytes, meta_bytes, kind, priced = got
        out.append((hosts, layers, cpu, max(plan_bytes, meta_bytes)))
        print(f"  instance {i + 1:>2}: {hosts} hosts x {layers:>2} layers, G={G:>2}: {cpu:.3f} s CPU, "
              f"plan_meta {meta_bytes / 1e3:.1f} kB, plan {plan_bytes / 1e3:.1f} kB, {kind}, {priced} priced",
              flush=True)
    return out


def seed000() -> None:
    """Seed 000's 4-host instance: planning time, torchpp's plan and seed 000's own plan priced the same way."""
    files, bw, mem, memory = seed000_instance()
    pb = Problem(profiles=Profiles.from_layers(files), links=Links(bw), hosts=list(mem), budget=mem, memory=memory,
                 global_batch=20, micro_batch_sizes=[4], schedule="auto")
    t0, c0 = time.perf_counter(), time.process_time()
    res = search(pb)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    theirs = price(seed000_plan(pb.profiles.model), pb.profiles, pb.links)[0]
    lb = lower_bound(pb.profiles, pb.hosts, pb.budget, pb.memory, 20)
    layout = " | ".join(f"[{s.layers[0]},{s.layers[1]}) {','.join(d.host for d in s.devices)}" for s in res.plan.stages)
    print(f"seed 000's instance: planning {wall:.3f} s wall, {cpu:.3f} s CPU (target <= 1 s)\n"
          f"  torchpp ({res.plan.schedule}): {res.step_time_s:.4g} s  {layout}\n"
          f"  seed 000's plan (1f1b): {theirs:.4g} s; ratio {res.step_time_s / theirs:.3f} (target <= 0.5)\n"
          f"  planner / lower bound {res.step_time_s / lb:.3f} (bound {lb:.4g} s)", flush=True)


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


def orders_gap(count: int, hosts: int = 6, seed: int = 7) -> list[float]:
    """Past ``exact_devices`` (5) the stage DP sees three device orders and the order search around
    the best plan's (planner/reorder.py): on ``count`` random Qwen-like clusters of ``hosts`` devices,
    the 1F1B planner's step over the same search given every order (``exact_devices`` = ``hosts``),
    and the three orders' alone. Target: <= 1.05."""
    from torchpp.planner import single

    rng = random.Random(seed)
    ratios = []
    for i in range(count):
        layers, G, at = rng.randint(4, 24), rng.choice([8, 16, 32]), rng.random()
        files, bw, mem = qwen_like(random.Random(at), hosts, layers)
        got = {}
        for name, exact, reorder in (("exact", hosts, True), ("planner", hosts - 1, True), ("three", hosts - 1, False)):
            pb = Problem(profiles=Profiles.from_layers(files), links=Links(bw), hosts=[f.host for f in files],
                         budget=mem, memory=MemoryEstimator.analytic(), global_batch=G, schedule="1f1b",
                         exact_devices=exact)
            keep = single.REORDER_DEVICES
            single.REORDER_DEVICES = keep if reorder else 0
            c0 = time.process_time()
            try:
                got[name] = (search(pb).step_time_s, time.process_time() - c0)
            except InfeasibleError:
                got = {}
                break
            finally:
                single.REORDER_DEVICES = keep
        if not got:
            print(f"  instance {i + 1}: {hosts} devices x {layers} layers, G={G}: no plan fits", flush=True)
            continue
        ex = got["exact"][0]
        ratios.append(got["planner"][0] / ex)
        print(f"  instance {i + 1}: {hosts} devices x {layers:>2} layers, G={G:>2}: planner / every order "
              f"{got['planner'][0] / ex:.4f} ({got['planner'][1]:.2f} s CPU; three orders alone "
              f"{got['three'][0] / ex:.4f}), every order {ex:.4g} s ({got['exact'][1]:.2f} s CPU)", flush=True)
    return ratios


def certificates(count: int, seed: int = 5) -> list[float]:
    """`plan --certify` on seed 000's 8-host instance and ``count`` random 8-host clusters (4-48
    layers): the plan's step over the bound proven for every plan of the space (planner/certify.py).
    Target: within 5%."""
    from torchpp.planner.certify import certify
    from torchpp.planner.synthetic import seed000_8host_instance

    files, bw, mem, memory = seed000_8host_instance()
    cases = [("seed 000, 8 hosts x 28 layers, G=32", files, bw, mem, memory, 32)]
    rng = random.Random(seed)
    for i in range(count):
        layers, G = rng.randint(4, 48), rng.choice([8, 16, 32])
        files, bw, mem = qwen_like(random.Random(rng.random()), 8, layers)
        cases.append((f"random {i + 1}, 8 hosts x {layers} layers, G={G}", files, bw, mem, MemoryEstimator.analytic(), G))
    gaps = []
    for name, files, bw, mem, memory, G in cases:
        got = _planned(name, files, bw, mem, memory, G)
        if got is None:
            continue
        pb, res = got
        c0 = time.process_time()
        cert = certify(pb, res.step_time_s)
        gaps.append(cert.gap)
        fams = ", ".join(f"{k} {v:.4g}" for k, v in cert.families.items())
        print(f"  {name}: {res.plan.schedule}, {cert.line()}; {time.process_time() - c0:.1f} s CPU; bound per "
              f"family: {fams}", flush=True)
    return gaps


def _planned(name: str, files, bw, mem, memory, G: int):
    """(problem, its ``--schedule auto`` search) of a certificate's cluster; None (said) when no plan fits."""
    pb = Problem(profiles=Profiles.from_layers(files), links=Links(bw), hosts=[f.host for f in files], budget=mem,
                 memory=memory, global_batch=G, schedule="auto")
    try:
        return pb, search(pb)
    except InfeasibleError:
        print(f"  {name}: no plan fits", flush=True)
        return None


def small_certificates(count: int, seed: int = 7) -> list[float]:
    """`plan --certify` on ``count`` random 3-6-host Qwen-like clusters (4-24 layers, G 4-16): the
    certified plan's step over the proven bound (up to 5 hosts every family is enumerated, and a
    faster plan found that way is the one certified, as `plan --certify` returns it). Where the gap
    is large the plan may be: this is how the V head seeds (planner/kinds.py) were found."""
    from torchpp.planner.certify import certify

    rng = random.Random(seed)
    gaps = []
    for i in range(count):
        hosts, layers, G = rng.randint(3, 6), rng.randint(4, 24), rng.choice([4, 8, 16])
        files, bw, mem = qwen_like(random.Random(rng.random()), hosts, layers)
        got = _planned(f"cluster {i + 1}: {hosts} hosts x {layers} layers, G={G}", files, bw, mem,
                       MemoryEstimator.analytic(), G)
        if got is None:
            continue
        pb, res = got
        c0 = time.process_time()
        cert = certify(pb, res.step_time_s)  # as `plan --certify`: a faster plan it finds is taken
        gaps.append(cert.gap)
        wrong = "  BOUND ABOVE THE PLAN" if cert.bound_s > cert.step_s * (1 + 1e-9) else ""
        taken = f" (the search's {res.step_time_s:.4g} s; a faster plan found while certifying)" if cert.plan else ""
        kind = cert.plan.schedule if cert.plan else res.plan.schedule
        print(f"  cluster {i + 1}: {hosts} hosts x {layers:>2} layers, G={G:>2}: {kind}, step "
              f"{cert.step_s:.4g} s, bound {cert.bound_s:.4g} s, within {100 * gaps[-1]:.1f}% "
              f"({time.process_time() - c0:.1f} s CPU){taken}{wrong}", flush=True)
    return gaps


def exact_gain(count: int, seed: int = 5) -> list[tuple[float, float]]:
    """``plan --schedule auto`` on ``count`` random 2-5-host Qwen-like clusters (4-48 layers) with and
    without the exact enumeration of the one-chunk kinds (planner/exact.py, ``kinds.EXACT_DEVICES``),
    back to back on the same clusters: per cluster the step ratio (with / without) and the CPU it added."""
    from torchpp.planner import kinds as K

    keep = K.EXACT_DEVICES
    rng = random.Random(seed)
    out = []
    try:
        for i in range(count):
            hosts, layers, G, at = rng.randint(2, 5), rng.randint(4, 48), rng.choice([8, 16, 32]), rng.random()
            files, bw, mem = qwen_like(random.Random(at), hosts, layers)
            got = {}
            for exact in (0, keep):
                K.EXACT_DEVICES = exact
                pb = Problem(profiles=Profiles.from_layers(files), links=Links(bw), hosts=[f.host for f in files],
                             budget=mem, memory=MemoryEstimator.analytic(), global_batch=G, schedule="auto")
                c0 = time.process_time()
                try:
                    res = search(pb)
                except InfeasibleError:
                    break
                got[exact] = (time.process_time() - c0, res.step_time_s, res.plan.schedule, res.mode.split("; ")[-1])
            if len(got) < 2:
                print(f"  cluster {i + 1}: {hosts} hosts x {layers:>2} layers, G={G:>2}: no plan fits", flush=True)
                continue
            (c_off, s_off, k_off, _), (c_on, s_on, k_on, how) = got[0], got[keep]
            out.append((s_on / s_off, c_on - c_off))
            print(f"  cluster {i + 1}: {hosts} hosts x {layers:>2} layers, G={G:>2}: without {k_off} {s_off:.4g} s "
                  f"({c_off:.2f} s CPU), with {k_on} {s_on:.4g} s ({c_on:.2f} s CPU), ratio {s_on / s_off:.4f} [{how}]",
                  flush=True)
    finally:
        K.EXACT_DEVICES = keep
    return out


def gantts(out: str, kinds: tuple[str, ...] | None = None) -> None:
    """The predicted Gantt of the best plan of each schedule kind on seed 000's instance (one renderer:
    planner/report.write_outputs), saved as ``out/<kind>.png``."""
    import shutil
    import tempfile
    from pathlib import Path

    from torchpp.planner import api
    from torchpp.formats import KIND_NAMES as KINDS

    files, bw, mem, memory = seed000_instance()
    costs = api.Costs(profiles=Profiles.from_layers(files), links=Links(bw), hosts=list(mem), budget=mem, memory=memory)
    Path(out).mkdir(parents=True, exist_ok=True)
    for kind in kinds or KINDS:
        try:
            res = api.plan(costs, api.PlanOptions(global_batch=20, micro_batch_sizes=[4], schedule=kind))
        except InfeasibleError as e:
            print(f"  {kind}: no plan ({str(e)[:80]}...)")
            continue
        with tempfile.TemporaryDirectory() as tmp:
            api.write(res, Path(tmp))
            shutil.copy(Path(tmp) / "gantt.png", Path(out) / f"{kind}.png")
        print(f"  {kind}: {res.plan.predicted['step_time_s']:.4g} s -> {out}/{kind}.png", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--instances", type=int, default=12)
    ap.add_argument("--skip-large", action="store_true")
    ap.add_argument("--random", type=int, default=20, help="random clusters of <= 8 hosts x <= 48 layers planned")
    ap.add_argument("--orders", type=int, default=8, help="6-device clusters planned against every device order")
    ap.add_argument("--certify", type=int, default=0, metavar="N",
                    help="certify seed 000's 8-host instance and N random 8-host clusters (planner/certify.py)")
    ap.add_argument("--certify-small", type=int, default=0, metavar="N",
                    help="certify N random 3-6-host clusters (the bound against the planner's plan)")
    ap.add_argument("--exact", type=int, default=0, metavar="N",
                    help="N random 2-5-host clusters planned with and without the one-chunk kinds' exact enumeration")
    ap.add_argument("--gantts", default=None, help="write each kind's predicted Gantt on seed 000's instance here")
    ap.add_argument("--quick", action="store_true", help="8 x 28 only, 1 random cluster, 1 gap instance (--gantts: "
                    "1f1b and zbv): checks that it runs, no measurement")
    a = ap.parse_args()
    if a.quick:
        a.skip_large, a.random, a.instances, a.orders = True, 1, 1, 1
    if a.gantts:
        gantts(a.gantts, ("1f1b", "zbv") if a.quick else None)
        return 0
    if a.exact:
        print("the one-chunk kinds enumerated exactly (planner/exact.py): --schedule auto with it / without it")
        g = exact_gain(a.exact)
        if g:
            print(f"  {len(g)} clusters: {sum(r < 1 - 1e-9 for r, _ in g)} plans faster (least ratio "
                  f"{min(r for r, _ in g):.4f}), {sum(r > 1 + 1e-9 for r, _ in g)} slower; CPU added: mean "
                  f"{statistics.mean(c for _, c in g):.3f} s, most {max(c for _, c in g):.3f} s")
        return 0
    if a.certify or a.certify_small:
        where, run = (("at 8 devices", lambda: certificates(a.certify)) if a.certify else
                      ("on random 3-6-host clusters", lambda: small_certificates(a.certify_small)))
        print(f"certificates {where} (step over the bound proven for every plan of the space)")
        g = run()
        if g:
            print(f"  worst {100 * max(g):.1f}%, within 5%: {sum(x <= 0.05 for x in g)}/{len(g)}"
                  + (" (target: all)" if a.certify else f", within 15%: {sum(x <= 0.15 for x in g)}/{len(g)}"))
        return 0
    print("planning time")
    for hosts, layers, G, target in ((8, 28, 32, 1.0), (64, 96, 64, 10.0))[: 1 if a.skip_large else 2]:
        for schedule in ("1f1b", "auto"):
            secs, cpu, mode, step, lb = timing(hosts, layers, G, schedule=schedule)
            print(f"  {hosts:>2} devices x {layers:>2} layers (G={G}, --schedule {schedule}): {secs:.3f} s wall, "
                  f"{cpu:.3f} s CPU (target < {target:g} s) [{mode}], predicted step {step:.4g} s, "
                  f"planner / proven lower bound {step / lb:.3f}", flush=True)
    print(f"plan --schedule auto on {a.random} random clusters (2-8 hosts, 4-48 layers)")
    sweep = random_sweep(a.random)
    if sweep:
        print(f"  worst {max(c for _, _, c, _ in sweep):.3f} s CPU, within 1 s: {sum(c <= 1.0 for _, _, c, _ in sweep)}"
              f"/{len(sweep)} (target: all), largest plan file {max(s for *_, s in sweep) / 1e3:.1f} kB (target <= "
              f"100 kB), over {len(sweep)} instances")
    if not a.skip_large:
        got = plan_cpu(64, 96, 64, 0.5)
        if got:
            print(f"plan --schedule auto on 64 hosts x 96 layers (G=64): {got[0]:.3f} s CPU (target <= 10 s), "
                  f"plan_meta {got[2] / 1e3:.1f} kB, plan {got[1] / 1e3:.1f} kB, {got[3]}, {got[4]} priced", flush=True)
    seed000()
    print("device orders past exact_devices: the 1F1B planner against the same search over every order (6 devices)")
    o = orders_gap(a.orders)
    if o:
        print(f"  worst {max(o):.4f}, mean {statistics.mean(o):.4f}, within 5%: {sum(x <= 1.05 for x in o)}/{len(o)} "
              f"(target: all)")
    print("gap to exhaustive search over every device order and subset (priced)")
    r = gap(a.instances)
    if r:
        print(f"  worst {max(r):.4f}, mean {statistics.mean(r):.4f}, instances at 1.0000: "
              f"{sum(x <= 1 + 1e-9 for x in r)}/{len(r)} (target worst <= 1.02)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
