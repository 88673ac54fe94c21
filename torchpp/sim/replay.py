"""Price a schedule: replay each rank's action list against a cost model.

Each rank runs its list in order on one compute thread. A send starts when the sender reaches
it and does not block the sender (the runtime posts it asynchronously); it occupies the
directed link (src, dst) for its transfer time. A receive waits for its message. An
all-reduce starts when its last member arrives. This is the contention-free pricing the
planner ranks plans with; the event-driven simulator adds shared channels, priorities,
interference and congestion on top of the same action lists.
"""
from __future__ import annotations

from ..schedules import Schedule
from .engine import simulate
from .types import CostModel, SimOptions, Span, Timeline

__all__ = ["CostModel", "Span", "Timeline", "replay"]


def replay(sched: Schedule, cost: CostModel) -> Timeline:
    """Contention-free timeline of ``sched``: the event engine's ``links`` model.

    Same result, span for span, as the plain loop over the lists in ``tests/replay_reference.py``
    (``tests/test_sim_engine.py`` holds them equal); the engine is the one the simulator extends
    with shared channels.
    """
    return simulate(sched, cost, SimOptions(comm="links")).timeline
