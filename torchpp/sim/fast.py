"""The fast path: one pipeline replica stands for all ``dp`` replicas of a uniform pp × dp plan.

In a plan whose stages all have ``dp`` devices with equal shares, every replica runs the same
actions; on a network that treats them alike they run in lockstep. So the core simulates one
replica (``pp`` ranks): each of its sends is the bundle of all ``dp`` copies of that send
(their usage summed, :func:`torchpp.topology.collectives.merged`) so that the copies still
share the links they share, and before its optimizer each replica rank runs its stage's
all-reduce over the whole group (and the tied all-reduce over both end stages). The cost
grows with ``pp × microbatches``, not with the device count. ``tests/test_topology_fast.py``
checks it equals the full event simulation on ≤ 64 devices.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from ..formats import Plan, PlanDevice, PlanStage
from ..schedules import Action, Kind, Schedule, build
from ..topology.collectives import Bundle, merged
from ..topology.routes import Network
from .compiled import AR, SA, SG, Compiled
from .topology import BytesOf, Placement, action_bundle, simulate_topology
from .types import CostModel, SimResult


def replicas(plan: Plan) -> int:
    """``dp`` when every stage has ``dp`` devices with equal samples, else 0 (not uniform)."""
    dp = len(plan.stages[0].devices)
    for s in plan.stages:
        if len(s.devices) != dp or len({d.samples for d in s.devices}) != 1:
            return 0
    return dp


def replica_plan(plan: Plan) -> Plan:
    """One replica: every stage on its first device (rank = stage index), the same micro-batching."""
    stages = []
    for s in plan.stages:
        d = s.devices[0]
        stages.append(dataclasses.replace(s, devices=[PlanDevice(host=d.host, rank=s.index, share=1.0,
                                                                 samples=d.samples)]))
    n = plan.stages[0].devices[0].samples
    return dataclasses.replace(plan, stages=stages, micro_batch_size=n, global_batch=n * plan.num_microbatches,
                               predicted=None)


def replica_schedule(rep: Plan, dp: int) -> Schedule:
    """The replica's lists with its stage's group all-reduce before its trailing sync actions."""
    sched = build(rep)
    if dp == 1:
        return sched
    for r, acts in sched.items():
        i = len(acts)
        while i > 0 and acts[i - 1].kind in (Kind.ALLREDUCE, Kind.OPTIMIZER):
            i -= 1
        acts.insert(i, Action(Kind.ALLREDUCE, r, group=(r,)))
    return sched


def replica_bundles(plan: Plan, net: Network, place: Placement, bytes_of: BytesOf,
                    algorithm: str = "ring") -> Callable[[Compiled], list[Bundle | None]]:
    """Bundles of the replica's actions standing for every replica's copy (``bytes_of`` on the replica)."""
    stages = plan.stages
    tied = tuple(sorted(set(stages[0].ranks) | set(stages[-1].ranks)))

    links: dict[tuple[int, int], Bundle] = {}
    """(stage, peer stage) -> the copies' usage, priced once per unit of bytes."""

    def of(c: Compiled) -> list[Bundle | None]:
        out: list[Bundle | None] = [None] * len(c.acts)
        for a, k in enumerate(c.code):
            if not (k == SA or k == SG or (k == AR and c.coll_members[c.coll[a]][0] == a)):
                continue
            r, act = c.ranks[c.owner[a]], c.acts[a]
            nbytes = bytes_of(r, act)
            if k == AR:
                group = tied if act.tied else tuple(sorted(stages[act.stage].ranks))
                out[a] = action_bundle(net, place, group[0], dataclasses.replace(act, group=group), nbytes, algorithm)
            else:
                unit = links.get((r, act.peer))
                if unit is None:
                    src, dst = stages[r].devices, stages[act.peer].devices
                    unit = links[(r, act.peer)] = merged(
                        [action_bundle(net, place, d.rank, dataclasses.replace(act, peer=e.rank), 1.0)
                         for d, e in zip(src, dst)])
                out[a] = Bundle(unit.volume * nbytes, unit.usage, unit.latency_s)
        return out

    return of


def simulate_fast(plan: Plan, cost_of: Callable[[Plan], CostModel], net: Network, place: Placement,
                  bytes_of: Callable[[Plan], BytesOf], algorithm: str = "ring", *, spans: bool = True) -> SimResult:
    """Price a uniform pp × dp plan through one replica (``cost_of``/``bytes_of`` are asked for the replica)."""
    dp = replicas(plan)
    if dp == 0:
        raise ValueError("the fast path needs every stage on the same number of devices with equal samples")
    rep = replica_plan(plan)
    return simulate_topology(replica_schedule(rep, dp), cost_of(rep),
                             replica_bundles(plan, net, place, bytes_of(rep), algorithm), net, spans=spans)
