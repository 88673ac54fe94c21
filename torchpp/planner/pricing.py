"""Every price the search takes of a plan: one replay of its action lists, the best kept
(``Problem.ledger``) with the replay of its spans, done once for the plan the search returns.

Plans that differ only in their layer cuts have the same action lists (``schedules.build`` reads
the kind, the micro-batch count, each chunk's devices with their ranks and samples, and whether
the embedding is tied; never the layers), so the lists are built and flattened (``sim.compiled.Compiled``) once per :func:`schedule_key`.

A schedule's thousand actions ask the cost model for a few dozen distinct prices (each rank's
forward, backward, optimizer, each link's transfer, each group's all-reduce, at every micro-batch),
so the replay's durations are priced once per distinct action (:class:`Distinct`) and spread over
the schedule: the same numbers as asking for each action (``sim.compiled.durations_generic``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..cost import MeasuredCost
from ..formats import Plan
from ..schedules import build
from ..sim.compiled import AR, OPT, SA, SG, Compiled, durations_generic
from ..sim.engine import simulate
from ..sim.measured import price
from ..sim.types import SimOptions
from .types import INF, Problem


def schedule_key(plan: Plan) -> tuple:
    """Everything of ``plan`` its action lists depend on."""
    return (plan.schedule, plan.num_microbatches, plan.model.tied_embeddings,
            tuple((s.has_embed, s.has_tail, tuple((d.rank, d.samples) for d in s.devices)) for s in plan.stages))


@dataclass(frozen=True)
class Distinct:
    """A compiled schedule's actions grouped by what their price depends on: ``first[i]`` is the
    first action of group i (in index order), ``group[a]`` the group of action ``a`` (-1: no price
    of its own, a receive or an all-reduce's other members, 0 s)."""

    compiled: Compiled
    first: list[int]
    group: list[int]

    @staticmethod
    def of(c: Compiled) -> "Distinct":
        keys: dict[tuple, int] = {}
        first: list[int] = []
        group = [-1] * len(c.acts)
        for a, k in enumerate(c.code):
            act = c.acts[a]
            if k <= OPT:  # MeasuredCost.compute_s's own key
                key: tuple = (k, c.owner[a], act.stage, act.samples)
            elif k == SA or k == SG:  # transfer_s reads the two ranks, the kind, the stage and the samples
                key = (k, c.owner[a], c.peer[a], act.stage, act.samples)
            elif k == AR and c.coll_members[c.coll[a]][0] == a:  # allreduce_s: the group, tied or not, the stage
                key = (k, act.group, act.tied, act.stage)
            else:
                continue
            if key not in keys:
                keys[key] = len(first)
                first.append(a)
            group[a] = keys[key]
        return Distinct(c, first, group)


class DistinctCost:
    """``cost`` whose :meth:`durations` prices each distinct action of the schedule once (the
    simulator's hook for pricing a whole schedule, ``sim.compiled.durations``)."""

    def __init__(self, cost: MeasuredCost, distinct: Distinct):
        self.cost, self.distinct = cost, distinct
        self.compute_s, self.transfer_s, self.allreduce_s = cost.compute_s, cost.transfer_s, cost.allreduce_s
        self.burst_s, self.nic_s = cost.burst_s, getattr(cost, "nic_s", None)

    def durations(self, c: Compiled) -> list[float]:
        d = self.distinct
        if c is not d.compiled:
            return durations_generic(c, self.cost)
        # price the first action of each group as durations_generic prices it (and raises where it would:
        # the first action whose price is invalid is the first of its group)
        sub = _Firsts(c, d.first)
        values = durations_generic(sub, self.cost)
        return [values[g] if g >= 0 else 0.0 for g in d.group]


class _Firsts:
    """The fields of ``c`` that ``durations_generic`` reads, restricted to the actions ``first``
    (an all-reduce among them is its collective's first member)."""

    def __init__(self, c: Compiled, first: list[int]):
        self.ranks, self.coll_members = c.ranks, [[i] for i in range(len(first))]
        self.acts = [c.acts[a] for a in first]
        self.code = [c.code[a] for a in first]
        self.owner = [c.owner[a] for a in first]
        self.peer = [c.peer[a] for a in first]
        self.coll = list(range(len(first)))


def price_plan(pb: Problem, plan: Plan, keep: bool = True, above: float = INF) -> float:
    """``plan``'s replayed step time on ``pb``'s costs; the lowest so far is kept with its replay
    (replayed again with its spans recorded only when it is the lowest so far; never with ``keep``
    False: a plan not yet known to fit).

    ``above``: a step the caller rejects at or above. Where hosts share interfaces (priced on the
    simulator's event core, the dearer replay) the plan is first replayed on independent links,
    list by list: that step is a lower bound (an interface only delays a transfer), and where it
    is already at or above ``above`` it is returned as it is."""
    key = schedule_key(plan)
    built = pb.ledger.schedules
    if key not in built:  # validated once, for the plan the search returns (planner.search)
        c = Compiled(build(plan, validated=False))
        built[key] = (c, Distinct.of(c))
    c, distinct = built[key]
    cost: Any = DistinctCost(MeasuredCost(plan, pb.profiles, pb.links, pb.optimizer_s_per_byte,
                                          stage_times=pb.ledger.stage_times), distinct)
    if above < INF and cost.nic_s is not None:
        nic_s, cost.nic_s = cost.nic_s, None
        floor = simulate(c, cost, SimOptions(comm="links"), spans=False).makespan
        cost.nic_s = nic_s
        if floor >= above:
            return floor
    step = simulate(c, cost, SimOptions(comm="links"), spans=False).makespan
    if keep:
        keep_priced(pb, plan, step)
    return step


def keep_priced(pb: Problem, plan: Plan, step: float) -> None:
    """Keep ``plan``, replayed by :func:`price_plan` at ``step``, where it is the lowest so far (its
    spans are replayed only if it stays the best: ``Ledger.timeline``)."""
    if pb.ledger.wants(step, plan):
        c, _ = pb.ledger.schedules[schedule_key(plan)]
        pb.ledger.offer(step, plan, lambda: price(plan, pb.profiles, pb.links, pb.optimizer_s_per_byte, schedule=c)[1])
