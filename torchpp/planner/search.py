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
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np

from ..formats import Plan, PlanDevice, PlanStage
from .allocate import waterfill
from ..cost import Links, MemoryEstimator, Profiles, Span, StageMemory, boundary_bytes, stage_time, stage_weights
from ..schedules import PeakState, in_flight, peak_states, split_in_flight
from ..sim.measured import price
from .recompute import choose_recompute

INF = float("inf")


class InfeasibleError(ValueError):
    """No plan fits in memory; the message names devices and the bytes they lack."""


@dataclass(kw_only=True)
class Problem:
    profiles: Profiles
    links: Links
    hosts: list[str]
    budget: Mapping[str, float]
    """Memory budget per host, bytes."""
    memory: MemoryEstimator
    global_batch: int
    schedule: str = "1f1b"
    """A schedule kind, a comma-separated list of kinds, or ``auto`` (every kind, chunks included)."""
    max_stages: int | None = None
    micro_batch_sizes: Sequence[int] | None = None
    """Micro-batch sizes to consider (default: every divisor of the global batch)."""
    allow_recompute: bool = True
    exact_devices: int = 5
    max_group: int = 8
    top_k: int = 12
    optimizer_s_per_byte: Mapping[str, float] | float | None = None
    refine_evals: int | None = None
    """Plans priced by the local search after the DP (default: 300 with exact device orders, 8 up to 16
    devices, none beyond, where one pricing costs more than it tends to gain)."""


@dataclass
class StageChoice:
    cut: tuple[int, int]
    hosts: tuple[int, ...]
    recompute_all: bool
    cost: float


@dataclass
class SearchResult:
    plan: Plan
    step_time_s: float
    candidates_priced: int
    dp_candidates: int
    planning_time_s: float
    priced: list[tuple[float, Plan]] = field(default_factory=list)
    mode: str = ""
    refined: int = 0
    """Plans priced by the local search (included in ``candidates_priced``)."""
    tables: "Tables | None" = None
    kinds: dict[str, float] = field(default_factory=dict)
    """Best priced step time per schedule kind searched."""


# ----------------------------------------------------------------------------- range tables
class Tables:
    """Matrices over layer cuts (c, c2), c < c2: every quantity a stage [c, c2) needs, from the
    cost layer's stage accessors applied to index arrays (the same code that prices one stage)."""

    def __init__(self, pb: Problem):
        self.pb = pb
        p = pb.profiles
        L = p.model.num_layers
        self.L = L
        cuts = np.arange(L + 1)
        valid = cuts[:, None] < cuts[None, :]
        self.valid = valid
        c, c2 = cuts[:, None], cuts[None, :]
        self.span = {v: Span.of_cut(c, c2, L, recompute=bool(v)) for v in (0, 1)}
        """Stage [c, c2) keeping every layer's activations (0) or recomputing every layer (1)."""
        self.mem = StageMemory(p, pb.memory)
        self.W = np.where(valid, stage_weights(p, self.span[0]), 0.0)
        self.static = np.where(valid, self.mem.static(self.span[0]), pb.memory.base)
        self.out_bytes = boundary_bytes(p, Span.of_cut(cuts, cuts, L))  # per sample, leaving a stage ending at c2
        self.hosts = pb.hosts
        self.tau: dict[tuple[int, int], np.ndarray] = {}
        self.tau0: dict[tuple[int, int], np.ndarray] = {}
        for h, name in enumerate(pb.hosts):
            for v in (0, 1):
                st = stage_time(p, name, self.span[v])
                self.tau[(h, v)] = np.where(valid, st.per_sample, np.inf)
                self.tau0[(h, v)] = np.where(valid, st.per_call, 0.0)  # paid once per micro-batch, whatever its size
        whole = Span.of_cut(0, L, L)
        self.full_time = {h: float(stage_time(p, n, whole).per_sample) for h, n in enumerate(pb.hosts)}
        self._per_sample: dict[tuple[int, int, int], np.ndarray] = {}
        self._cap: dict[tuple[int, int, int, int], np.ndarray] = {}
        self._rec: dict[tuple, tuple[list[bool], list[int]] | None] = {}

    def recompute(self, hosts: Sequence[int], cut: tuple[int, int], b: int, states: tuple[PeakState, ...]
                  ) -> tuple[list[bool], list[int]] | None:
        """``choose_recompute`` of a stage, kept: the local search and the schedule kinds build the
        same stage many times, and its MILP is the dearest step of building a plan."""
        key = (tuple(hosts), cut, b, states)
        if key not in self._rec:
            self._rec[key] = choose_recompute(self.pb, self, hosts, cut, b, states)
        got = self._rec[key]
        return None if got is None else (list(got[0]), list(got[1]))

    def per_sample(self, v: int, n: int, w: int = 0) -> np.ndarray:
        """Memory bytes per sample of every stage, ``n`` micro-batches in flight, ``w`` of them
        between their I and their W (zero-bubble kinds)."""
        key = (v, n, w)
        if key not in self._per_sample:
            ps = self.mem.per_sample(self.span[v], n, w)
            self._per_sample[key] = np.where(self.valid, np.maximum(ps, 1e-30), np.inf)
        return self._per_sample[key]

    def cap(self, h: int, v: int, n: int, w: int = 0) -> np.ndarray:
        key = (h, v, n, w)
        if key not in self._cap:
            avail = self.pb.budget[self.hosts[h]] - self.static
            self._cap[key] = np.where(self.valid, np.maximum(avail, 0.0) / self.per_sample(v, n, w), 0.0)
        return self._cap[key]


class StageCosts:
    """Cached stage-cost matrices for groups (tuples of host indices)."""

    def __init__(self, tables: Tables, b: int, m: int, allow_recompute: bool):
        self.t, self.b, self.m, self.rec = tables, b, m, allow_recompute
        self._compute: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}
        self._ar: dict[tuple, np.ndarray] = {}
        self._link: dict[tuple, float] = {}

    def compute(self, g: tuple[int, ...], n: int, w: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """(time per micro-batch, recompute-all flag) matrices of group g holding n micro-batches,
        w of them between their I and their W."""
        key = (g, n, w)
        if key not in self._compute:
            t = self.t
            if len(g) > self.b:
                inf = np.full_like(t.W, np.inf)
                self._compute[key] = (inf, np.zeros_like(inf, dtype=bool))
            else:
                # per-call time: bounded above by the slowest member's, which the final pricing refines
                t0 = waterfill(self.b, np.stack([t.tau[(h, 0)] for h in g]), np.stack([t.cap(h, 0, n, w) for h in g]))
                t0 = t0 + np.max(np.stack([t.tau0[(h, 0)] for h in g]), axis=0)
                if self.rec:
                    t1 = waterfill(self.b, np.stack([t.tau[(h, 1)] for h in g]),
                                   np.stack([t.cap(h, 1, n, w) for h in g]))
                    t1 = t1 + np.max(np.stack([t.tau0[(h, 1)] for h in g]), axis=0)
                    use1 = t1 < t0
                    self._compute[key] = (np.where(use1, t1, t0), use1)
                else:
                    self._compute[key] = (t0, np.zeros_like(t0, dtype=bool))
        return self._compute[key]

    def allreduce(self, g: tuple[int, ...]) -> np.ndarray:
        if g not in self._ar:
            t = self.t
            if len(g) == 1:
                self._ar[g] = np.zeros_like(t.W)
            else:
                names = [t.hosts[h] for h in g]
                unit = t.pb.links.ring_allreduce(names, 1.0)
                lat = t.pb.links.ring_allreduce(names, 0.0)
                self._ar[g] = lat + (unit - lat) * t.W  # ring time is affine in bytes
                if lat == 0.0:
                    self._ar[g] = unit * t.W
        return self._ar[g]

    def link_time(self, g: tuple[int, ...], nxt: tuple[int, ...], nbytes: np.ndarray) -> np.ndarray:
        """Seconds to move nbytes over the slowest link between the groups (both directions)."""
        key = (g, nxt)
        if key not in self._link:
            names = self.t.hosts
            per_byte, lat = 0.0, 0.0
            for a in g:
                for c in nxt:
                    for s, d in ((a, c), (c, a)):
                        per_byte = max(per_byte, self.t.pb.links.time(names[s], names[d], 1.0)
                                       - self.t.pb.links.time(names[s], names[d], 0.0))
                        lat = max(lat, self.t.pb.links.time(names[s], names[d], 0.0))
            self._link[key] = (per_byte, lat)
        per_byte, lat = self._link[key]
        return lat + per_byte * nbytes

    def stage(self, g: tuple[int, ...], nxt: tuple[int, ...] | None, n: int, w: int = 0) -> np.ndarray:
        comp, _ = self.compute(g, n, w)
        cost = comp + self.allreduce(g) / self.m
        if nxt:
            comm = self.link_time(g, nxt, self.t.out_bytes * self.b)
            cost = np.maximum(comp, comm[None, :]) + self.allreduce(g) / self.m
        return cost


def stage_cost(pb: Problem, group: Sequence[str], next_group: Sequence[str] | None, cut: tuple[int, int],
               micro_batch_size: int, num_microbatches: int, n_in_flight: int, _cache: dict | None = None,
               n_split: int = 0) -> float:
    """The search's cost of one stage per micro-batch (the quantity its DP minimises the maximum of)."""
    cache = _cache if _cache is not None else {}
    key = ("tables",)
    if key not in cache:
        cache[key] = Tables(pb)
    t: Tables = cache[key]
    k2 = ("costs", micro_batch_size)
    if k2 not in cache:
        cache[k2] = StageCosts(t, micro_batch_size, num_microbatches, pb.allow_recompute)
    sc: StageCosts = cache[k2]
    idx = {h: i for i, h in enumerate(pb.hosts)}
    g = tuple(sorted(idx[h] for h in group))
    nx = tuple(sorted(idx[h] for h in next_group)) if next_group else None
    return float(sc.stage(g, nx, n_in_flight, n_split)[cut[0], cut[1]])


# ----------------------------------------------------------------------------- the DP
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


# ----------------------------------------------------------------------------- from DP to plans
REFINE_HEURISTIC = 8
"""Local-search pricings beyond ``exact_devices`` devices (up to 16 devices)."""
HEURISTIC_MAX_STAGES = 16
"""Beyond ``exact_devices`` devices, at most this many stages unless max_stages says otherwise."""
HEURISTIC_MICRO_BATCH_SIZES = 4
"""Beyond ``exact_devices`` devices, at most this many micro-batch sizes (spread geometrically)."""


def micro_batch_sizes(pb: Problem, exact: bool = True) -> list[int]:
    G = pb.global_batch
    if pb.micro_batch_sizes:
        bad = [b for b in pb.micro_batch_sizes if b < 1 or G % b]
        if bad:
            raise ValueError(f"micro-batch sizes {bad} do not divide the global batch {G}")
        return sorted(set(pb.micro_batch_sizes))
    divs = [b for b in range(1, G + 1) if G % b == 0]
    if exact or len(divs) <= HEURISTIC_MICRO_BATCH_SIZES:
        return divs
    # keep micro-batch counts m = G / b that leave room for a pipeline: the smallest b values,
    # spread over the divisors with m >= 2
    usable = [b for b in divs if G // b >= 2] or divs
    idx = np.unique(np.round(np.linspace(0, len(usable) - 1, HEURISTIC_MICRO_BATCH_SIZES)).astype(int))
    return [usable[i] for i in idx]


def build_plan(pb: Problem, t: Tables, order: Sequence[int], stages: list[StageChoice], b: int, strategy: str
               ) -> Plan | None:
    """Integer samples (Algorithm 1) and per-layer recompute (MILP); None if memory does not fit."""
    p = pb.profiles
    m = pb.global_batch // b
    S = len(stages)
    out: list[PlanStage] = []
    rank = 0
    for s, st in enumerate(stages):
        a, i = st.hosts
        hosts = [order[x] for x in range(a, i)]
        c, c2 = st.cut
        try:
            states = peak_states(pb.schedule, S, s, m)
        except ValueError:  # the kind's order cannot run m micro-batches on S stages (zb-h1's rounds)
            return None
        names = [pb.hosts[h] for h in hosts]
        layers = list(range(c, c2))
        rec = t.recompute(hosts, (c, c2), b, states)
        if rec is None:
            return None
        flags, samples = rec
        devs = [PlanDevice(host=nm, rank=rank + j, share=samples[j] / b, samples=samples[j])
                for j, nm in enumerate(names)]
        rank += len(devs)
        out.append(PlanStage(index=s, layers=(c, c2), has_embed=s == 0, has_tail=s == S - 1, devices=devs,
                             recompute=flags))
        assert len(flags) == len(layers)
    return Plan(model=p.model, seq_len=p.seq_len, global_batch=pb.global_batch, micro_batch_size=b,
                num_microbatches=m, schedule=pb.schedule, stages=out, strategy=strategy)


def bottlenecks(pb: Problem, t: Tables | None = None, orders: Sequence[tuple[int, ...]] | None = None,
                collect: list | None = None) -> dict[tuple[int, int], tuple[float, tuple[int, ...], list[StageChoice]]]:
    """The DP's optimum per (micro-batch size, stage count): (bottleneck, device order, stages)."""
    t = t or Tables(pb)
    orders = orders if orders is not None else device_orders(pb, t)[0]
    exact = len(pb.hosts) <= pb.exact_devices
    max_stages = pb.max_stages or (len(pb.hosts) if exact else min(len(pb.hosts), HEURISTIC_MAX_STAGES))
    best: dict[tuple[int, int], tuple[float, tuple[int, ...], list[StageChoice]]] = {}
    shared: dict[tuple[int, ...], dict] = {}
    for b in micro_batch_sizes(pb, exact):
        m = pb.global_batch // b
        sc = StageCosts(t, b, m, pb.allow_recompute)
        for order in orders:
            if exact:
                found = dp_order(order, sc, max_stages, len(pb.hosts))
            else:
                found = dp_order_fast(order, sc, max_stages, pb.max_group, shared.setdefault(tuple(order), {}))
            for S, (val, stages) in found.items():
                if collect is not None:
                    collect.append(((m + S - 1) * val, val, b, tuple(order), stages))
                if (b, S) not in best or val < best[(b, S)][0]:
                    best[(b, S)] = (val, tuple(order), stages)
    return best


def search_single(pb: Problem, progress=None) -> SearchResult:
    """The plan of one one-chunk schedule kind (``pb.schedule``) with the lowest priced step time."""
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
    cands.sort(key=lambda x: x[0])
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
    priced: list[tuple[float, Plan]] = []
    seeds: list[tuple[float, int, list[tuple[tuple[int, int], tuple[int, ...]]]]] = []
    for est, val, b, order, stages in picked:
        plan = build_plan(pb, t, order, stages, b, "optimal")
        if plan is None:
            continue
        step, _ = price(plan, pb.profiles, pb.links, pb.optimizer_s_per_byte)
        priced.append((step, plan))
        seeds.append((step, b, [(st.cut, tuple(order[x] for x in range(*st.hosts))) for st in stages]))
        if progress:
            progress(f"  candidate: {plan.num_stages} stage(s), micro-batch {b} x {plan.num_microbatches}: "
                     f"bottleneck {val:.4g} s, priced step {step:.4g} s")
    if not priced:
        raise InfeasibleError(infeasible_message(pb, t))
    exact = len(pb.hosts) <= pb.exact_devices
    budget = pb.refine_evals if pb.refine_evals is not None else (
        300 if exact else REFINE_HEURISTIC if len(pb.hosts) <= 16 else 0)
    before = min(s for s, _ in priced)
    found = refine(pb, t, seeds, budget)
    priced += found
    if progress and found:
        progress(f"  local search: {len(found)} plan(s) priced, best step {min(s for s, _ in priced):.4g} s "
                 f"(DP candidates' best {before:.4g} s)")
    priced.sort(key=lambda x: x[0])
    step, plan = priced[0]
    return SearchResult(plan=plan, step_time_s=step, candidates_priced=len(priced), dp_candidates=len(cands),
                        planning_time_s=time.perf_counter() - t0, priced=priced, mode=mode, refined=len(found),
                        tables=t)


Layout = list[tuple[tuple[int, int], tuple[int, ...]]]
"""A plan's shape: per stage its layer cut [c, c2) and its group (host indices)."""


def _neighbours(layout: Layout, n_hosts: int) -> list[Layout]:
    """Plans one move away: a cut ±1, a stage shifted ±1, two groups swapped, two stages merged, a
    stage split (onto an idle device or part of its group), one device moved or left idle."""
    S = len(layout)
    cuts = [c for c, _ in layout]
    groups = [g for _, g in layout]
    out: list[Layout] = []

    def with_bounds(bounds: list[int]) -> Layout | None:
        if any(bounds[i] >= bounds[i + 1] for i in range(S)):
            return None
        return [((bounds[i], bounds[i + 1]), groups[i]) for i in range(S)]

    bounds = [cuts[0][0]] + [c2 for _, c2 in cuts]
    for k in range(1, S):
        for d in (-1, 1):
            nb = list(bounds)
            nb[k] += d
            out.append(with_bounds(nb))
            if k + 1 < S:  # shift stage k (both of its cuts)
                nb2 = list(nb)
                nb2[k + 1] += d
                out.append(with_bounds(nb2))
    for i in range(S):
        for j in range(i + 1, S):
            g = list(groups)
            g[i], g[j] = g[j], g[i]
            out.append([(cuts[x], g[x]) for x in range(S)])
    for k in range(S - 1):  # merge two adjacent stages, keeping either group or both
        merged = (cuts[k][0], cuts[k + 1][1])
        for g in (groups[k], groups[k + 1], tuple(sorted(groups[k] + groups[k + 1]))):
            out.append([*layout[:k], (merged, g), *layout[k + 2:]])
    used = {h for g in groups for h in g}
    idle = [h for h in range(n_hosts) if h not in used]
    for k in range(S):  # split a stage: part of its layers to an idle device or to part of its group
        (c, c2), g = layout[k]
        options = [(g, (h,)) for h in idle] + [((h,), g) for h in idle]
        if len(g) > 1:
            options += [(g[:i], g[i:]) for i in range(1, len(g))]
        for x in range(c + 1, c2):
            for g1, g2 in options:
                out.append([*layout[:k], ((c, x), g1), ((x, c2), g2), *layout[k + 1:]])
    for h in range(n_hosts):
        src = next((i for i, g in enumerate(groups) if h in g), None)
        targets = [j for j in range(S) if j != src]
        for j in targets + ([None] if src is not None else []):
            g = [tuple(x for x in grp if x != h) for grp in groups]
            if j is not None:
                g[j] = tuple(sorted(g[j] + (h,)))
            if any(not x for x in g):
                continue
            if src is None and h in used:
                continue
            out.append([(cuts[x], g[x]) for x in range(S)])
    return [x for x in out if x is not None]


def refine(pb: Problem, t: Tables, seeds: Sequence[tuple[float, int, Layout]], budget: int
           ) -> list[tuple[float, Plan]]:
    """Steepest descent on the priced step time from the best seeds, pricing at most ``budget`` new plans."""
    if budget <= 0:
        return []
    exact = len(pb.hosts) <= pb.exact_devices
    max_stages = pb.max_stages or (len(pb.hosts) if exact else min(len(pb.hosts), HEURISTIC_MAX_STAGES))
    max_group = len(pb.hosts) if exact else pb.max_group

    def key(b: int, lay: Layout) -> tuple:
        return (b, tuple((c, tuple(sorted(g))) for c, g in lay))

    seen: dict[tuple, float] = {key(b, lay): s for s, b, lay in seeds}
    found: list[tuple[float, Plan]] = []
    starts = sorted(seeds, key=lambda x: x[0])
    used = 0
    done: set[tuple] = set()
    for step0, b, lay in starts:
        if used >= budget:
            break
        if key(b, lay) in done:
            continue
        cur, cur_s = lay, step0
        while used < budget:
            done.add(key(b, cur))
            best: tuple[float, Layout] | None = None
            for nb in _neighbours(cur, len(pb.hosts)):
                if len(nb) > max_stages or any(len(g) > min(max_group, b) for _, g in nb):
                    continue  # outside the search space the DP was given
                k = key(b, nb)
                if k in seen:
                    s = seen[k]
                else:
                    if used >= budget:
                        break
                    used += 1
                    order = [h for _, g in nb for h in g]
                    pos, stages = 0, []
                    for c, g in nb:
                        stages.append(StageChoice(cut=c, hosts=(pos, pos + len(g)), recompute_all=False, cost=0.0))
                        pos += len(g)
                    plan = build_plan(pb, t, order, stages, b, "optimal")
                    s = INF
                    if plan is not None:
                        s = price(plan, pb.profiles, pb.links, pb.optimizer_s_per_byte)[0]
                        found.append((s, plan))
                    seen[k] = s
                if s < cur_s * (1 - 1e-12) and (best is None or s < best[0]):
                    best = (s, nb)
            if best is None:
                break
            cur_s, cur = best
    return found


def fmt_bytes(n: float) -> str:
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n:.0f} B"


def infeasible_message(pb: Problem, t: Tables) -> str:
    """Which devices lack how many bytes for even their smallest possible share."""
    L = t.L

    def need(c: int, c2: int) -> float:  # one sample, one micro-batch in flight, every layer recomputed
        return float(t.mem.peak(Span.of_cut(c, c2, L, recompute=True), 1, 1))

    whole = need(0, L)
    single = min(need(c, c + 1) for c in range(L))
    total_budget = sum(pb.budget[h] for h in pb.hosts)
    short = [f"{h} (budget {fmt_bytes(pb.budget[h])}, missing {fmt_bytes(single - pb.budget[h])})"
             for h in pb.hosts if pb.budget[h] < single]
    msg = (f"no plan fits in memory ({pb.memory.source}): the whole model needs {fmt_bytes(whole)} with one sample "
           f"in flight and every layer recomputed, the devices have {fmt_bytes(total_budget)} together")
    if whole > total_budget:
        msg += f", missing {fmt_bytes(whole - total_budget)}"
    if short:
        msg += f"; the smallest stage (one layer, one sample) needs {fmt_bytes(single)}, which does not fit on " + \
            ", ".join(short)
    else:
        msg += ("; every device holds a one-layer stage, but no split into at most "
                f"{pb.max_stages or len(pb.hosts)} stage(s) fits (raise --max-stages or add memory)")
    return msg


# ----------------------------------------------------------------------------- the heuristic DP (many devices)
def dp_order_fast(order: Sequence[int], sc: StageCosts, max_stages: int, max_group: int,
                  shared: dict | None = None) -> dict[int, tuple[float, list[StageChoice]]]:
    """Vectorised DP for one order when there are too many devices to try every order.

    State (j, a, c): the suffix's head group starts at position a of the order and its layers
    at cut c. The transfer to the next group is priced on the slowest link between the group
    and the next group's first device (the next group's extent is not part of the state), and
    the 1F1B in-flight count is rounded up to a power of two for the memory check.
    """
    return _FastDP(order, sc, max_group, shared if shared is not None else {}).solve(max_stages)


f32 = np.float32


def _order_tables(order: Sequence[int], t: Tables, max_group: int) -> dict:
    """What the fast DP needs of one device order whatever the micro-batch size (kept across calls):
    prefix sums of 1/τ over the order, the groups' all-reduce and next-link coefficients, each
    device's memory left for activations and its 1/τ per byte of it."""
    sh: dict = {}
    N, L1 = len(order), t.L + 1
    INV = {v: np.stack([1.0 / t.tau[(h, v)] for h in order]).astype(f32) for v in (0, 1)}  # (N, L1, L1)
    sh["CINV"] = {v: np.concatenate([np.zeros((1, L1, L1), f32),
                                     np.cumsum(INV[v], axis=0, dtype=np.float64).astype(f32)]) for v in (0, 1)}
    sh["INV"] = INV
    sh["links"] = _group_links([t.hosts[h] for h in order], t.pb.links, min(max_group, N))
    AVAIL = np.stack([np.maximum(t.pb.budget[t.hosts[h]] - t.static, 0.0) for h in order]).astype(f32)
    sh["AVAIL"] = AVAIL
    with np.errstate(divide="ignore", invalid="ignore"):
        sh["RATIO"] = {v: INV[v] / AVAIL for v in (0, 1)}              # inf where a device holds nothing
    sh["win"] = {}
    return sh


def _group_links(names: Sequence[str], links: Links, Kmax: int) -> tuple[np.ndarray, ...]:
    """All-reduce coefficients and links to the next position, per group (a, k) of ``names``:
    (all-reduce latency, all-reduce seconds per byte, next-link latency, next-link seconds per byte)."""
    N = len(names)
    ar_unit, ar_lat = np.zeros((Kmax + 1, N)), np.zeros((Kmax + 1, N))
    nx_byte, nx_lat = np.zeros((Kmax + 1, N)), np.zeros((Kmax + 1, N))
    for k in range(1, Kmax + 1):
        for a in range(N - k + 1):
            g = names[a:a + k]
            if k > 1:
                lat = links.ring_allreduce(g, 0.0)
                ar_lat[k, a], ar_unit[k, a] = lat, links.ring_allreduce(g, 1.0) - lat
            if a + k < N:
                d = names[a + k]
                pb_, lt = 0.0, 0.0
                for s in g:
                    for x, y in ((s, d), (d, s)):
                        l0 = links.time(x, y, 0.0)
                        pb_, lt = max(pb_, links.time(x, y, 1.0) - l0), max(lt, l0)
                nx_byte[k, a], nx_lat[k, a] = pb_, lt
    return tuple(x.astype(f32) for x in (ar_lat, ar_unit, nx_lat, nx_byte))


class _FastDP:
    """One run of :func:`dp_order_fast`: its per-order tables, its per-micro-batch-size caches and
    the stage-cost matrices of groups order[a:a+k] for every a."""

    def __init__(self, order: Sequence[int], sc: StageCosts, max_group: int, shared: dict):
        # float32 halves the memory traffic of this search; the chosen plans are re-checked in float64.
        # Everything that does not depend on the micro-batch size is kept in ``shared`` across calls.
        t = sc.t
        self.t, self.m, self.b, self.rec = t, sc.m, sc.b, sc.rec
        self.L, self.N = t.L, len(order)
        self.K = min(max_group, self.N, self.b)
        if not shared:
            shared.update(_order_tables(order, t, max_group))
        self.sh = shared
        self.INV, self.CINV, self.AVAIL, self.RATIO = shared["INV"], shared["CINV"], shared["AVAIL"], shared["RATIO"]
        self.win: dict[tuple[int, int], tuple[np.ndarray, ...]] = shared["win"]
        if "FIX" not in shared:
            shared["FIX"] = {1: np.stack([t.tau0[(h, 0)] for h in order]).astype(f32)}  # (N, L1, L1) s per call
        self.fix_win: dict[int, np.ndarray] = shared["FIX"]
        self.btt: dict[tuple[int, int], np.ndarray] = {}
        self.cost_cache: dict[tuple[int, int, bool], np.ndarray] = {}
        self.W32 = t.W.astype(f32)
        self.out32 = (t.out_bytes * self.b).astype(f32)
        self.ps_cache: dict[tuple[int, int], np.ndarray] = {}

    def window(self, k: int, v: int):
        """Per group order[a:a+k]: Σ 1/τ (time = b / it), max INV/avail, min and sum of avail."""
        win = self.win
        if (k, v) not in win:
            A = self.N - k + 1
            speed = self.CINV[v][k:k + A] - self.CINV[v][0:A]
            RATIO, AVAIL = self.RATIO, self.AVAIL
            if k == 1:
                rmax, amin, asum = RATIO[v][:A], AVAIL[:A], AVAIL[:A]
            else:
                _, r0, m0, s0 = self.window(k - 1, v)
                rmax = np.maximum(r0[:A], RATIO[v][k - 1:k - 1 + A])
                amin = np.minimum(m0[:A], AVAIL[k - 1:k - 1 + A])
                asum = s0[:A] + AVAIL[k - 1:k - 1 + A]
            win[(k, v)] = (speed, rmax, amin, asum)
        return win[(k, v)]

    def fixed_max(self, k: int) -> np.ndarray:
        """Per group order[a:a+k]: the slowest member's seconds per call."""
        if k not in self.fix_win:
            prev = self.fixed_max(k - 1)
            self.fix_win[k] = np.maximum(prev[:self.N - k + 1], self.fix_win[1][k - 1:])
        return self.fix_win[k]

    def times(self, k: int, v: int) -> np.ndarray:
        """Unconstrained group time b / Σ 1/τ for this micro-batch size."""
        if (k, v) not in self.btt:
            with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
                self.btt[(k, v)] = f32(self.b) / self.window(k, v)[0]
        return self.btt[(k, v)]

    def per_sample32(self, v: int, n: int, w: int = 0) -> np.ndarray:
        if (v, n, w) not in self.ps_cache:
            self.ps_cache[(v, n, w)] = self.t.per_sample(v, n, w).astype(f32)
        return self.ps_cache[(v, n, w)]

    def fill(self, v: int, k: int, P: np.ndarray, ia, ic, ic2) -> np.ndarray:
        """Water-fill the entries (ia, ic, ic2) of groups order[a:a+k] whose proportional share overflows."""
        tau_g = np.stack([1.0 / self.INV[v][ia + d, ic, ic2] for d in range(k)])
        cap_g = np.stack([self.AVAIL[ia + d, ic, ic2] / P[ic, ic2] for d in range(k)])
        return waterfill(self.b, tau_g, cap_g)

    def cost(self, k: int, n: int, last: bool, w: int = 0) -> np.ndarray:
        """(N−k+1, L1, L1) stage cost of groups order[a:a+k] for every a (last stage: column L only)."""
        key = (k, n, last, w)
        if key in self.cost_cache:
            return self.cost_cache[key]
        A, c0 = self.N - k + 1, (self.L if last else 0)
        ar_lat, ar_unit, nx_lat, nx_byte = self.sh["links"]
        valid = self.t.valid[None, :, c0:]
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            best = self._compute_time(k, n, c0, w) + self.fixed_max(k)[:, :, c0:]  # per call: the slowest member's
            ar = (ar_lat[k, :A, None, None] + ar_unit[k, :A, None, None] * self.W32[None, :, c0:]) / self.m
            if last:
                out = best + ar
            else:
                comm = nx_lat[k, :A, None] + nx_byte[k, :A, None] * self.out32[None, :]  # (A, L1)
                out = np.maximum(best, comm[:, None, :]) + ar
        out = np.where(valid, out, np.inf)
        self.cost_cache[key] = out
        return out

    def _compute_time(self, k: int, n: int, c0: int, w: int = 0) -> np.ndarray:
        """Per-sample time of a micro-batch on groups order[a:a+k] holding ``n`` in flight (``w``
        of them between I and W): shares
        proportional to speed, water-filled where one overflows a device, every layer recomputed
        where that fits and keeping activations does not (inf: fits neither way)."""
        b = self.b
        _, rmax, amin, asum = (x[:, :, c0:] for x in self.window(k, 0))
        tt = self.times(k, 0)[:, :, c0:]
        P = self.per_sample32(0, n, w)
        Pc = P[:, c0:]
        valid = self.t.valid[None, :, c0:]
        infeasible = (asum < b * Pc) | (amin < Pc) | ~valid
        bad = (tt * rmax * Pc > 1.0) & ~infeasible              # a proportional share overflows a device
        best = np.where(infeasible, f32(np.inf), tt)
        ia, ic, ic2 = np.nonzero(bad)
        if len(ia):
            best[ia, ic, ic2] = self.fill(0, k, P, ia, ic, ic2 + c0)
        best = np.where(np.isnan(best), np.inf, best)
        if self.rec:  # recomputing every layer can only help where keeping activations does not fit
            P1 = self.per_sample32(1, n, w)
            P1c = P1[:, c0:]
            fits1 = (asum >= b * P1c) & (amin >= P1c)         # memory allows it with every layer recomputed
            ia, ic, ic2 = np.nonzero((infeasible | bad) & valid & fits1)
            if len(ia):
                g2 = ic2 + c0
                tt1, r1 = self.times(k, 1)[ia, ic, g2], self.window(k, 1)[1][ia, ic, g2]
                p1 = P1[ic, g2]
                bad1 = tt1 * r1 * p1 > 1.0
                sel = np.nonzero(bad1)[0]
                if len(sel):
                    tt1[sel] = self.fill(1, k, P1, ia[sel], ic[sel], g2[sel])
                tt1 = np.where(np.isnan(tt1), np.inf, tt1)
                best[ia, ic, ic2] = np.minimum(best[ia, ic, ic2], tt1)
        return best

    def solve(self, max_stages: int) -> dict[int, tuple[float, list[StageChoice]]]:
        """The best bottleneck and stages per stage count, suffixes grown one stage at a time."""
        N, L1, m = self.N, self.L + 1, self.m
        S_max = min(max_stages, self.L, N)
        best_by_S: dict[int, tuple[float, list[StageChoice]]] = {}
        V, lastk = self._last_stage()
        ptrs: list[tuple[np.ndarray, np.ndarray]] = []
        for j in range(S_max):
            if np.isfinite(V[0, 0]):
                best_by_S[j + 1] = (float(V[0, 0]), _reconstruct_fast(ptrs, lastk, j, self.L))
            if j + 1 >= S_max:
                break
            n, w = (_round_up_in_flight(x, m) for x in suffix_in_flight(self.t.pb.schedule, j + 1, m))
            V, argk, argc = self._prepend_stage(V, n, w)
            ptrs.append((argk, argc))
        return best_by_S

    def _last_stage(self) -> tuple[np.ndarray, np.ndarray]:
        """Suffixes of one stage: the best group size for each start position and first layer."""
        N, L1 = self.N, self.L + 1
        n0, w0 = suffix_in_flight(self.t.pb.schedule, 0, self.m)
        V = np.full((N + 1, L1), np.inf, dtype=f32)
        lastk = np.zeros((N + 1, L1), dtype=int)
        for k in range(1, self.K + 1):
            ck = self.cost(k, n0, True, w0)[:, :, 0]                      # (A, L1): layers [c, L)
            A = N - k + 1
            better = ck < V[:A]
            V[:A] = np.where(better, ck, V[:A])
            lastk[:A] = np.where(better, k, lastk[:A])
        return V, lastk

    def _prepend_stage(self, V: np.ndarray, n: int, w: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Suffixes one stage longer: a head group (size k, layers [c, c2)) before the best suffix at (a + k, c2)."""
        N, L1 = self.N, self.L + 1
        newV = np.full((N + 1, L1), np.inf, dtype=f32)
        argk = np.zeros((N + 1, L1), dtype=int)
        argc = np.zeros((N + 1, L1), dtype=int)
        for k in range(1, self.K + 1):
            A = N - k
            if A <= 0:
                continue
            ck = self.cost(k, n, False, w)[:A]                      # groups starting at a < N - k (a next group exists)
            tot = np.maximum(ck, V[k:k + A, None, :])       # (A, L1 c, L1 c2)
            ac = tot.argmin(axis=2)
            val = np.take_along_axis(tot, ac[:, :, None], axis=2)[:, :, 0]
            better = val < newV[:A]
            newV[:A] = np.where(better, val, newV[:A])
            argk[:A] = np.where(better, k, argk[:A])
            argc[:A] = np.where(better, ac, argc[:A])
        return newV, argk, argc


def _round_up_in_flight(n: int, m: int) -> int:
    """In-flight count rounded up to a power of two (at most m; 0 stays 0): fewer distinct memory
    checks, never an underestimate (the final plan is checked with the exact count)."""
    return min(m, 1 << (n - 1).bit_length()) if n > 0 else 0


def _reconstruct_fast(ptrs, lastk, j: int, L: int) -> list[StageChoice]:
    out: list[StageChoice] = []
    a, c = 0, 0
    for level in range(j - 1, -1, -1):
        argk, argc = ptrs[level]
        k, c2 = int(argk[a, c]), int(argc[a, c])
        out.append(StageChoice(cut=(c, c2), hosts=(a, a + k), recompute_all=False, cost=0.0))
        a, c = a + k, c2
    k = int(lastk[a, c])
    out.append(StageChoice(cut=(c, L), hosts=(a, a + k), recompute_all=False, cost=0.0))
    return out


def search(pb: Problem, progress=None) -> SearchResult:
    """Find the plan with the lowest priced step time over the schedule kinds ``pb.schedule`` names
    (see the module docstring; several kinds or ``auto``: :mod:`torchpp.planner.kinds`)."""
    from .chunks import schedule_kinds

    kinds = schedule_kinds(pb.schedule)
    if len(kinds) == 1 and kinds[0] in ("1f1b", "gpipe"):
        res = search_single(pb, progress)
        res.kinds = {kinds[0]: res.step_time_s}
        return res
    from .kinds import search_kinds

    return search_kinds(pb, kinds, progress)
