"""Plan mode's inputs and pricing: a plan's action lists replayed against measured costs."""
from __future__ import annotations

import os
from typing import Callable, Mapping, Sequence

from ..cost import Links, MeasuredCost, Profiles, boundary_bytes, stage_weights, tied_sync_bytes
from ..formats import Bandwidth, Capacities, FormatError, LayersFile, Plan
from ..schedules import Action, Kind, build
from .compiled import Compiled
from .engine import simulate
from .replay import Timeline, replay
from .types import SimOptions


def price(plan: Plan, profiles: Profiles, links: Links | Bandwidth,
          optimizer_s_per_byte: Mapping[str, float] | float | None = None,
          schedule: dict[int, list[Action]] | Compiled | None = None) -> tuple[float, Timeline]:
    """Step time of ``plan``: replay its action lists (``schedules.build``, or ``schedule`` where the
    caller already built them, or flattened them: ``sim.compiled.Compiled``) against measured costs."""
    cost = MeasuredCost(plan, profiles, links, optimizer_s_per_byte)
    tl = replay(schedule if schedule is not None else build(plan), cost)
    return tl.makespan, tl


def price_step(plan: Plan, profiles: Profiles, links: Links | Bandwidth,
               optimizer_s_per_byte: Mapping[str, float] | float | None = None,
               schedule: Compiled | None = None) -> float:
    """:func:`price`'s step time alone, the same replay without recording its spans (a search
    prices many plans and keeps the timeline of the best only)."""
    cost = MeasuredCost(plan, profiles, links, optimizer_s_per_byte)
    return simulate(schedule if schedule is not None else build(plan), cost, SimOptions(comm="links"),
                    spans=False).makespan


def measured_cost(plan: Plan, layers: Sequence[str | os.PathLike], bandwidth: str | os.PathLike,
                  capacities: str | os.PathLike | None = None, speed: Mapping[str, float] | None = None
                  ) -> tuple[MeasuredCost, Callable[[int, Action], dict]]:
    """The CostModel for ``plan`` and a function giving each action's trace args (bytes, peer, recompute);
    with ``speed`` (speed checks' ratios per host) each checked host priced at the speed it has now."""
    files = [LayersFile.load(p) for p in layers]
    caps = Capacities.load(capacities) if capacities is not None else None
    prof = Profiles.from_layers(files, caps, sources=[str(p) for p in layers],
                                capacities_source=str(capacities or "capacities.json"))
    if speed:
        hosts = {d.host for s in plan.stages for d in s.devices}
        unknown = sorted(set(speed) - hosts)
        if unknown:
            raise FormatError("--speed-check", "host", f"a host of the plan ({', '.join(sorted(hosts))})",
                              ", ".join(unknown))
        prof.ensure(sorted(hosts))  # every host priced before any is scaled (none inherits another's ratio)
        prof.at_speed(speed)
    cost = MeasuredCost(plan, prof, Links(Bandwidth.load(bandwidth), str(bandwidth)))

    def bytes_of(rank: int, a: Action) -> float:
        n = a.samples[1] - a.samples[0] if a.samples is not None else plan.device_of_rank(rank).samples
        if a.kind == Kind.SEND_ACT or a.kind == Kind.RECV_ACT:
            return float(boundary_bytes(prof, plan.stages[a.stage])) * n
        if a.kind == Kind.SEND_GRAD or a.kind == Kind.RECV_GRAD:
            return float(boundary_bytes(prof, plan.stages[a.stage - 1])) * n
        if a.kind == Kind.ALLREDUCE:
            return tied_sync_bytes(prof, plan) if a.tied else float(stage_weights(prof, plan.stages[a.stage]))
        return 0.0

    return cost, bytes_of
