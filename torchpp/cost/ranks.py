"""The one per-rank peak: what each rank of a plan is predicted to hold at its worst moment.

Every consumer that asks whether a plan fits (the planner's chunked search and its reports,
re-planning, the benchmarks) reads it here, so one rank's peak has one definition.
"""
from __future__ import annotations

from ..formats import Plan
from ..schedules import peak_states, rank_profiles
from .memory import MemoryEstimator
from .profiles import Profiles
from .stage import StageMemory


def device_memory(plan: Plan, profiles: Profiles, memory: MemoryEstimator) -> dict[int, float]:
    """Predicted peak bytes per rank (a rank holding several chunks: all of them, with the
    micro-batches each holds at the worst moment of the rank's order)."""
    out = {}
    mem = StageMemory(profiles, memory)
    for r in plan.ranks:
        chunks = plan.stages_of_rank(r)
        if len(chunks) == 1:
            s = chunks[0]
            states = peak_states(plan.schedule, plan.num_stages, s.index, plan.num_microbatches)
            out[r] = float(mem.peak_over(s, s.device(r).samples, states))
            continue
        shared = profiles.tied_bytes if chunks[0].has_embed and chunks[-1].has_tail else 0.0
        out[r] = mem.chunks_peak([(c, c.device(r).samples) for c in chunks], rank_profiles(plan, r), shared)
    return out
