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


def dp_order(order: Sequence[int], sc: StageCosts, max_stages: int, max_group: int,
             ) -> dict[int, tuple[float, list[StageChoice]]]:
    """Best bottleneck per stage count for one device order (groups are contiguous runs of it).

    State (j, a, i, c): the suffix of the pipeline has j stages after its head stage, the head
    stage's group is order[a:i] and its layers start at cut c. Its value is the suffix's
    bottleneck; prepending a group order[a2:a] on layers [c2, c) with the head as next group
    extends it.
    """
    t, m = sc.t, sc.m
    L, N = t.L, len(order)
    K = min(max_group, N, sc.b)
    grp = {(a, i): tuple(sorted(order[a:i])) for a in range(N) for i in range(a + 1, min(N, a + K) + 1)}
    best: dict[int, tuple[float, list[StageChoice]]] = {}
    # j = 0: the last stage, layers [c, L)
    V: dict[tuple[int, int], np.ndarray] = {}
    ptr: list[dict[tuple[int, int], tuple[np.ndarray, np.ndarray, list]]] = []
    for (a, i), g in grp.items():
        V[(a, i)] = sc.stage(g, None, *suffix_in_flight(t.pb.schedule, 0, m))[:, L].copy()
    ptr.append({})
    S_max = min(max_stages, L, N)
    for j in range(S_max):
        # record the best plan with j + 1 stages (head group starting at position 0, layer 0)
        heads = [(V[(0, i)][0], (0, i)) for i in range(1, N + 1) if (0, i) in V]
        if heads:
            val, key = min(heads, key=lambda x: x[0])
            if np.isfinite(val):
                best[j + 1] = (float(val), _reconstruct(ptr, j, key, sc, t, m))
        if j + 1 >= S_max:
            break
        n, w = suffix_in_flight(t.pb.schedule, j + 1, m)
        newV: dict[tuple[int, int], np.ndarray] = {}
        newptr: dict[tuple[int, int], tuple[np.ndarray, np.ndarray, list]] = {}
        for (a2, a), g in grp.items():
            if a >= N:
                continue
            cands = [(i, V[(a, i)]) for i in range(a + 1, N + 1) if (a, i) in V]
            cands = [(i, v) for i, v in cands if np.isfinite(v).any()]
            if not cands:
                continue
            vals, args = [], []
            for i, v in cands:
                cost = sc.stage(g, grp[(a, i)], n, w)
                tot = np.maximum(cost, v[None, :])          # [c2, c]
                arg = tot.argmin(axis=1)
                vals.append(tot[np.arange(L + 1), arg])
                args.append(arg)
            vals_a = np.stack(vals)
            which = vals_a.argmin(axis=0)
            newV[(a2, a)] = vals_a[which, np.arange(L + 1)]
            newptr[(a2, a)] = (np.stack(args)[which, np.arange(L + 1)], which, [i for i, _ in cands])
        V = newV
        ptr.append(newptr)
    return best


def _reconstruct(ptr, j: int, key: tuple[int, int], sc: StageCosts, t: Tables, m: int) -> list[StageChoice]:
    """Walk the pointers from the head stage (j stages after it) back to a stage list."""
    c, (a, i) = 0, key
    order_groups = []
    while j > 0:
        c2_arr, which_arr, nexts = ptr[j][(a, i)]
        c2, nxt_i = int(c2_arr[c]), nexts[int(which_arr[c])]
        order_groups.append(((a, i), (c, c2), j))
        c, (a, i) = c2, (i, nxt_i)
        j -= 1
    order_groups.append(((a, i), (c, t.L), 0))
    return [StageChoice(cut=cut, hosts=(a, i), recompute_all=False, cost=0.0) for (a, i), cut, _ in order_groups]

