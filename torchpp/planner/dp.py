"""The exact stage DP (few devices): for each device order, the best bottleneck per stage count
over contiguous layer cuts and contiguous runs of the order as groups."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from ..schedules import in_flight, split_in_flight
from .tables import StageCosts
from .types import StageChoice

def suffix_in_flight(schedule: str, stages_after: int, m: int) -> tuple[int, int]:
    """Micro-batches in flight on a stage the DP knows only by the number of stages after it, and
    of them those between their I and their W: stage 0 of ``stages_after + 1`` (1F1B, GPipe and
    ZB-H1 depend on nothing else). The DP prices that state with the heap a W leaves (Kz) even
    where the order reaches it before its first W: an upper bound, as the rounding of the fast
    DP; a plan is built, and its recomputation chosen, at every state of its orders
    (``schedules.peak_states``)."""
    return in_flight(schedule, stages_after + 1, 0, m), split_in_flight(schedule, stages_after + 1, 0, m)


Order = tuple[int, ...]
Key = tuple[tuple[int, ...], Order]
"""A DP state's devices: its head group (sorted) and the order after it."""
BATCH = 256
"""States' candidates priced per numpy call (bounds the (batch, L+1, L+1) temporaries)."""


def dp_orders(orders: Sequence[Sequence[int]], sc: StageCosts, max_stages: int, max_group: int,
              shared: dict | None = None) -> list[dict[int, tuple[float, list[StageChoice]]]]:
    """Best bottleneck per stage count for each device order (groups are contiguous runs of it).

    State (j, a, i, c): the suffix of the pipeline has j stages after its head stage, the head
    stage's group is order[a:i] and its layers start at cut c. Its value is the suffix's
    bottleneck; prepending a group order[a2:a] on layers [c2, c) with the head as next group
    extends it.

    A state's values depend on the order only through its head group's devices and the order
    after it (:data:`Key`), so the orders share their states (the permutations of a few devices
    share most suffixes): each level's states are solved once for every order, their candidates
    in a few numpy calls, with the same arithmetic as the DP of one order. There a state took its
    candidates among the present, somewhere finite states below; here every candidate is priced
    and the others count as +inf, which changes no finite value nor the first best candidate
    behind one (ties to the first candidate as there). ``shared``: kept across calls on the same
    orders (which states exist does not depend on the micro-batch size).
    """
    t, m, L = sc.t, sc.m, sc.t.L
    if not orders:
        return []
    N = len(orders[0])
    K = min(max_group, N, sc.b)
    S_max = min(max_stages, L, N)
    # raises where the kind's order cannot run m micro-batches on j + 1 stages
    flights = [suffix_in_flight(t.pb.schedule, j, m) for j in range(S_max)]
    cache = shared if shared is not None else {}
    if (K, S_max) not in cache:
        cache[(K, S_max)] = _Shape([tuple(o) for o in orders], N, K, S_max)
    shape: _Shape = cache[(K, S_max)]
    values = [np.stack([sc.stage(g, None, *flights[0])[:, L] for g in shape.groups[0]])[shape.group_of[0]]]
    found = [np.isfinite(values[0]).any(axis=1)]
    steps = [(None, None)]
    for j in range(1, S_max):
        V, c2, which = _prepend(sc, shape, j, values[-1], found[-1], flights[j])
        values.append(V)
        found.append(np.isfinite(V).any(axis=1))
        steps.append((c2, which))
    out = []
    for x in range(len(orders)):
        best: dict[int, tuple[float, list[StageChoice]]] = {}
        for j in range(S_max):
            got = [(values[j][r, 0], i, r) for i, r in shape.heads[j][x]]
            if got:
                val, i, r = min(got, key=lambda y: y[0])
                if np.isfinite(val):
                    best[j + 1] = (float(val), _reconstruct(shape, steps, j, i, r, L))
        out.append(best)
    return out


class _Shape:
    """Which states exist for these orders, level by level, and how they link (no costs): level
    j's states ``keys[j]`` (rows), their candidates as pairs (``pair_row``: the state, ``pair_slot``:
    its k-th candidate, ``pair_next``: the candidate's row one level down, ``pair_size``: its group
    size, ``pair_groups[p]``: index into ``groups[j]`` of (head group, next group)), and each order's
    head states per level (``heads[j][x]``: (i, row) for head group order[:i])."""

    def __init__(self, orders: list[Order], N: int, K: int, S_max: int):
        after: dict[Order, list[Key]] = {}  # _next_keys, once per order after a head

        def next_keys(rest: Order) -> list[Key]:
            got = after.get(rest)
            if got is None:
                got = after[rest] = _next_keys(rest, K)
            return got

        need: list[dict[Key, None]] = [{} for _ in range(S_max)]
        head_keys = [[(i, (tuple(sorted(o[:i])), o[i:])) for i in range(1, min(N, K) + 1)] for o in orders]
        for j in range(S_max):
            for hk in head_keys:
                need[j].update(dict.fromkeys(k for _, k in hk))
        for j in range(S_max - 1, 0, -1):
            for _, rest in need[j]:
                need[j - 1].update(dict.fromkeys(next_keys(rest)))
        self.keys = [list(x) for x in need]
        self.row = [{k: r for r, k in enumerate(keys)} for keys in self.keys]
        # level 0: a state's value is its group's last-stage cost
        g0: dict[tuple[int, ...], int] = {}
        self.groups: list[list] = [[]]
        self.group_of = [np.array([g0.setdefault(g, len(g0)) for g, _ in self.keys[0]], dtype=np.intp)]
        self.groups[0] = list(g0)
        self.pair_row, self.pair_slot, self.pair_next, self.pair_size, self.pair_groups = \
            [None], [None], [None], [None], [None]
        self.width = [0]
        self.first_pair: list = [None]
        for j in range(1, S_max):
            rows, slots, nexts, sizes, gidx = [], [], [], [], []
            pairs: dict[tuple, int] = {}
            first = np.zeros(len(self.keys[j]), dtype=np.intp)
            width = 1
            below = self.row[j - 1]
            for r, (g, rest) in enumerate(self.keys[j]):
                first[r] = len(rows)
                nks = next_keys(rest)
                width = max(width, len(nks))
                for s, nk in enumerate(nks):
                    rows.append(r)
                    slots.append(s)
                    nexts.append(below[nk])
                    sizes.append(len(nk[0]))
                    gidx.append(pairs.setdefault((g, nk[0]), len(pairs)))
            self.pair_row.append(np.array(rows, dtype=np.intp))
            self.pair_slot.append(np.array(slots, dtype=np.intp))
            self.pair_next.append(np.array(nexts, dtype=np.intp))
            self.pair_size.append(sizes)
            self.pair_groups.append(np.array(gidx, dtype=np.intp))
            self.groups.append(list(pairs))
            self.width.append(width)
            self.first_pair.append(first)
        self.heads = [[[(i, self.row[j][k]) for i, k in hk] for hk in head_keys] for j in range(S_max)]


def _next_keys(rest: Order, K: int) -> list[Key]:
    """The states that may follow a head whose order after it is ``rest``, smallest next group first."""
    return [(tuple(sorted(rest[:k])), rest[k:]) for k in range(1, min(K, len(rest)) + 1)]


def _prepend(sc: StageCosts, shape: _Shape, j: int, below: np.ndarray, found: np.ndarray, flight: tuple[int, int]
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Level j's values over the head's first layer c, and at each c the next stage's first layer
    and the chosen candidate's slot: a head group before the best somewhere finite state below."""
    L1 = sc.t.L + 1
    n_rows = len(shape.keys[j])
    vals = np.full((n_rows, shape.width[j], L1), np.inf)
    args = np.zeros((n_rows, shape.width[j], L1), dtype=np.intp)
    rows, slots, nexts = shape.pair_row[j], shape.pair_slot[j], shape.pair_next[j]
    ok = np.nonzero(found[nexts])[0]  # candidates: states below that are finite somewhere
    if len(ok):
        groups, pairs = shape.groups[j], shape.pair_groups[j]
        for lo in range(0, len(ok), BATCH):
            p = ok[lo:lo + BATCH]
            cost = np.stack([sc.stage(*groups[q], *flight) for q in pairs[p]])
            tot = np.maximum(cost, below[nexts[p]][:, None, :])                      # [pair, c2, c]
            arg = tot.argmin(axis=2)
            vals[rows[p], slots[p]] = np.take_along_axis(tot, arg[:, :, None], axis=2)[:, :, 0]
            args[rows[p], slots[p]] = arg
    which = vals.argmin(axis=1)                                                     # first best candidate
    V = np.take_along_axis(vals, which[:, None, :], axis=1)[:, 0, :]
    c2 = np.take_along_axis(args, which[:, None, :], axis=1)[:, 0, :]
    return V, c2, which


def _reconstruct(shape: _Shape, steps: list, j: int, i: int, r: int, L: int) -> list[StageChoice]:
    """Walk the pointers from the head stage (order[0:i], row r, j stages after it) back to a stage list."""
    out: list[StageChoice] = []
    c, a = 0, 0
    while j > 0:
        c2_arr, which_arr = steps[j]
        p = shape.first_pair[j][r] + int(which_arr[r, c])
        c2 = int(c2_arr[r, c])
        out.append(StageChoice(cut=(c, c2), hosts=(a, i), recompute_all=False, cost=0.0))
        c, a, i, r = c2, i, i + shape.pair_size[j][p], int(shape.pair_next[j][p])
        j -= 1
    out.append(StageChoice(cut=(c, L), hosts=(a, i), recompute_all=False, cost=0.0))
    return out
