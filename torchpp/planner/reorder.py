"""Local search over device orders, for clusters past ``exact_devices``.

There the stage DP sees three device orders (speed, memory, link-greedy), and an order decides what
the DP can build: devices after the last group stay idle, the last group holds the lm_head (on
Qwen-like models as dear as ten decoder layers) and the first the embedding and the most
micro-batches in flight. On 8-host clusters the best of three orders was 10-20% slower than plans
of other orders (``benchmarks/bench_planner.py --certify``). This searches orders one move away
from the best priced plan's (two devices swapped, one moved to the end), each priced as the stage
search prices a candidate: the DP's best layouts of the order at the winner's micro-batch size,
built and replayed; an order whose plan is faster becomes the next start.
"""
from __future__ import annotations

from typing import Sequence

from ..formats import Plan
from .build import build_plan
from .fastdp import dp_order_fast
from .pricing import price_plan
from .prune import layout_bound
from ..schedules import REGISTRY
from .tables import StageCosts, Tables
from .types import INF, Layout, Problem, max_stages_of, stage_layout

ORDER_EVALS = 24
"""Orders priced by the local search (each: one DP at one micro-batch size and its best two layouts
replayed, about 8 ms on 8 hosts x 48 layers)."""
PER_ORDER = 2
"""Layouts of each order built and replayed: its best two stage counts by the DP's estimate."""


def layout_of(pb: Problem, plan: Plan) -> Layout:
    """A one-chunk plan's layout: per stage its layer cut and its devices (host indices)."""
    idx = {h: i for i, h in enumerate(pb.hosts)}
    return [(tuple(st.layers), tuple(idx[d.host] for d in st.devices)) for st in plan.stages]


def order_of(layout: Layout, rest: Sequence[int]) -> tuple[int, ...]:
    """The device order a layout was built from, its idle devices after it (in ``rest``'s order)."""
    used = [h for _, g in layout for h in g]
    return tuple(used + [h for h in rest if h not in used])


def _moves(order: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Orders one move away: a device moved to the end (it becomes the tail's holder, or idle), then
    two devices swapped, nearest positions first."""
    n = len(order)
    out = [order[:i] + order[i + 1:] + (order[i],) for i in range(n - 1)]
    for gap in range(1, n):
        for i in range(n - gap):
            o = list(order)
            o[i], o[i + gap] = o[i + gap], o[i]
            out.append(tuple(o))
    return out


def search_orders(pb: Problem, t: Tables, start: tuple[int, ...], b: int, seen: set[tuple[int, ...]],
                  evals: int | None = None, start_s: float | None = None) -> list[tuple[float, int, Layout, Plan]]:
    """First-improvement descent over device orders from ``start`` (its plan's step ``start_s``, by
    default the best priced) at micro-batch size ``b``: every plan priced, as (step, b, layout, plan).
    ``seen``: orders already searched at this size (the DP's own)."""
    evals = ORDER_EVALS if evals is None else evals
    m = pb.global_batch // b
    sc = StageCosts(t, b, m, pb.allow_recompute)
    split = REGISTRY[pb.schedule].split_backward
    max_stages = max_stages_of(pb)
    found: list[tuple[float, int, Layout, Plan]] = []

    def price_order(order: tuple[int, ...]) -> float:
        got = dp_order_fast(order, sc, max_stages, pb.max_group, {})
        ranked = sorted((((m + S - 1) * val, stages) for S, (val, stages) in got.items()),
                        key=lambda x: x[0])[:PER_ORDER]  # ties keep the DP's order (stage choices do not compare)
        best = INF
        for _, stages in ranked:
            layout = stage_layout(order, stages)
            if layout_bound(t, [(c, list(g)) for c, g in layout], b, m, split) >= pb.ledger.step_time_s:
                continue  # cannot beat the best priced plan (planner/prune.py)
            plan = build_plan(pb, t, order, stages, b, "optimal")
            if plan is None:
                continue
            step = price_plan(pb, plan)
            found.append((step, b, layout, plan))
            best = min(best, step)
        return best

    cur, cur_s = start, pb.ledger.step_time_s if start_s is None else start_s
    used = 0
    improved = True
    while improved and used < evals:
        improved = False
        for order in _moves(cur):
            if order in seen:
                continue
            if used >= evals:
                break
            seen.add(order)
            used += 1
            s = price_order(order)
            if s < cur_s * (1 - 1e-9):
                cur, cur_s, improved = order, s, True
                break
    return found
