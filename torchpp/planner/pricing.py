"""Every price the search takes of a plan: one replay of its action lists, the best kept with its
timeline (``Problem.ledger``) so the chosen plan is never replayed again.

Plans that differ only in their layer cuts have the same action lists (``schedules.build`` reads
the kind, the micro-batch count, each chunk's devices with their ranks and samples, and whether
the embedding is tied; never the layers), so the lists are built and flattened (``sim.compiled.Compiled``) once per :func:`schedule_key`.
"""
from __future__ import annotations

from ..formats import Plan
from ..schedules import build
from ..sim.compiled import Compiled
from ..sim.measured import price, price_step
from .types import Problem


def schedule_key(plan: Plan) -> tuple:
    """Everything of ``plan`` its action lists depend on."""
    return (plan.schedule, plan.num_microbatches, plan.model.tied_embeddings,
            tuple((s.has_embed, s.has_tail, tuple((d.rank, d.samples) for d in s.devices)) for s in plan.stages))


def price_plan(pb: Problem, plan: Plan) -> float:
    """``plan``'s replayed step time on ``pb``'s costs; the lowest so far is kept with its replay
    (replayed again with its spans recorded only when it is the lowest so far)."""
    key = schedule_key(plan)
    built = pb.ledger.schedules
    if key not in built:
        built[key] = Compiled(build(plan))
    step = price_step(plan, pb.profiles, pb.links, pb.optimizer_s_per_byte, schedule=built[key])
    if pb.ledger.wants(step, plan):
        again, tl = price(plan, pb.profiles, pb.links, pb.optimizer_s_per_byte, schedule=built[key])
        pb.ledger.offer(again, plan, tl)
    return step
