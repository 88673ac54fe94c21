"""The idle a schedule's order forces on one rank, for the certificate (``planner/certify.py``).

A plan's replayed step is the longest path through its action lists: each rank's compute in its
order, each forward after the previous chunk's forward of the same micro-batch, each input
gradient after the next chunk's, a weight gradient after its input gradient, a transfer between
ranks on every cross-rank edge. Lowering any duration can only shorten that path. So for the rank
at position ``q`` of a kind's order at depth ``p``, with every *other* rank's step at the least
any device can take for one chunk of its class (one decoder layer, plus the embedding or the
tail where that chunk holds it) and every transfer at the fastest link's, and its *own* steps
free:

- ``C1[i]``: no plan starts the rank's step ``i`` earlier (the fill its order waits for);
- ``C2[i]``: no plan ends less than this after the rank's step ``i`` ends (the drain after it);

and every plan's step is at least ``C1[i] + (its steps i..j) + C2[j]`` for any ``i <= j`` (its
steps run one after another). :func:`rank_paths` returns a few such ``(i, j)`` pairs as counts of
the rank's steps of each type and chunk plus the constant ``C1[i] + C2[j]``; the certificate
prices the counts with the cheapest layers the rank could hold. Any set of pairs is a valid
bound; the pairs kept are those largest for chunk costs of a few sizes (the only pairs that can
matter are those where ``C1`` rises at ``i`` and ``C2`` falls after ``j``), with the longest paths
at a few sizes of the rank's own steps (:func:`critical_path`: those may leave the rank and come
back, a V's round trip to the ranks after it).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..formats import Placement
from ..schedules import Kind, position_order

TYPES = ("F", "B", "I", "W")
_KEY = {Kind.FORWARD: "F", Kind.BACKWARD: "B", Kind.BACKWARD_INPUT: "I", Kind.BACKWARD_WEIGHT: "W"}


@dataclass(frozen=True)
class RankPath:
    """A path through one rank's steps ``i..j``: how many steps of each type each of its chunks
    runs on it (``counts[type][k]``, k indexing the rank's chunks in pipeline order), the seconds
    before and after them that no plan avoids, and whether it ends with the rank's last step (its
    optimizer step follows, alongside ``after``)."""

    counts: dict[str, tuple[int, ...]]
    before: float
    """``C1`` at the path's first step."""
    after: float
    """``C2`` at its last step."""
    last: bool
    fill_call: float | None = None
    """Where the path starts at or after the rank's first forward of the pipeline's last chunk: the
    first micro-batch's forwards through every chunk before it (one after another, with the hops
    between positions), the other positions' per-call parts alone. Every other position's layer
    runs on that chain, so the certificate adds their per-sample forwards to it, which the
    one-layer prices of ``before`` leave out."""


@functools.lru_cache(maxsize=512)
def order_dag(kind: str, pl: Placement, m: int) -> tuple:
    """(each position's order, its steps (position, index) in an order where every step comes after
    its predecessors, each step's cross-rank predecessors, each step's cross-rank successors): the
    kind's graph at placement ``pl`` with ``m`` micro-batches (kept: a pure function of the order)."""
    orders = [position_order(kind, pl, pos, m) for pos in range(pl.p)]
    last = len(pl.position) - 1
    where = {}
    for pos, order in enumerate(orders):
        for i, (k, c, mb) in enumerate(order):
            where[(_KEY[k] if _KEY[k] not in "BI" else "BI", c, mb)] = (pos, i)
    preds: dict[tuple[int, int], list[tuple[int, int, bool]]] = {}
    for pos, order in enumerate(orders):
        for i, (k, c, mb) in enumerate(order):
            t = _KEY[k]
            dep = None
            if t == "F" and c > 0:
                dep = where.get(("F", c - 1, mb))
            elif t in "BI" and c < last:
                dep = where.get(("BI", c + 1, mb))
            got = []
            if dep is not None and dep[0] != pos:
                got.append((dep[0], dep[1], True))
            preds[(pos, i)] = got
    # a topological order: walk the positions, each as far as its cross-rank predecessors allow
    topo: list[tuple[int, int]] = []
    done: set[tuple[int, int]] = set()
    ptr = [0] * pl.p
    moved = True
    while moved:
        moved = False
        for pos in range(pl.p):
            while ptr[pos] < len(orders[pos]) and all((a, b) in done for a, b, _ in preds[(pos, ptr[pos])]):
                done.add((pos, ptr[pos]))
                topo.append((pos, ptr[pos]))
                ptr[pos] += 1
                moved = True
    if len(topo) != sum(len(o) for o in orders):
        raise ValueError(f"{kind}: the order at depth {pl.p} with {m} micro-batches deadlocks")
    succ: dict[tuple[int, int], list[tuple[int, int]]] = {n: [] for n in topo}
    for n, ps in preds.items():
        for a, b, _ in ps:
            succ[(a, b)].append(n)
    return orders, topo, preds, succ


def step_type(kind: Kind) -> str:
    """"F", "B", "I" or "W" of a compute step."""
    return _KEY[kind]


def fill_drain(kind: str, pl: Placement, q: int, m: int, step_s: Callable[[int, str, int], float],
               hop_s: Callable[[int, int], float]) -> tuple[list, np.ndarray, np.ndarray]:
    """(position q's order, ``C1``, ``C2``) with every other position's step priced by
    ``step_s(position, type, chunk)`` and position q's steps free."""
    orders, topo, preds, succ = order_dag(kind, pl, m)
    dur = {}
    for pos, order in enumerate(orders):
        for i, (k, c, _) in enumerate(order):
            dur[(pos, i)] = 0.0 if pos == q else step_s(pos, _KEY[k], c)
    start: dict[tuple[int, int], float] = {}
    for pos, i in topo:
        s = start[(pos, i - 1)] + dur[(pos, i - 1)] if i else 0.0
        for a, b, _ in preds[(pos, i)]:
            s = max(s, start[(a, b)] + dur[(a, b)] + hop_s(a, pos))
        start[(pos, i)] = s
    tail: dict[tuple[int, int], float] = {}
    for pos, i in reversed(topo):
        t = 0.0
        if i + 1 < len(orders[pos]):
            t = dur[(pos, i + 1)] + tail[(pos, i + 1)]
        for a, b in succ[(pos, i)]:
            t = max(t, hop_s(pos, a) + dur[(a, b)] + tail[(a, b)])
        tail[(pos, i)] = t
    n = len(orders[q])
    return list(orders[q]), np.array([start[(q, i)] for i in range(n)]), np.array([tail[(q, i)] for i in range(n)])


def critical_path(kind: str, pl: Placement, q: int, m: int, step_s: Callable[[int, str, int], float],
                  hop_s: Callable[[int, int], float],
                  own_s: Callable[[str, int], float]) -> RankPath:
    """The longest path when position q's steps take ``own_s(type, chunk)``: a path that may leave
    the rank and come back (a forward's round trip through the ranks after it, say), as the counts
    of the rank's steps on it and the other ranks' seconds and hops (``before``). Any path is a
    bound at every duration; this one is the longest at ``own_s``."""
    orders, topo, preds, succ = order_dag(kind, pl, m)
    dur = {}
    for pos, order in enumerate(orders):
        for i, (k, c, _) in enumerate(order):
            dur[(pos, i)] = own_s(_KEY[k], c) if pos == q else step_s(pos, _KEY[k], c)
    start: dict[tuple[int, int], float] = {}
    back: dict[tuple[int, int], tuple[tuple[int, int], float] | None] = {}
    for pos, i in topo:
        s, via = 0.0, None
        if i:
            s, via = start[(pos, i - 1)] + dur[(pos, i - 1)], ((pos, i - 1), 0.0)
        for a, b, _ in preds[(pos, i)]:
            x = start[(a, b)] + dur[(a, b)] + hop_s(a, pos)
            if x > s:
                s, via = x, ((a, b), hop_s(a, pos))
        start[(pos, i)] = s
        back[(pos, i)] = via
    node = max(topo, key=lambda n: start[n] + dur[n])
    mine = pl.chunks[q]
    local = {c: k for k, c in enumerate(mine)}
    cnt = {t: [0] * len(mine) for t in TYPES}
    const = 0.0
    ends_mine = node == (q, len(orders[q]) - 1)
    while node is not None:
        k, c, _ = orders[node[0]][node[1]]
        if node[0] == q:
            cnt[_KEY[k]][local[c]] += 1
        else:
            const += dur[node]
        via = back[node]
        if via is None:
            break
        node, hop = via
        const += hop
    return RankPath(counts={t: tuple(v) for t, v in cnt.items()}, before=const, after=0.0, last=ends_mine)


def rank_paths(kind: str, pl: Placement, q: int, m: int, step_s: Callable[[int, str, int], float],
               hop_s: Callable[[int, int], float],
               typical: Callable[[str, int], float],
               call_s: Callable[[int, str, int], float] | None = None) -> list[RankPath]:
    """A few paths through position q's steps (module docstring), those longest when the rank's
    step of each type and chunk costs ``typical(type, chunk)`` times 1/4 .. 4, and the longest
    paths through every rank's steps at 1/2 .. 4 times it. ``call_s``: the other positions' steps
    without their per-sample part, for :attr:`RankPath.fill_call` (where q holds the last chunk)."""
    order, c1, c2 = fill_drain(kind, pl, q, m, step_s, hop_s)
    last_chunk = len(pl.position) - 1
    first_tail = next((i for i, (k, c, mb) in enumerate(order) if k == Kind.FORWARD and c == last_chunk and mb == 0),
                      None)
    fill_call = None
    if call_s is not None and first_tail is not None:
        fill_call = 0.0
        for c in range(last_chunk):
            here, after = pl.position[c], pl.position[c + 1]
            if here != q:
                fill_call += call_s(here, "F", c)
            if after != here:
                fill_call += hop_s(here, after)
    n = len(order)
    if not n:
        return []
    mine = pl.chunks[q]
    local = {c: k for k, c in enumerate(mine)}
    eps = 1e-12
    starts = [0] + [i for i in range(1, n) if c1[i] > c1[i - 1] + eps]
    if fill_call is not None and first_tail not in starts:
        starts = sorted(starts + [first_tail])  # where the fill before the last chunk lifts the path
    ends = [j for j in range(n - 1) if c2[j] > c2[j + 1] + eps] + [n - 1]
    # prefix counts per (type, local chunk)
    cols = {(t, k): idx for idx, (t, k) in enumerate((t, k) for t in TYPES for k in range(len(mine)))}
    pref = np.zeros((n + 1, len(cols)))
    for i, (k, c, _) in enumerate(order):
        pref[i + 1] = pref[i]
        pref[i + 1, cols[(_KEY[k], local[c])]] += 1
    w = np.array([typical(t, mine[k]) for (t, k) in cols])
    S, E = np.array(starts), np.array(ends)
    ok = S[:, None] <= E[None, :]
    cnt = pref[E + 1][None, :, :] - pref[S][:, None, :]          # (starts, ends, columns)
    const = c1[S][:, None] + c2[E][None, :]
    keep = {(0, len(ends) - 1)}
    if fill_call is not None:
        keep.add((starts.index(first_tail), len(ends) - 1))
    for scale in (0.25, 0.5, 1.0, 2.0, 4.0):
        val = np.where(ok, const + scale * (cnt @ w), -np.inf)
        keep.add(tuple(int(x) for x in np.unravel_index(np.argmax(val), val.shape)))
    out = []
    for a, b in sorted(keep):
        if not ok[a, b]:
            continue
        counts = {t: tuple(int(cnt[a, b, cols[(t, k)]]) for k in range(len(mine))) for t in TYPES}
        out.append(RankPath(counts=counts, before=float(c1[S[a]]), after=float(c2[E[b]]), last=bool(E[b] == n - 1),
                            fill_call=fill_call if first_tail is not None and S[a] >= first_tail else None))
    for scale in (0.5, 1.0, 2.0, 4.0):
        out.append(critical_path(kind, pl, q, m, step_s, hop_s, lambda t, c: scale * typical(t, c)))
    return list({repr(p): p for p in out}.values())
