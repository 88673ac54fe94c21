"""The chunked kinds (interleaved, V) searched exactly on small clusters: every device-group
sequence, chunk count, cut and micro-batch size.

A chunked layout cuts the layers into ``v`` chunks per position, placed by its kind (a V's
position holds a chunk on the way down and one on the way back). The cuts are grown chunk by
chunk for all prefixes at once (arrays of prefixes): each position's compute so far, ``m``
forwards and backwards of each of its chunks, only grows, so a prefix whose busiest position
already reaches the best step found is dropped with everything after it; so is one whose weights
no longer fit a device of a position, or whose layers still to place cannot be shared out soon
enough. What is left whole is bounded by its order's longest path (:mod:`.pathbound`) and priced
best first over every shape while the lowest bound left is below the best step. The answer is the
least priced step of the chunked space, or a proof that none beats the step given.
"""
from __future__ import annotations

import time
from typing import Sequence

import numpy as np

from ..cost import stage_time
from ..schedules import REGISTRY
from .chunks import ChunkLayout, beaten, chunk_counts, fits_weights, price_layout
from .exact import PATH_WORK, Exact, _Budget, sequences
from .pathbound import PathBound
from .tables import Tables
from .types import INF, Problem, micro_batch_sizes

ROWS_PER_UNIT = 64
"""Prefixes grown (numpy, a few operations each) per unit of the budget shared with :mod:`.exact`."""


def chunked(pb: Problem, t: Tables, kinds: Sequence[str], step_s: float = INF, max_work: int | None = None
            ) -> Exact:
    """The least priced step of the chunked ``kinds`` over the whole space below ``step_s``.

    Every shape's surviving layouts are bounded first; then they are priced best first, over all
    shapes at once, while the lowest bound left is below the best step: the first priced are those
    most likely to win, so few are priced. ``max_work`` (as :func:`.exact.one_chunk`'s) holds for
    each of the two passes; a plan found is a plan of the space, priced, complete or not."""
    t0 = time.perf_counter()
    run = _Chunks(pb, t, step_s, max_work)
    try:
        for b in micro_batch_sizes(pb):
            for groups in sequences(len(pb.hosts), min(b, pb.max_group)):
                for kind in kinds:
                    for v in chunk_counts(kind, len(groups), t.L):
                        run.shape(kind, groups, v, b)
    except _Budget:
        pass
    run.price()
    return Exact(step_s=run.best, plan=run.plan, complete=not run.stopped, nodes=run.rows, priced=run.priced,
                 work=run.work, time_s=time.perf_counter() - t0)


PRICE_CHUNKED = 100
"""A chunked layout priced (built with its memory, replayed) in units of the budget: a few milliseconds."""


class _Chunks:
    def __init__(self, pb: Problem, t: Tables, step_s: float, max_work: int | None):
        self.pb, self.t, self.best, self.plan = pb, t, step_s, None
        self.max_work, self.rows, self.priced, self.work, self.stopped = max_work, 0, 0, 0, False
        self.found: list[tuple[np.ndarray, np.ndarray, tuple]] = []
        """Per shape: its layouts' bounds, their cuts, and the shape (kind, groups, v, b)."""

    def _spend(self, units: int) -> None:
        self.work += units
        if self.max_work is not None and self.work > self.max_work:
            self.stopped = True
            raise _Budget

    def shape(self, kind: str, groups: tuple[tuple[int, ...], ...], v: int, b: int) -> None:
        """Every cut of ``kind`` with ``v`` chunks per position on ``groups`` at ``b`` samples, bounded."""
        self._spend(1)
        try:
            bound = PathBound(self.pb, self.t, kind, groups, v, b)
        except ValueError:  # the order does not run this many micro-batches at this depth
            return
        rows = self._grow(bound, kind)
        if not len(rows):
            return
        self._spend(PATH_WORK + len(rows) // ROWS_PER_UNIT)
        paths = bound.bound(rows)
        keep = paths < self.best
        if keep.any():
            self.found.append((paths[keep], rows[keep], (kind, groups, v, b)))

    def price(self) -> None:
        """The bounded layouts priced from the lowest bound over every shape, while it is below the
        best step (a budget of its own)."""
        if not self.found:
            return
        paths = np.concatenate([p for p, _, _ in self.found])
        which = np.concatenate([np.full(len(p), k) for k, (p, _, _) in enumerate(self.found)])
        index = np.concatenate([np.arange(len(p)) for p, _, _ in self.found])
        spent, self.work = self.work, 0
        try:
            for i in np.argsort(paths, kind="stable"):
                if paths[i] >= self.best:
                    break
                _, rows, (kind, groups, v, b) = self.found[which[i]]
                lay = ChunkLayout(kind=kind, v=v, b=b, groups=groups, bounds=tuple(int(x) for x in rows[index[i]]))
                if not fits_weights(self.pb, self.t, lay) or beaten(self.t, lay, self.pb.global_batch // b, self.best):
                    continue
                self.priced += 1
                self._spend(PRICE_CHUNKED)
                got = price_layout(self.pb, self.t, lay, above=self.best)
                if got is not None and got[1] is not None and got[0] < self.best:
                    self.best, self.plan = got[0], got[1]
        except _Budget:
            pass
        self.work += spent

    def _parts(self, h: int, split: bool) -> tuple[np.ndarray, np.ndarray]:
        """Over cuts (c, c2): the seconds per call and per sample of one forward and one backward
        (``I + W`` where split) of the chunk on host h, nothing recomputed (as ``StageTime``'s calls)."""
        key = ("chunk parts", h, split)
        got = self.t.memo.get(key)
        if got is None:
            t = self.t
            st = stage_time(self.pb.profiles, self.pb.hosts[h], t.span[0])
            whole = np.broadcast_to(np.asarray(st.whole), t.valid.shape)
            if split:
                call = np.where(whole, st.bwd0 + 2 * st.call, st.split * st.bwd0 + st.split_call + 2 * st.call)
                sample = np.where(whole, st.bwd, st.split * st.bwd)
            else:
                call, sample = st.bwd0 + st.call, st.bwd
            got = self.t.memo[key] = (np.where(t.valid, st.fwd0 + st.call + call, INF),
                                      np.where(t.valid, st.fwd + sample, INF))
        return got

    def _loads(self, g: tuple[int, ...], b: int, split: bool) -> tuple[np.ndarray, np.ndarray]:
        """(over cuts: the least compute of m micro-batches of a chunk on group g; per layer: the
        least per-sample part of it, which adds up over a chunk's layers). A group shares the b
        samples as a fluid over its devices (no whole shares can do better, and the fluid time of a
        sum of layers is at least the sum of theirs)."""
        key = ("chunk loads", g, b, split)
        got = self.t.memo.get(key)
        if got is None:
            m, L = self.pb.global_batch // b, self.t.L
            parts = [self._parts(h, split) for h in g]
            x = np.arange(L)
            with np.errstate(divide="ignore"):
                chunk = m * (np.minimum.reduce([c for c, _ in parts]) + b / sum(1.0 / ps for _, ps in parts))
                layer = m * b / sum(1.0 / ps[x, x + 1] for _, ps in parts)
            got = self.t.memo[key] = (np.where(self.t.valid, chunk, INF), layer)
        return got

    def _room(self, bound: PathBound) -> np.ndarray:
        """Per position, the parameter bytes of its chunks its devices have room for
        (:func:`.chunks.weights_fit`: the base and ``alpha`` times them, the tied weight once)."""
        pb, mem = self.pb, self.pb.memory
        last = len(bound.position) - 1
        out = []
        for pos, g in enumerate(bound.groups):
            spare = min(pb.budget[pb.hosts[h]] for h in g) - mem.base
            room = spare / mem.alpha if mem.alpha > 0 else (INF if spare >= 0 else -INF)
            if 0 in bound.chunks[pos] and last in bound.chunks[pos]:
                room += float(pb.profiles.tied_bytes)
            out.append(room)
        return np.array(out)

    def _grow(self, bound: PathBound, kind: str) -> np.ndarray:
        """Every whole cut (rows of chunk boundaries) whose busiest position's compute is below the
        best step and whose weights fit, grown chunk by chunk (module docstring)."""
        L, p = self.t.L, len(bound.groups)
        where = bound.position
        S = len(where)
        split = REGISTRY[kind].split_backward
        loads_of = [self._loads(g, bound.b, split) for g in bound.groups]
        load = [x for x, _ in loads_of]
        # the layers still to place add at least their per-sample work to the positions they go to:
        # with w[x] the least work of layer x anywhere and s[pos] the most w a second of pos holds,
        # the busiest position ends no sooner than (w of the rest + sum of s * loads) / sum of s
        per = np.stack([y for _, y in loads_of])
        w = per.min(axis=0)
        with np.errstate(divide="ignore", invalid="ignore"):
            s = np.nan_to_num((w[None, :] / per).max(axis=1), nan=0.0, posinf=0.0)
        rest = np.concatenate([np.cumsum(w[::-1])[::-1], [0.0]])
        room = self._room(bound)
        rows = np.zeros((1, 1), dtype=np.intp)
        loads = np.zeros((1, p))
        held = np.zeros((1, p))
        ends = np.arange(L + 1)
        for c in range(S):
            lo = rows[:, -1]
            if c == S - 1:
                ri, e = np.arange(len(rows)), np.full(len(rows), L)
            else:
                ri, e = np.nonzero((ends[None, :] > lo[:, None]) & (ends[None, :] <= L - (S - 1 - c)))
            self.rows += len(ri)
            self._spend(len(ri) // ROWS_PER_UNIT + 1)
            at = where[c]
            grown = loads[ri]
            grown[:, at] += load[at][lo[ri], e]
            weights = held[ri]
            weights[:, at] += self.t.W[lo[ri], e]
            keep = (grown.max(axis=1) < self.best) & (weights[:, at] <= room[at])
            if s.sum() > 0:
                keep &= (rest[e] + grown @ s) / s.sum() < self.best
            rows = np.concatenate([rows[ri][keep], e[keep][:, None]], axis=1)
            loads, held = grown[keep], weights[keep]
            if not len(rows):
                break
        return rows
