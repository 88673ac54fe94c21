"""The one-chunk kinds searched exactly: every device-group sequence, contiguous split and
micro-batch size, by branch and bound over the stages in pipeline order.

The stage DP ranks splits by an estimate and prices the best few, so on a small cluster it can
miss the best split of a device order whose estimate ranked it low (on the homelab's measured
costs ZB-H1 with the laptop first, 4.3% faster than the plan the DP's candidates led to). Here a
stage is extended layer by layer; the first micro-batch's forward reaches it after the stages
before it (their passes and hops), and from then on it computes its ``m`` micro-batches: when
that alone reaches the best step found, no longer stage can help (its compute only grows), so
the extension stops. A whole layout is priced (built, its memory fitted, replayed) only where its
full bound (:func:`.prune.layout_bound`) is below the best step, so the answer is the least
priced step of the whole one-chunk space, or a proof that none beats the step given.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, replace
from typing import Sequence

from ..formats import Plan
from ..schedules import REGISTRY, ScheduleError
from .build import build_plan
from .chunks import group_sequences
from .pricing import price_plan
from .prune import first_forward, forward_hop, group_bound, layout_bound, sync_bound
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
            for groups in group_sequences(len(pb.hosts), min(b, pb.max_group)):
                if len(groups) <= min(max_stages_of(pb), t.L):
                    run.sequence(groups, b, families)
    except _Budget:
        pass
    return Exact(step_s=run.best, plan=run.plan, complete=not run.stopped, nodes=run.nodes, priced=run.priced,
                 time_s=time.perf_counter() - t0)


PRICE_WORK = 50
"""A priced layout (built, memory fitted, replayed) costs about as much as this many partial layouts."""


class _Budget(Exception):
    """The node budget is spent."""


class _Run:
    def __init__(self, pb: Problem, t: Tables, step_s: float, max_work: int | None):
        self.pb, self.t, self.best, self.plan = pb, t, step_s, None
        self.max_work, self.nodes, self.priced, self.stopped = max_work, 0, 0, False
        self.rest: dict[tuple, float] = {}

    def sequence(self, groups: tuple[tuple[int, ...], ...], b: int, families: Sequence[tuple[bool, Sequence[str]]]
                 ) -> None:
        """Every split of the layers over ``groups`` (pipeline order) at micro-batch size ``b``, priced
        under each family's kinds (full backward or split: (split, kinds)) where its bound allows."""
        self.groups, self.b, self.m, self.families = groups, b, self.pb.global_batch // b, families
        self.cuts: list[int] = [0]
        if self._rest(0, 0) < self.best:
            self._extend(0, 0.0)

    def _extend(self, c: int, head: float) -> None:
        """Stage ``len(cuts) - 1`` starts at layer ``c``; the first forward reaches it at ``head``."""
        t, groups, b = self.t, self.groups, self.b
        s = len(self.cuts) - 1
        g = groups[s]
        last = s == len(groups) - 1
        for c2 in ([t.L] if last else range(c + 1, t.L - (len(groups) - 1 - s) + 1)):
            self.nodes += 1
            if self.max_work is not None and self.nodes + PRICE_WORK * self.priced > self.max_work:
                self.stopped = True
                raise _Budget
            if head + self._work(g, c, c2) >= self.best:
                break  # every longer stage works longer still
            if last:
                self.cuts.append(c2)
                self._leaf()
                self.cuts.pop()
                continue
            nxt = head + first_forward(t, (c, c2), g, b) + forward_hop(t, c2, g, groups[s + 1], b)
            if nxt + self._rest(s + 1, c2) >= self.best:
                continue  # the stages after it cannot share the rest soon enough
            self.cuts.append(c2)
            self._extend(c2, nxt)
            self.cuts.pop()

    def _work(self, g: tuple[int, ...], c: int, c2: int) -> float:
        """A stage's least compute over its micro-batches, then its gradients' all-reduce (both grow
        with its layers)."""
        cut = [(c, c2)]
        return group_bound(self.t, g, cut, self.b, self.m) + sync_bound(self.t, g, cut)

    def _rest(self, s: int, c: int) -> float:
        """The least, over every split of layers [c, L) over stages s.. of the current groups, of
        their latest compute end counted from the first forward's arrival at stage s (each stage's
        ``m`` micro-batches after the first forward has passed the stages before it)."""
        groups, b = self.groups[s:], self.b
        key = (groups, b, c)
        got = self.rest.get(key)
        if got is None:
            L = self.t.L
            if len(groups) == 1:
                got = self._work(groups[0], c, L) if c < L else INF
            else:
                got = INF
                for c2 in range(c + 1, L - len(groups) + 2):
                    here = self._work(groups[0], c, c2)
                    if here >= got:
                        break
                    fill = first_forward(self.t, (c, c2), groups[0], b) + forward_hop(self.t, c2, groups[0], groups[1], b)
                    got = min(got, max(here, fill + self._rest(s + 1, c2)))
            self.rest[key] = got
        return got

    def _leaf(self) -> None:
        t, groups, cuts = self.t, self.groups, self.cuts
        stages = [((cuts[s], cuts[s + 1]), groups[s]) for s in range(len(groups))]
        kinds = [k for split, ks in self.families if layout_bound(t, stages, self.b, self.m, split) < self.best
                 for k in ks]
        if not kinds:
            return
        order = [d for g in groups for d in g]
        pos = list(itertools.accumulate([0] + [len(g) for g in groups]))
        choices = [StageChoice(cut=stages[s][0], hosts=(pos[s], pos[s + 1]), recompute_all=False, cost=0.0)
                   for s in range(len(groups))]
        for kind in kinds:
            pk = replace(self.pb, schedule=kind)
            plan = build_plan(pk, t, order, choices, self.b, "optimal")
            if plan is None:
                continue  # its memory does not fit this kind's order
            self.priced += 1
            try:
                step = price_plan(pk, plan, keep=False, above=self.best)
            except (ValueError, ScheduleError):  # the kind's order does not run this shape
                continue
            if step < self.best:
                self.best, self.plan = step, plan
