"""The one-chunk kinds searched exactly: every device-group sequence, contiguous split and
micro-batch size, by branch and bound over the stages in pipeline order.

The stage DP ranks splits by an estimate and prices the best few, so on a small cluster it can
miss the best split of a device order whose estimate ranked it low (on the homelab's measured
costs ZB-H1 with the laptop first, 4.3% faster than the plan the DP's candidates led to). Here a
stage is extended layer by layer; the first micro-batch's forward reaches it after the stages
before it (their passes and hops), and from then on it computes its ``m`` micro-batches and
all-reduces its gradients: when that reaches the best step found, no longer stage can help (both
only grow), so the extension stops; nor where the stages after it cannot share the rest of the
layers soon enough, or where no kind's order fits the stage's memory. A whole layout is priced
(built, its memory fitted, replayed) only where the stage bound (:func:`.prune.layout_bound`) and
its order's longest path (:mod:`.pathbound`) are below the best step, so the answer is the least
priced step of the whole one-chunk space, or a proof that none beats the step given.
"""
from __future__ import annotations

import functools
import itertools
import math
import time
from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np

from ..formats import Plan
from ..schedules import REGISTRY, ScheduleError, peak_states
from .build import build_plan
from .chunks import group_sequences
from .pricing import price_plan
from .pathbound import PathBound, hop_times
from .prune import group_bound, layout_bound, sync_bound
from .tables import Tables
from .types import INF, Problem, StageChoice, max_stages_of, micro_batch_sizes


@dataclass
class Exact:
    """What the enumeration found below the step it was given."""

    step_s: float
    """The least priced step below the step given (that step where none is below it)."""
    plan: Plan | None
    """Its plan (None where none beats the step given)."""
    complete: bool
    """Every layout was priced or proven no faster: ``step_s`` is the optimum of the one-chunk space
    (or no plan of it beats the step given)."""
    nodes: int
    priced: int
    work: int
    """Budget units spent (:data:`PRICE_WORK`)."""
    time_s: float


def one_chunk(pb: Problem, t: Tables, kinds: Sequence[str], step_s: float = INF, max_work: int | None = None
              ) -> Exact:
    """The least priced step of ``kinds`` (one-chunk kinds) over the whole space below ``step_s``.

    ``max_work``: stop after visiting that many partial layouts, each priced layout counted as
    :data:`PRICE_WORK` (``complete`` then False; a plan found is still a plan of the space, priced).
    The order is fixed, so the same budget gives the same answer in every process."""
    t0 = time.perf_counter()
    run = _Run(pb, t, step_s, max_work)
    families = [(s, ks) for s in (False, True) if (ks := [k for k in kinds if REGISTRY[k].split_backward == s])]
    try:
        for b in micro_batch_sizes(pb):
            for groups in sequences(len(pb.hosts), min(b, pb.max_group)):
                if len(groups) <= min(max_stages_of(pb), t.L):
                    run.sequence(groups, b, families)
    except _Budget:
        pass
    return Exact(step_s=run.best, plan=run.plan, complete=not run.stopped, nodes=run.nodes, priced=run.priced,
                 work=run.work, time_s=time.perf_counter() - t0)


@functools.lru_cache(maxsize=64)
def sequences(n_hosts: int, max_group: int) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """:func:`.chunks.group_sequences`, kept (every micro-batch size and family asks again)."""
    if max_group < n_hosts:
        return tuple(g for g in sequences(n_hosts, n_hosts) if max(len(x) for x in g) <= max_group)
    return tuple(group_sequences(n_hosts, n_hosts))


PATH_WORK = 30
"""An order's longest path over a sequence's layouts (:mod:`.pathbound`), about a millisecond."""
PRICE_WORK = 15
"""A priced layout (built, replayed until it reaches the best step) costs about as much as this many
partial layouts (a unit is 30-45 us of CPU on the development machine)."""


class _Budget(Exception):
    """The work budget is spent."""


class _Run:
    def __init__(self, pb: Problem, t: Tables, step_s: float, max_work: int | None):
        self.pb, self.t, self.best, self.plan = pb, t, step_s, None
        self.max_work, self.nodes, self.priced, self.work, self.stopped = max_work, 0, 0, 0, False
        self.memo: dict[tuple, float] = {}

    def sequence(self, groups: tuple[tuple[int, ...], ...], b: int, families: Sequence[tuple[bool, Sequence[str]]]
                 ) -> None:
        """Every split of the layers over ``groups`` (pipeline order) at micro-batch size ``b``, priced
        under each family's kinds (full backward or split: (split, kinds)) where its bound allows."""
        self._spend(1)
        self.groups, self.b, self.m, self.families = groups, b, self.pb.global_batch // b, families
        self.states: dict[str, list] = {}
        for _, ks in families:
            for k in ks:
                try:
                    self.states[k] = [peak_states(k, len(groups), s, self.m) for s in range(len(groups))]
                except ValueError:  # the kind's order does not run m micro-batches on this many stages
                    continue
        self.cuts: list[int] = [0]
        self.leaves: list[tuple[tuple[int, ...], tuple[str, ...]]] = []
        if self.states and self._rest(0)[0] < self.best:
            self._extend(0, 0.0, tuple(self.states))
        self._price_leaves()

    def _extend(self, c: int, head: float, kinds: tuple[str, ...]) -> None:
        """Stage ``len(cuts) - 1`` starts at layer ``c``; the first forward reaches it at ``head``;
        ``kinds``: those whose memory the stages before it fit. Every end of the stage is tested at
        once on the matrices (a group's samples shared as a fluid), the survivors one by one."""
        groups, L = self.groups, self.t.L
        s = len(self.cuts) - 1
        g = groups[s]
        last = s == len(groups) - 1
        work, first = self._matrices(g)
        ends = np.arange(L, L + 1) if last else np.arange(c + 1, L - (len(groups) - 1 - s) + 1)
        self._spend(1)
        done = head + work[c, ends]
        nxt = np.zeros(len(ends))
        after = nxt
        if not last:
            nxt = head + first[c, ends] + hop_times(self.pb, self.t, g, groups[s + 1], self.b)[ends]
            after = nxt + self._rest(s + 1)[ends]
        for i in np.flatnonzero((done < self.best) & (after < self.best)):
            if done[i] >= self.best or after[i] >= self.best:
                continue  # a plan found since beats it
            c2 = int(ends[i])
            self.nodes += 1
            self._spend(1)
            if len(g) > 1 and head + self._work(g, c, c2) >= self.best:
                continue  # its samples in whole shares, then its all-reduce
            fit = tuple(k for k in kinds if self._fits(g, c, c2, self.states[k][s]))
            if not fit:
                continue  # no kind's order fits its memory, recomputing what it may
            self.cuts.append(c2)
            if last:
                self._leaf(fit)
            else:
                self._extend(c2, float(nxt[i]), fit)
            self.cuts.pop()

    def _fits(self, g: tuple[int, ...], c: int, c2: int, states: tuple) -> bool:
        """Whether a stage's memory fits its order's states on group g with b samples, recomputing
        no layer or every layer (:func:`.recompute.choose_recompute`'s test, read off matrices)."""
        t, pb = self.t, self.pb
        if len(g) > self.b:
            return False
        static = float(t.static[c, c2])
        for v in ((0, 1) if pb.allow_recompute else (0,)):
            per = self._peak(states, v)[c, c2]
            caps = [math.floor(max(0.0, pb.budget[pb.hosts[h]] - static) / per + 1e-9) for h in g]
            if min(caps) >= 1 and sum(caps) >= self.b:
                return True
        return False

    def _peak(self, states: tuple, v: int) -> np.ndarray:
        """Peak bytes per sample of every cut over ``states``, no layer (0) or every layer (1) recomputed."""
        key = ("peak", states, v)
        got = self.memo.get(key)
        if got is None:
            t = self.t
            got = self.memo[key] = np.maximum(np.where(t.valid, t.mem.peak_per_sample(t.span[v], states), INF), 1e-30)
        return got

    def _spend(self, units: int) -> None:
        self.work += units
        if self.max_work is not None and self.work > self.max_work:
            self.stopped = True
            raise _Budget

    def _work(self, g: tuple[int, ...], c: int, c2: int) -> float:
        """A stage's least compute over its micro-batches, then its gradients' all-reduce (both grow
        with its layers)."""
        cut = [(c, c2)]
        return group_bound(self.t, g, cut, self.b, self.m) + sync_bound(self.t, g, cut)

    def _rest(self, s: int) -> np.ndarray:
        """Over the first layer c of stage s: the least, over every split of layers [c, L) over
        stages s.. of the current groups, of their latest compute end counted from the first
        forward's arrival at stage s (each stage's ``m`` micro-batches after the first forward has
        passed the stages before it; a group's samples shared as a fluid, its all-reduce left out:
        a weaker bound than a node's, computed for every c at once)."""
        groups = self.groups[s:]
        key = (groups, self.b)
        got = self.memo.get(key)
        if got is None:
            L = self.t.L
            work, first = self._matrices(groups[0])
            if len(groups) == 1:
                got = work[:, L].copy()
            else:
                after = hop_times(self.pb, self.t, groups[0], groups[1], self.b) + self._rest(s + 1)
                got = np.maximum(work, first + after[None, :]).min(axis=1)
            got[L] = INF
            self.memo[key] = got
            self._spend(1)
        return got

    def _matrices(self, g: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
        """Over cuts (c, c2): the least compute of ``m`` micro-batches on group g, and the first
        micro-batch's forward through it (as :func:`.prune.group_bound` and the first pass of :func:`.prune.pipeline_bound`,
        a group's samples shared as a fluid)."""
        key = ("mat", g, self.b)
        got = self.memo.get(key)
        if got is None:
            t, b, m = self.t, self.b, self.m
            if len(g) == 1:
                h = g[0]
                work = m * (b * t.tau[(h, 0)] + t.tau0[(h, 0)])
                first = b * t.pass_time[h][0] + t.pass_time[h][1]
            else:
                with np.errstate(divide="ignore"):
                    inv = sum(1.0 / t.tau[(h, 0)] for h in g)
                    work = m * (b / inv + np.minimum.reduce([t.tau0[(h, 0)] for h in g]))
                first = np.minimum.reduce([t.pass_time[h][0] + t.pass_time[h][1] for h in g])
            got = self.memo[key] = (np.where(t.valid, work, INF), np.where(t.valid, first, INF))
        return got

    def _leaf(self, fit: tuple[str, ...]) -> None:
        self.leaves.append((tuple(self.cuts), fit))

    def _price_leaves(self) -> None:
        """The sequence's layouts that reached the last stage, per kind: their order's longest path
        (:mod:`.pathbound`) for all at once, then priced from the lowest bound while it is below the
        best step."""
        t, groups, b = self.t, self.groups, self.b
        order = [d for g in groups for d in g]
        pos = list(itertools.accumulate([0] + [len(g) for g in groups]))
        below: dict[tuple[int, ...], list[bool]] = {}  # the stage bound (planner/prune.py) first, per split
        for split, ks in self.families:
            for kind in ks:
                rows = []
                for cuts, fit in self.leaves:
                    if kind not in fit:
                        continue
                    if (cuts, split) not in below:
                        stages = [((cuts[x], cuts[x + 1]), groups[x]) for x in range(len(groups))]
                        below[(cuts, split)] = layout_bound(t, stages, b, self.m, split) < self.best
                    if below[(cuts, split)]:
                        rows.append(cuts)
                if not rows:
                    continue
                self._spend(PATH_WORK)
                bound = PathBound(self.pb, t, kind, groups, 1, b).bound(np.array(rows))
                for i in np.argsort(bound, kind="stable"):
                    if bound[i] >= self.best:
                        break
                    choices = [StageChoice(cut=(rows[i][x], rows[i][x + 1]), hosts=(pos[x], pos[x + 1]),
                                           recompute_all=False, cost=0.0) for x in range(len(groups))]
                    self._price(kind, order, choices)

    def _price(self, kind: str, order: list[int], choices: list[StageChoice]) -> None:
        pk = replace(self.pb, schedule=kind)
        plan = build_plan(pk, self.t, order, choices, self.b, "optimal")
        if plan is None:
            return  # its memory does not fit this kind's order (checked stage by stage before)
        self.priced += 1
        self._spend(PRICE_WORK)
        try:
            step = price_plan(pk, plan, keep=False, above=self.best)
        except (ValueError, ScheduleError):  # the kind's order does not run this shape
            return
        if step < self.best:
            self.best, self.plan = step, plan
