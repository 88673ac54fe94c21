"""The optimising planner: stages, device groups, sample shares, micro-batching, recomputation.

Search (Asteroid's Algorithm 2, widened):

* For every micro-batch size b dividing the global batch (m = G / b micro-batches) and every
  device order considered, a dynamic programme over (stages after this one, head group, first
  layer) chooses contiguous layer cuts and contiguous runs of the order as groups, minimising
  the bottleneck stage time per micro-batch. Devices after the last group stay idle.
* Device orders: every permutation when there are at most ``exact_devices`` devices, which
  makes the search exact over all device subsets and orders; beyond that (the stated
  heuristic) three orders — by speed, by memory, and greedily by link rate from the fastest
  device — with groups of at most ``max_group`` devices and at most ``max_stages`` stages.
* Stage cost (:func:`stage_cost`) per micro-batch: the group's compute time with samples in
  proportion to speed capped by memory (continuous Algorithm 1, see ``allocate.waterfill``),
  with or without recomputing all its layers, whichever is feasible and faster; or the
  activation transfer on the slowest link to the next group, if longer (sends overlap
  compute); plus the group's ring all-reduce divided by m.
* The best candidates per (order, b, stage count), ranked by (m + S − 1) × bottleneck, get
  integer sample counts (Algorithm 1), per-layer recomputation from a MILP under each device's
  memory cap, and are then priced by replaying their action lists (sim.measured.price): the top k by
  that estimate, and the best of every (micro-batch size, stage count) whatever its rank.
* The bottleneck ignores fill/drain and transfer latency, so the best few priced plans are then
  refined by local search on the priced step time (:func:`refine`): move a cut by one layer,
  shift a stage, swap two stages' groups, merge or split stages, move a device between groups
  or in/out of idle.
  The plan with the lowest priced step time wins, so the predicted step time is the simulator's.
"""
from __future__ import annotations

import itertools
import math
import time
from typing import Sequence

from ..formats import Plan
from .build import build_plan
from .dp import dp_orders
from .fastdp import dp_order_fast
from .pricing import price_plan
from .prune import layout_bound
from ..schedules import REGISTRY
from .refine import refine
from .reorder import layout_of, order_of, search_orders
from .tables import StageCosts, Tables, infeasible_message
from .types import (REFINE_HEURISTIC, InfeasibleError, Problem, SearchResult, StageChoice, max_stages_of,
                    micro_batch_sizes, stage_layout)


REORDER_DEVICES = 8
"""Past ``exact_devices``, clusters of at most this many devices also search device orders locally."""
UNPICKED = 12
"""DP candidates beyond those priced whose device groups the chunked kinds also start from (planner/kinds.py)."""
ORDER_STARTS = 2
"""Micro-batch sizes the device-order search starts from: the best priced plan's and the next best
size's (an order is searched at one size; a one-stage plan's size, the winner while every order
tried pipelines badly, is rarely a pipeline's)."""


def device_orders(pb: Problem, t: Tables) -> tuple[list[tuple[int, ...]], str]:
    N = len(pb.hosts)
    if N <= pb.exact_devices:
        return list(itertools.permutations(range(N))), f"exact (all {math.factorial(N)} device orders)"
    speed = sorted(range(N), key=lambda h: (t.full_time[h], h))
    memory = sorted(range(N), key=lambda h: (-pb.budget[pb.hosts[h]], t.full_time[h], h))
    greedy = [speed[0]]
    left = set(range(N)) - {speed[0]}
    while left:
        last = pb.hosts[greedy[-1]]
        nxt = min(left, key=lambda h: (pb.links.time(last, pb.hosts[h], 1e6), t.full_time[h], h))
        greedy.append(nxt)
        left.remove(nxt)
    orders = []
    for o in (speed, memory, greedy):
        if tuple(o) not in orders:
            orders.append(tuple(o))
    return orders, f"heuristic ({len(orders)} device orders: speed, memory, link-greedy; groups <= {pb.max_group})"



def bottlenecks(pb: Problem, t: Tables | None = None, orders: Sequence[tuple[int, ...]] | None = None,
                collect: list | None = None) -> dict[tuple[int, int], tuple[float, tuple[int, ...], list[StageChoice]]]:
    """The DP's optimum per (micro-batch size, stage count): (bottleneck, device order, stages)."""
    t = t or Tables(pb)
    orders = orders if orders is not None else device_orders(pb, t)[0]
    exact = len(pb.hosts) <= pb.exact_devices
    max_stages = max_stages_of(pb)
    best: dict[tuple[int, int], tuple[float, tuple[int, ...], list[StageChoice]]] = {}
    shared: dict[tuple[int, ...], dict] = {}
    dp_shapes: dict = {}  # the exact DP's states and their links, the same at every micro-batch size
    for b in micro_batch_sizes(pb, exact):
        m = pb.global_batch // b
        sc = StageCosts(t, b, m, pb.allow_recompute)
        every = dp_orders(orders, sc, max_stages, len(pb.hosts), dp_shapes) if exact else None
        for x, order in enumerate(orders):
            if every is not None:
                found = every[x]
            else:
                found = dp_order_fast(order, sc, max_stages, pb.max_group, shared.setdefault(tuple(order), {}))
            for S, (val, stages) in found.items():
                if collect is not None:
                    collect.append(((m + S - 1) * val, val, b, tuple(order), stages))
                if (b, S) not in best or val < best[(b, S)][0]:
                    best[(b, S)] = (val, tuple(order), stages)
    return best



def _unpicked(cands: list, picked: list, n: int) -> list[tuple[int, tuple[tuple[int, ...], ...]]]:
    """(micro-batch size, device groups) of the ``n`` best candidates by estimate not in ``picked``."""
    mine = {id(c) for c in picked}
    out: dict[tuple, None] = {}
    for c in sorted(cands, key=lambda x: x[0]):
        if len(out) >= n:
            break
        if id(c) not in mine:
            _, _, b, order, stages = c
            out[(b, tuple(g for _, g in stage_layout(order, stages)))] = None
    return list(out)


def _picked(pb: Problem, cands: list) -> list:
    """The DP's candidates to price: the best ``top_k`` distinct ones, and the best of every
    (micro-batch size, stage count)."""
    cands = sorted(cands, key=lambda x: x[0])
    seen, picked = set(), []

    def pick(cand) -> None:
        est, val, b, order, stages = cand
        key = (b, tuple((st.cut, tuple(sorted(order[x] for x in range(*st.hosts)))) for st in stages))
        if key not in seen:
            seen.add(key)
            picked.append(cand)

    for cand in cands:
        if len(picked) >= pb.top_k:
            break
        pick(cand)
    # The estimate leaves the tied embedding's sync and the fill/drain transfers out, so on slow
    # links it flatters pipelines and can fill the top k with them; the best candidate of every (micro-batch size, stage count) is
    # priced too, so a shape (one device with big micro-batches, say) is never left unpriced.
    shapes: dict[tuple[int, int], tuple] = {}
    for cand in cands:
        shapes.setdefault((cand[2], len(cand[4])), cand)
    for cand in shapes.values():
        pick(cand)
    return picked


def search_single(pb: Problem, progress=None, also: Sequence[str] = ()) -> SearchResult:
    """The plan of one one-chunk kind (``pb.schedule``) with the lowest priced step; ``also``: kinds its
    plans are priced under next (planner/kinds.py), whose bound must hold too to skip a candidate."""
    t0 = time.perf_counter()
    if not pb.hosts:
        raise ValueError("no devices to plan for")
    pb.profiles.ensure(pb.hosts)
    pb.links.check(pb.hosts)
    t = Tables(pb)
    orders, mode = device_orders(pb, t)
    cands: list = []
    bottlenecks(pb, t, orders, collect=cands)
    if not cands:
        raise InfeasibleError(infeasible_message(pb, t))
    picked = _picked(pb, cands)
    priced: list[tuple[float, Plan]] = []
    seeds: list[tuple[float, int, list[tuple[tuple[int, int], tuple[int, ...]]]]] = []
    skipped: list[tuple[int, tuple[tuple[int, ...], ...]]] = []
    split = any(REGISTRY[k].split_backward for k in (pb.schedule, *also))
    for est, val, b, order, stages in picked:
        layout = stage_layout(order, stages)
        if layout_bound(t, layout, b, pb.global_batch // b, split) >= pb.ledger.step_time_s:
            skipped.append((b, tuple(g for _, g in layout)))  # cannot win (planner/prune.py)
            continue
        plan = build_plan(pb, t, order, stages, b, "optimal")
        if plan is None:
            continue
        step = price_plan(pb, plan)
        priced.append((step, plan))
        seeds.append((step, b, layout))
        if progress:
            progress(f"  candidate: {plan.num_stages} stage(s), micro-batch {b} x {plan.num_microbatches}: "
                     f"bottleneck {val:.4g} s, priced step {step:.4g} s")
    if not priced and not skipped:
        raise InfeasibleError(infeasible_message(pb, t))
    exact = len(pb.hosts) <= pb.exact_devices
    budget = pb.refine_evals if pb.refine_evals is not None else (
        300 if exact else REFINE_HEURISTIC if len(pb.hosts) <= 16 else 0)
    before = min((s for s, _ in priced), default=float("inf"))
    found = refine(pb, t, seeds, budget)
    around: list[tuple[float, Plan]] = []
    if not exact and len(pb.hosts) <= REORDER_DEVICES and (seeds or found):
        # three device orders are a guess: search the orders near the best plan's (planner/reorder.py),
        # on top of what the DP's candidates and their local search found
        pool = seeds + [(s, p.micro_batch_size, layout_of(pb, p)) for s, p in found]
        per_size: dict[int, tuple] = {}
        for x in sorted(pool, key=lambda x: x[0]):
            per_size.setdefault(x[1], x)
        near = []
        for s0, b, lay in list(per_size.values())[:ORDER_STARTS]:
            near += search_orders(pb, t, order_of(lay, orders[0]), b, set(orders), start_s=s0)
        around = [(s, p) for s, _, _, p in near]
        around += refine(pb, t, [(s, b, lay) for s, b, lay, _ in near], budget)
    priced += found + around
    if not priced:  # every candidate was beaten before it was priced: the search that called this has the winner
        return SearchResult(plan=None, step_time_s=float("inf"), candidates_priced=0, dp_candidates=len(cands),
                            planning_time_s=time.perf_counter() - t0, mode=mode, tables=t)
    if progress and found:
        progress(f"  local search: {len(found)} plan(s) priced, best step {min(s for s, _ in priced):.4g} s "
                 f"(DP candidates' best {before:.4g} s)")
    priced.sort(key=lambda x: x[0])
    step, plan = priced[0]
    return SearchResult(plan=plan, step_time_s=step, candidates_priced=len(priced), dp_candidates=len(cands),
                        planning_time_s=time.perf_counter() - t0, priced=priced, mode=mode, refined=len(found),
                        tables=t, around=around, skipped=skipped, unpicked=_unpicked(cands, picked, UNPICKED))

