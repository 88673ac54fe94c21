"""A lower bound on the replayed step of many layouts of one shape at once: the longest path
through their kind's order with every step at its own compute time and every transfer on a rested,
otherwise idle link.

The replay (``sim.replay``) runs each rank's actions in its order, a forward after the previous
chunk's forward of the same micro-batch has arrived, an input gradient after the next chunk's; it
only adds to that path (links carry one send at a time, recomputation adds forwards, groups share
samples unevenly, all-reduces wait). Layouts of one shape (kind, depth, chunks per position,
micro-batch size, device groups) share the order's graph (``orderbound.order_dag``); only the
durations change with the cuts, so the path is worked out for a whole array of cuts in one pass
over the graph. The exact enumeration (:mod:`.exact`) prices a layout only where this bound is
below the best step found.
"""
from __future__ import annotations

import numpy as np

from ..cost import stage_time
from ..cost.actions import optimizer_rate
from .chunks import placement
from .orderbound import order_dag, step_type
from .tables import Tables
from .types import INF, Problem


class PathBound:
    """The bound for one shape: ``kind`` at depth ``len(groups)`` with ``v`` chunks per position, ``b``
    samples per micro-batch, ``groups[pos]`` the devices at each position."""

    def __init__(self, pb: Problem, t: Tables, kind: str, groups: tuple[tuple[int, ...], ...], v: int, b: int):
        self.pb, self.t, self.b = pb, t, b
        m = pb.global_batch // b
        pl = placement(kind, len(groups), v)
        self.position = pl.position
        self.chunks = pl.chunks
        orders, topo, preds, _ = order_dag(kind, pl, m)
        index = {n: k for k, n in enumerate(topo)}
        # per node in topological order: (position, type, chunk, same-rank predecessor or -1,
        # cross-rank predecessors as (node, boundary chunk offset, source position))
        self.nodes: list[tuple[int, str, int, int, list[tuple[int, int, int]]]] = []
        for pos, i in topo:
            k, c, _ = orders[pos][i]
            typ = step_type(k)
            cross = []
            for a, j, _ in preds[(pos, i)]:
                # a forward's activation leaves chunk c - 1 at bounds[c]; a gradient leaves chunk c + 1
                # at bounds[c + 1] (the output of chunk c, the same bytes)
                cross.append((index[(a, j)], c if typ == "F" else c + 1, a))
            self.nodes.append((pos, typ, c, index[(pos, i - 1)] if i else -1, cross))
        self.last = [index[(pos, len(orders[pos]) - 1)] for pos in range(pl.p)]
        self.groups = groups
        self.dur = [self._durations(g) for g in groups]
        self.hop = {(a, c): hop_times(pb, t, groups[a], groups[c], b) for a in range(pl.p) for c in range(pl.p)
                    if a != c}
        p = pb.profiles
        self.opt = [min(optimizer_rate(pb.optimizer_s_per_byte, pb.hosts[h]) if pb.optimizer_s_per_byte is not None
                        else p.optimizer_rate(pb.hosts[h])[0] for h in g) for g in groups]
        self.tied = float(p.tied_bytes) if p.model.tied_embeddings else 0.0
        ends = set(groups[pl.position[0]]) | set(groups[pl.position[-1]])
        self.tied_s = (pb.links.ring_allreduce([pb.hosts[h] for h in sorted(ends)], self.tied)
                       if self.tied and pl.position[0] != pl.position[-1] else 0.0)

    def _durations(self, g: tuple[int, ...]) -> dict[str, np.ndarray]:
        """Per step type, its seconds over cuts (c, c2) nothing recomputed: on b samples for one
        device, the least of its devices on one sample for a group (each runs a share of one at least)."""
        key = ("path durations", g, self.b)
        got = self.t.memo.get(key)
        if got is None:
            n = self.b if len(g) == 1 else 1
            per = [_step_matrices(self.pb, self.t, h, n) for h in g]
            got = self.t.memo[key] = {typ: np.minimum.reduce([x[typ] for x in per]) for typ in per[0]}
        return got

    def bound(self, bounds: np.ndarray) -> np.ndarray:
        """The bound of each row of ``bounds`` (layouts x chunk cuts, chunk c holds decoder layers
        [row[c], row[c + 1])), in seconds."""
        bounds = np.asarray(bounds, dtype=np.intp)
        n = len(bounds)
        finish: list[np.ndarray] = []
        for pos, typ, c, prev, cross in self.nodes:
            lo, hi = bounds[:, c], bounds[:, c + 1]
            start = finish[prev] if prev >= 0 else np.zeros(n)
            for node, at, src in cross:
                start = np.maximum(start, finish[node] + self.hop[(src, pos)][bounds[:, at]])
            finish.append(start + self.dur[pos][typ][lo, hi])
        out = np.zeros(n)
        last = len(bounds[0]) - 2 if n else 0
        for pos, node in enumerate(self.last):
            cs = self.chunks[pos]
            w = sum(self.t.W[bounds[:, c], bounds[:, c + 1]] for c in cs)
            if self.tied and 0 in cs and last in cs:
                w = w - self.tied
            # after its last step a rank all-reduces its group's gradients (and the tied weight, where
            # it holds one end and not the other), then steps its optimizer
            sync = sum(self._syncs(self.groups[pos])[bounds[:, c], bounds[:, c + 1]] for c in cs)
            if (0 in cs) != (last in cs):
                sync = sync + self.tied_s
            out = np.maximum(out, finish[node] + sync + self.opt[pos] * w)
        # each link carries its sends one after another
        busy: dict[tuple[int, int], np.ndarray] = {}
        for pos, _, _, _, cross in self.nodes:
            for _, at, src in cross:
                busy[(src, pos)] = busy.get((src, pos), 0.0) + self.hop[(src, pos)][bounds[:, at]]
        for x in busy.values():
            out = np.maximum(out, x)
        return out

    def _syncs(self, g: tuple[int, ...]) -> np.ndarray:
        """Over cuts: the ring all-reduce of a chunk's gradients over group g (0 for one device)."""
        key = ("path syncs", g)
        got = self.t.memo.get(key)
        if got is None:
            L, t = self.t.L, self.t
            got = np.zeros((L + 1, L + 1))
            if len(g) > 1:
                names = [self.pb.hosts[h] for h in g]
                for c in range(L):
                    for c2 in range(c + 1, L + 1):
                        got[c, c2] = self.pb.links.ring_allreduce(names, float(t.W[c, c2]))
            self.t.memo[key] = got
        return got


def hop_times(pb: Problem, t: Tables, g: tuple[int, ...], g2: tuple[int, ...], b: int) -> np.ndarray:
    """Over the boundary layer x, the least seconds of one transfer from group g to g2 of the
    activations (or gradients) crossing it, on a rested link: all b samples between two single
    devices, one sample otherwise (the hops of :func:`.prune.pipeline_bound`, for every boundary at once)."""
    key = ("hop times", g, g2, b)
    got = t.memo.get(key)
    if got is None:
        n = b if len(g) == 1 and len(g2) == 1 else 1
        links, hosts, out = pb.links, pb.hosts, t.out_bytes
        got = t.memo[key] = np.array([min(links.rested_time(hosts[x], hosts[y], n * float(out[c]))
                                          for x in g for y in g2) for c in range(t.L + 1)])
    return got


def _step_matrices(pb: Problem, t: Tables, h: int, n: int) -> dict[str, np.ndarray]:
    """Seconds of a forward, backward, input-gradient and weight-gradient call on ``n`` samples of
    stage [c, c2) on host h (``StageTime.forward`` and the rest, over every cut at once)."""
    st = stage_time(pb.profiles, pb.hosts[h], t.span[0])
    F = st.fwd0 + st.call + n * st.fwd
    B = st.bwd0 + st.call + n * st.bwd
    I = st.split * st.bwd_in0 + st.split_call / 2 + st.call + n * st.split * st.bwd_in
    W = st.split * (st.bwd0 - st.bwd_in0) + st.split_call / 2 + st.call + n * st.split * (st.bwd - st.bwd_in)
    whole = np.broadcast_to(np.asarray(st.whole), F.shape)
    out = {"F": F, "B": B, "I": np.where(whole, st.call, I), "W": np.where(whole, B, W)}
    return {k: np.where(t.valid, np.broadcast_to(v, F.shape), INF) for k, v in out.items()}
