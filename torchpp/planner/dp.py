"""The exact stage DP (few devices): for one device order, the best bottleneck per stage count
over contiguous layer cuts and contiguous runs of the order as groups."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from ..schedules import in_flight, split_in_flight
from .tables import StageCosts, Tables
from .types import StageChoice

def suffix_in_flight(schedule: str, stages_after: int, m: int) -> tuple[int, int]:
    """Micro-batches in flight on a stage the DP knows only by the number of stages after it, and
    of them those between their I and their W: stage 0 of ``stages_after + 1`` (1F1B, GPipe and
    ZB-H1 depend on nothing else). The DP prices that state with the heap a W leaves (Kz) even
    where the order reaches it before its first W: an upper bound, as the rounding of the fast
    DP; a plan is built, and its recomputation chosen, at every state of its orders
    (``schedules.peak_states``)."""
    return in_flight(schedule, stages_after + 1, 0, m), split_in_flight(schedule, stages_after + 1, 0, m)


def dp_order(order: Sequence[int], sc: StageCosts, max_stages: int, max_group: int, shared: dict | None = None,
             ) -> dict[int, tuple[float, list[StageChoice]]]:
    """Best bottleneck per stage count for one device order (groups are contiguous runs of it).

    State (j, a, i, c): the suffix of the pipeline has j stages after its head stage, the head
    stage's group is order[a:i] and its layers start at cut c. Its value is the suffix's
    bottleneck; prepending a group order[a2:a] on layers [c2, c) with the head as next group
    extends it.

    A state's values depend on the order only through its head group's devices and the order
    after it (``order[i:]``), so they are kept in ``shared`` (one dict per micro-batch size and
    kind) under that key: the permutations of a few devices share most of their suffixes, and each
    is solved once for all of them, with the same arithmetic in the same order as alone.
    """
    t, m = sc.t, sc.m
    L, N = t.L, len(order)
    K = min(max_group, N, sc.b)
    memo = shared if shared is not None else {}
    order = tuple(order)
    grp = {(a, i): tuple(sorted(order[a:i])) for a in range(N) for i in range(a + 1, min(N, a + K) + 1)}
    best: dict[int, tuple[float, list[StageChoice]]] = {}
    S_max = min(max_stages, L, N)
    for j in range(S_max):  # raises where the kind's order cannot run m micro-batches on j + 1 stages
        suffix_in_flight(t.pb.schedule, j, m)
    for j in range(S_max):
        # record the best plan with j + 1 stages (head group starting at position 0, layer 0)
        heads = []
        for i in range(1, N + 1):
            got = _state(memo, sc, j, grp, order, 0, i) if (0, i) in grp else None
            if got is not None:
                heads.append((got[0][0], i))
        if heads:
            val, i = min(heads, key=lambda x: x[0])
            if np.isfinite(val):
                best[j + 1] = (float(val), _reconstruct(memo, j, order, i, L))
    return best


def _state(memo: dict, sc: StageCosts, j: int, grp: dict, order: tuple[int, ...], a: int, i: int
           ) -> tuple[np.ndarray, tuple | None] | None:
    """Values over the first layer c of the suffix whose head group is order[a:i] with j stages
    after it, and the pointers to the stage after it; None where no such suffix exists."""
    key = (j, grp[(a, i)], order[i:])
    if key in memo:
        return memo[key]
    t, m, L, N = sc.t, sc.m, sc.t.L, len(order)
    g = grp[(a, i)]
    if j == 0:  # the last stage, layers [c, L)
        memo[key] = got = (sc.stage(g, None, *suffix_in_flight(t.pb.schedule, 0, m))[:, L].copy(), None)
        return got
    got = None
    if i < N:
        cands = [(i2, s[0]) for i2 in range(i + 1, N + 1) if (i, i2) in grp
                 for s in (_state(memo, sc, j - 1, grp, order, i, i2),) if s is not None]
        cands = [(i2, v) for i2, v in cands if np.isfinite(v).any()]
        if cands:
            n, w = suffix_in_flight(t.pb.schedule, j, m)
            vals, args = [], []
            for i2, v in cands:
                cost = sc.stage(g, grp[(i, i2)], n, w)
                tot = np.maximum(cost, v[None, :])          # [c2, c]
                arg = tot.argmin(axis=1)
                vals.append(tot[np.arange(L + 1), arg])
                args.append(arg)
            vals_a = np.stack(vals)
            which = vals_a.argmin(axis=0)
            got = (vals_a[which, np.arange(L + 1)],
                   (np.stack(args)[which, np.arange(L + 1)], which, [i2 - i for i2, _ in cands]))
    memo[key] = got
    return got


def _reconstruct(memo: dict, j: int, order: tuple[int, ...], i: int, L: int) -> list[StageChoice]:
    """Walk the pointers from the head stage (order[0:i], j stages after it) back to a stage list."""
    out: list[StageChoice] = []
    c, a = 0, 0
    while j > 0:
        c2_arr, which_arr, sizes = memo[(j, tuple(sorted(order[a:i])), order[i:])][1]
        c2, size = int(c2_arr[c]), sizes[int(which_arr[c])]
        out.append(StageChoice(cut=(c, c2), hosts=(a, i), recompute_all=False, cost=0.0))
        c, a, i = c2, i, i + size
        j -= 1
    out.append(StageChoice(cut=(c, L), hosts=(a, i), recompute_all=False, cost=0.0))
    return out
