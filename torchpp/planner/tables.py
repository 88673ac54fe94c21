"""Matrices over layer cuts that every search step reads: a stage's time, memory and transfer on
every group, from the cost layer's accessors applied to index arrays."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from ..cost import Span, StageMemory, boundary_bytes, stage_time, stage_weights
from .allocate import waterfill
from .types import Problem, fmt_bytes

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
        self.pass_time: dict[int, tuple[np.ndarray, ...]] = {}
        """Per host, nothing recomputed: forward per sample and per call, backward per sample and per
        call (the bounds' fill and drain, planner/prune.py)."""
        for h, name in enumerate(pb.hosts):
            for v in (0, 1):
                st = stage_time(p, name, self.span[v])
                self.tau[(h, v)] = np.where(valid, st.per_sample, np.inf)
                self.tau0[(h, v)] = np.where(valid, st.per_call, 0.0)  # paid once per micro-batch, whatever its size
                if v == 0:
                    self.pass_time[h] = tuple(np.where(valid, x, 0.0) for x in (
                        st.forward_per_sample, st.forward_per_call, st.backward_per_sample, st.backward_per_call))
        whole = Span.of_cut(0, L, L)
        self.full_time = {h: float(stage_time(p, n, whole).per_sample) for h, n in enumerate(pb.hosts)}
        self._per_sample: dict[tuple[int, int, int], np.ndarray] = {}
        self._cap: dict[tuple[int, int, int, int], np.ndarray] = {}
        self.memo: dict[tuple, object] = {}
        """Results the layers above keep per problem (a stage's recomputation, say), keyed by their own names."""

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
        self._stage: dict[tuple, np.ndarray] = {}

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
        """The stage cost matrix of group g before group nxt (kept: the DP of every device order
        asks for the same pairs again)."""
        key = (g, nxt, n, w)
        got = self._stage.get(key)
        if got is None:
            got = self._stage[key] = self._stage_cost(g, nxt, n, w)
        return got

    def _stage_cost(self, g: tuple[int, ...], nxt: tuple[int, ...] | None, n: int, w: int = 0) -> np.ndarray:
        comp, _ = self.compute(g, n, w)
        if nxt:
            comm = self.link_time(g, nxt, self.t.out_bytes * self.b)
            return np.maximum(comp, comm[None, :]) + self.allreduce(g) / self.m
        return comp + self.allreduce(g) / self.m


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

