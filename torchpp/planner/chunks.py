"""The planner's chunk dimensions: interleaved placements (v chunks per device group) and the V
placement (chunks c and 2p−1−c on one group, so one device holds the embedding and the tail).

For a device-group sequence (groups in pipeline order, taken from the best priced one-chunk
plans, or every sequence on small instances) and a schedule kind with its chunk count, the layer
cuts come from a bottleneck DP over chunks in pipeline order with the group of each chunk index
fixed by the placement: it minimises the largest chunk cost times the number of chunks its group
holds (a group's time is the sum of its chunks'). Each candidate gets integer sample shares
(Algorithm 1 over its chunks' total time), is checked against each device's memory with the
micro-batches held read off the schedule's own order (``StageMemory.chunks_peak``, recomputing a
group's layers when it does not fit), and is priced by replaying its action lists. A steepest
descent on the priced step time then moves one cut, shifts a chunk, swaps two groups or trades a
schedule kind for the other of its placement family.
"""
from __future__ import annotations

import functools
import itertools
import math
import random
from dataclasses import dataclass, replace
from typing import Callable, Iterable, Sequence

import numpy as np

from ..cost import device_memory
from ..formats import Placement, Plan, placement_of
from ..plans import make_chunked_plan
from ..schedules import REGISTRY, RELEASES, Kind, ScheduleError, position_order
from .allocate import allocate
from .pricing import keep_priced, price_plan
from .prune import chunk_bound
from .tables import StageCosts, Tables
from .types import INF, Problem
MAX_CHUNKS_PER_DEVICE = 4
"""Interleaved placements are searched with 2..this many chunks per group."""


@dataclass(frozen=True)
class ChunkLayout:
    """A multi-chunk plan's shape: kind, chunks per group, micro-batch size, the device groups
    (host indices) in pipeline-position order and the cut points of the chunks."""

    kind: str
    v: int
    b: int
    groups: tuple[tuple[int, ...], ...]
    bounds: tuple[int, ...]
    """Chunk c holds decoder layers [bounds[c], bounds[c + 1])."""

    @property
    def ranges(self) -> list[tuple[int, int]]:
        """Each chunk's layer range [start, end)."""
        return [(self.bounds[i], self.bounds[i + 1]) for i in range(len(self.bounds) - 1)]

    @property
    def key(self) -> tuple:
        return (self.kind, self.v, self.b, tuple(tuple(sorted(g)) for g in self.groups), self.bounds)


def chunk_counts(kind: str, p: int, L: int) -> list[int]:
    """Chunks per group worth trying for ``p`` groups and ``L`` layers (none for one group: its
    chunks would run one after another on the same devices, the one-chunk plan's work plus a call
    and a held activation set per chunk)."""
    if p < 2:
        return []
    if REGISTRY[kind].placement == "v":
        return [2] if 2 * p <= L else []
    return [v for v in range(2, MAX_CHUNKS_PER_DEVICE + 1) if v * p <= L]


@functools.lru_cache(maxsize=256)
def placement(kind: str, p: int, v: int) -> Placement:
    return placement_of(kind, p * v, v)


@functools.lru_cache(maxsize=1024)
def chunk_in_flight(kind: str, pl: Placement, m: int) -> tuple[int, ...]:
    """Most micro-batches each chunk holds at once, read off its group's order (kept: a pure
    function of the order, which every group sequence of the same shape asks again): a chunk
    holds the most right after one of its forwards, so one pass over each order counts it
    (``schedules.in_flight_chunks`` has every profile a device passes through)."""
    out = [0] * len(pl.position)
    for pos in range(pl.p):
        held = [0] * len(pl.position)
        for k, c, _ in position_order(kind, pl, pos, m):
            if k == Kind.FORWARD:
                held[c] += 1
                if held[c] > out[c]:
                    out[c] = held[c]
            elif k in RELEASES:
                held[c] -= 1
    return tuple(out)


def dp_cuts(sc: StageCosts, kind: str, v: int, groups: Sequence[tuple[int, ...]]
            ) -> tuple[tuple[int, ...], float] | None:
    """Cut points minimising the largest (chunk cost × chunks of its group) over chunks in pipeline
    order, the group of each chunk fixed by the placement, and an estimate of the step to rank
    layouts by before pricing them; None when no cut fits."""
    t, L, m = sc.t, sc.t.L, sc.m
    try:
        pl = placement(kind, len(groups), v)
        n = chunk_in_flight(kind, pl, m)
    except (ValueError, ScheduleError):
        return None
    S = len(pl.position)
    g = [tuple(sorted(groups[pl.position[c]])) for c in range(S)]
    mult = [len(pl.chunks[pl.position[c]]) for c in range(S)]
    # held micro-batches only: those between I and W (zbv, interleaved-zb) are counted when the
    # layout's plan is built (build_chunk_plan checks every rank with device_memory)
    costs = [sc.stage(g[c], g[c + 1] if c + 1 < S and g[c + 1] != g[c] else None, max(n[c], 1)) for c in range(S)]
    V = costs[-1][:, L] * mult[-1]
    args: list[np.ndarray] = []
    for c in range(S - 2, -1, -1):
        tot = np.maximum(costs[c] * mult[c], V[None, :])
        tot = np.where(t.valid, tot, np.inf)
        a = tot.argmin(axis=1)
        V = tot[np.arange(L + 1), a]
        args.append(a)
    if not np.isfinite(V[0]):
        return None
    bounds, c0 = [0], 0
    for a in reversed(args):
        c0 = int(a[c0])
        bounds.append(c0)
    bounds.append(L)
    return tuple(bounds), _estimate(sc, pl, groups, [float(costs[c][bounds[c], bounds[c + 1]]) for c in range(S)])


def _estimate(sc: StageCosts, pl: Placement, groups: Sequence[tuple[int, ...]], chunk: Sequence[float]) -> float:
    """m × the busiest group's time per micro-batch, plus one micro-batch's pass through the chunks
    over v (the fill of an interleaved pipeline), plus the tied all-reduce unless one group holds both ends."""
    t = sc.t
    load = max(sum(chunk[c] for c in cs) for cs in pl.chunks)
    est = sc.m * load + sum(chunk) / pl.v
    first, last = set(groups[pl.position[0]]), set(groups[pl.position[-1]])
    if t.pb.profiles.model.tied_embeddings and first != last:
        est += t.pb.links.ring_allreduce([t.hosts[h] for h in sorted(first | last)], t.pb.profiles.tied_bytes)
    return est


def build_chunk_plan(pb: Problem, t: Tables, lay: ChunkLayout) -> Plan | None:
    """A plan of ``lay`` with Algorithm 1 shares per group, recomputing a group's layers only when its
    devices do not fit otherwise; None when memory does not fit or the kind cannot run it."""
    got = _unchecked_plan(pb, t, lay)
    return None if got is None else _fitted(pb, lay, *got)


def _unchecked_plan(pb: Problem, t: Tables, lay: ChunkLayout) -> tuple[Plan, list[list[float]]] | None:
    """``lay``'s plan without recomputation and its groups' shares, its activations not checked
    against memory (its weights are); None where the weights or the shares do not fit or the kind
    cannot place it."""
    ranges = lay.ranges
    try:
        pl = placement(lay.kind, len(lay.groups), lay.v)
    except ValueError:
        return None
    if not weights_fit(pb, t, lay, pl):
        return None
    shares = []
    for pos, grp in enumerate(lay.groups):
        secs = [sum(float(t.tau[(h, 0)][ranges[c]]) for c in pl.chunks[pos]) for h in grp]
        s = allocate(lay.b, secs, [lay.b] * len(grp))
        if s is None:
            return None
        shares.append([float(x) for x in s])
    plan = _chunked(pb, lay, shares, [[False] * (b - a) for a, b in ranges])
    return None if plan is None else (plan, shares)


def _chunked(pb: Problem, lay: ChunkLayout, shares: list[list[float]], rec: list[list[bool]]) -> Plan | None:
    names = [[pb.hosts[h] for h in g] for g in lay.groups]
    try:
        return make_chunked_plan(pb.profiles.model, seq_len=pb.profiles.seq_len, global_batch=pb.global_batch,
                                 num_microbatches=pb.global_batch // lay.b, layer_ranges=lay.ranges,
                                 schedule=lay.kind, chunks_per_device=lay.v, group_sizes=[len(g) for g in names],
                                 hosts=[h for g in names for h in g], shares=shares, recompute=rec, strategy="optimal")
    except (ValueError, ScheduleError):
        return None


def _fitted(pb: Problem, lay: ChunkLayout, plan: Plan, shares: list[list[float]]) -> Plan | None:
    """``plan`` (of ``lay``) if every rank fits its device; else with the layers of every chunk on a
    rank that does not recomputed (and once more); None when that does not fit either."""
    for attempt in range(2):
        try:
            mem = device_memory(plan, pb.profiles, pb.memory)
        except (ValueError, ScheduleError):
            return None
        over = {r for r, v in mem.items() if v > pb.budget[plan.device_of_rank(r).host]}
        if not over:
            return plan
        if not pb.allow_recompute or attempt:
            return None
        rec = [[True] * len(st.recompute) if any(r in over for r in st.ranks) else list(st.recompute)
               for st in plan.stages]
        plan = _chunked(pb, lay, shares, rec)
        if plan is None:
            return None
    return None


def layout_bound_of(t: Tables, lay: ChunkLayout, m: int, quick: bool = False) -> float:
    """A lower bound on ``lay``'s priced step (planner/prune.py; ``quick``: its first filter); 0 where
    the kind cannot place it."""
    try:
        pl = placement(lay.kind, len(lay.groups), lay.v)
    except ValueError:
        return 0.0
    return chunk_bound(t, lay.groups, lay.bounds, pl.position, lay.b, m, REGISTRY[lay.kind].split_backward, quick)


def beaten(t: Tables, lay: ChunkLayout, m: int, step: float) -> bool:
    """Whether ``lay`` cannot beat ``step`` (its bound is not below it), the quick bound tried first."""
    return layout_bound_of(t, lay, m, quick=True) >= step or layout_bound_of(t, lay, m) >= step


def fits_weights(pb: Problem, t: Tables, lay: ChunkLayout) -> bool:
    """:func:`weights_fit` of a layout (False where its kind cannot place it)."""
    try:
        pl = placement(lay.kind, len(lay.groups), lay.v)
    except ValueError:
        return False
    return weights_fit(pb, t, lay, pl)


def weights_fit(pb: Problem, t: Tables, lay: ChunkLayout, pl: Placement) -> bool:
    """Whether every device holds the weights of its group's chunks (the base and ``alpha`` × their
    parameter bytes, the tied weight once): a bound below its peak, so a layout failing it is never
    built (the dearest part of building one is its per-rank memory)."""
    tied, ranges = float(pb.profiles.tied_bytes), lay.ranges
    for pos, grp in enumerate(lay.groups):
        cs = pl.chunks[pos]
        shared = tied if 0 in cs and len(ranges) - 1 in cs else 0.0
        need = pb.memory.base + pb.memory.alpha * (sum(float(t.W[ranges[c]]) for c in cs) - shared)
        if any(need > pb.budget[pb.hosts[h]] for h in grp):
            return False
    return True


def price_layout(pb: Problem, t: Tables, lay: ChunkLayout, above: float = INF
                 ) -> tuple[float, Plan | None] | None:
    """``lay``'s plan and its replayed step; None where it does not fit or run. Its memory, the
    dearest part of pricing, is checked only for a plan that replays faster than ``above`` before
    it: one that does not is returned as ``(that step, None)``, a bound on the layout's step (what
    memory adds, recomputation, only adds time), which a descent rejects either way."""
    got = _unchecked_plan(pb, t, lay)
    if got is None:
        return None
    try:
        step = price_plan(pb, got[0], keep=False, above=above) if above < INF else None
        if step is not None and step >= above:
            return step, None
        plan = _fitted(pb, lay, *got)
        if plan is None:
            return None
        if step is not None and plan is got[0]:  # it fits as replayed: kept without a second replay
            keep_priced(pb, plan, step)
            return step, plan
        return price_plan(pb, plan), plan
    except (ValueError, ScheduleError):
        return None


def layouts(costs_of: Callable[[int], StageCosts], kinds: Iterable[str], groups: Sequence[tuple[int, ...]],
            L: int) -> list[tuple[float, ChunkLayout]]:
    """The DP's layout of every multi-chunk kind and chunk count v for one group sequence, with its
    estimate; ``costs_of(v)``: stage costs whose memory checks give each chunk 1/v of its device."""
    out = []
    for kind in kinds:
        for v in chunk_counts(kind, len(groups), L):
            sc = costs_of(v)
            got = dp_cuts(sc, kind, v, groups)
            if got is not None:
                out.append((got[1], ChunkLayout(kind=kind, v=v, b=sc.b, groups=tuple(groups), bounds=got[0])))
    return out


def every_cut(kinds: Iterable[str], b: int, groups: tuple[tuple[int, ...], ...], L: int, limit: int
              ) -> list[ChunkLayout]:
    """Every layout of each kind and chunk count whose cuts number at most ``limit`` (small instances)."""
    out = []
    for kind in kinds:
        for v in chunk_counts(kind, len(groups), L):
            S = v * len(groups)
            if math.comb(L - 1, S - 1) > limit:
                continue
            for cuts in itertools.combinations(range(1, L), S - 1):
                out.append(ChunkLayout(kind=kind, v=v, b=b, groups=groups, bounds=(0, *cuts, L)))
    return out


def group_sequences(n_hosts: int, max_group: int) -> Iterable[tuple[tuple[int, ...], ...]]:
    """Every sequence of disjoint non-empty device sets (devices left over stay idle)."""
    for p in range(1, n_hosts + 1):
        for labels in itertools.product(range(p + 1), repeat=n_hosts):
            groups = tuple(tuple(d for d in range(n_hosts) if labels[d] == s) for s in range(p))
            if all(groups) and max(len(g) for g in groups) <= max_group:
                yield groups


def neighbours(lay: ChunkLayout, kinds: Sequence[str]) -> list[ChunkLayout]:
    """Layouts one move away: a cut ±1 (a layer between neighbouring chunks), two consecutive cuts ±1
    (a chunk shifted), every cut after or before one ±1 (a layer between the last or the first chunk
    and any other: a one-cut move passes it through every chunk between), two groups swapped, the
    other kind of the family."""
    out: list[ChunkLayout] = []
    S, bd = len(lay.bounds) - 1, lay.bounds
    short = [(k, j, d) for k in range(1, S) for d in (-1, 1) for j in (k + 1, k + 2) if j <= S]  # cuts k..j-1
    long = {(k, S) for k in range(1, S)} | {(1, k) for k in range(2, S + 1)} - {(k, j) for k, j, _ in short}
    for k, j, d in short + [(k, j, d) for k, j in sorted(long) for d in (-1, 1)]:
        out.append(replace(lay, bounds=tuple(x + d if k <= i < j else x for i, x in enumerate(bd))))
    for i, j in itertools.combinations(range(len(lay.groups)), 2):
        g = list(lay.groups)
        g[i], g[j] = g[j], g[i]
        out.append(replace(lay, groups=tuple(g)))
    family = REGISTRY[lay.kind].family
    if family in kinds:
        out.append(replace(lay, kind=family))
    return [x for x in out if all(x.bounds[i] < x.bounds[i + 1] for i in range(S))]


def descend(pb: Problem, t: Tables, starts: Sequence[tuple[float, ChunkLayout]], kinds: Sequence[str],
            budget: int, seen: dict, first: bool = False) -> list[tuple[float, Plan]]:
    """Steepest descent on the priced step time from each start, pricing at most ``budget`` layouts;
    ``first``: each step takes the first neighbour that improves, in a fixed shuffled order. A
    budget far below the ~100 neighbours of an 8-device V ends steepest descent within its first
    step; taking the first improvement went further on 21 of 43 random clusters (to 0.86x the
    step), none worse (docs/planner.md)."""
    found: list[tuple[float, Plan]] = []
    used = 0
    order = random.Random(0)
    slower: dict[tuple, float] = {}  # layouts whose unchecked plan did not beat the step they were priced against
    for s0, lay in sorted(starts, key=lambda x: x[0]):
        cur, cur_s = lay, s0
        while used < budget:
            best = None
            nbs = neighbours(cur, kinds)
            if first:
                order.shuffle(nbs)
            for nb in nbs:
                if nb.key not in seen and slower.get(nb.key, 0.0) < cur_s:
                    if beaten(t, nb, pb.global_batch // nb.b, pb.ledger.step_time_s):
                        continue  # cannot beat the best priced plan (planner/prune.py)
                    if used >= budget:
                        break
                    used += 1
                    got = price_layout(pb, t, nb, above=cur_s)
                    if got is not None and got[1] is None:
                        slower[nb.key] = got[0]
                        continue
                    seen[nb.key] = got[0] if got else INF
                    if got:
                        found.append(got)
                if nb.key not in seen:
                    continue
                s = seen[nb.key]
                if s < cur_s * (1 - 1e-12) and (best is None or s < best[0]):
                    best = (s, nb)
                    if first:
                        break
            if best is None:
                break
            cur_s, cur = best
        if used >= budget:
            break
    return found
