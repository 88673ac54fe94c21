"""The planner's one entry: the plan with the lowest priced step time over the schedule kinds a
problem names. One one-chunk kind of the stage DP alone (:mod:`.single`); several kinds, chunked
placements or ``auto``: :mod:`.kinds`.

Modules of planner/ from the bottom up: ``types`` (the shared records), ``allocate``, ``tables``
(the stage-cost matrices), ``recompute``, ``build`` (layout -> plan), ``pricing`` (the one replay
of a candidate, the best kept with its timeline), ``prune`` (bounds that skip layouts which cannot
win before they are built), ``orderbound`` and ``pathbound`` (what a kind's order forces: on one
rank, and along a layout's longest path), ``dp`` and ``fastdp`` (the stage DPs), ``refine`` (local
search), ``single`` (one one-chunk kind), ``chunks`` (multi-chunk kinds), ``exact`` and
``exactchunks`` (every layout of small clusters, by branch and bound), ``kinds`` (every kind), this
dispatcher; ``certify`` (how far a plan can be from the best), ``report`` and ``api`` on top.

The search returns the winner's replay (``SearchResult.timeline``): the prediction and the gap to
the bound reuse it, so a chosen plan is replayed on its own costs once per `plan` call.
"""
from __future__ import annotations

from .kinds import search_kinds
from .single import search_single
from ..formats import ONE_CHUNK
from ..schedules import REGISTRY, ScheduleError, build, schedule_kinds
from .types import Problem, SearchResult, Ledger

def search(pb: Problem, progress=None) -> SearchResult:
    """Find the plan with the lowest priced step time over the schedule kinds ``pb.schedule`` names
    (see the module docstring; several kinds or ``auto``: :mod:`torchpp.planner.kinds`)."""
    kinds = schedule_kinds(pb.schedule)
    pb.ledger = Ledger(kinds=frozenset(kinds))
    if len(kinds) == 1 and REGISTRY[kinds[0]].spec.every_m and kinds[0] in ONE_CHUNK:
        res = search_single(pb, progress)
        res.kinds = {kinds[0]: res.step_time_s}
    else:
        res = search_kinds(pb, kinds, progress)
    won = pb.ledger
    if won.plan is not None and won.step_time_s <= res.step_time_s:
        res.plan, res.step_time_s, res.timeline = won.plan, won.step_time_s, won.timeline
    if res.plan is not None:
        validated(res.plan)
    return res


def validated(plan):
    """The returned plan's lists pass ``schedules.validate`` (the search prices unvalidated lists:
    a kind's order is proven by its tests, and each list is still checked for matching messages and
    deadlock as it is flattened and priced); a failure here is a bug in that kind's order."""
    try:
        build(plan)
    except ScheduleError as e:
        raise RuntimeError(f"the planner chose a {plan.schedule} plan whose action lists do not validate (a bug in "
                           f"the kind's order): {e}") from e
    return plan
