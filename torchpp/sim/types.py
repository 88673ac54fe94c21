"""The simulator's vocabulary: the cost model it prices with, its options and what it returns.

These live apart from the engine and from :mod:`.replay` so that both import them and neither
imports the other.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from ..schedules import Action, Kind
from .model import Priorities, SimError


class CostModel(Protocol):
    def compute_s(self, rank: int, action: Action) -> float:
        """Seconds of FORWARD, BACKWARD or OPTIMIZER on this rank."""

    def transfer_s(self, src: int, dst: int, action: Action) -> float:
        """Seconds a SEND_ACT / SEND_GRAD from src to dst occupies the link."""

    def allreduce_s(self, action: Action) -> float:
        """Seconds of an ALLREDUCE over action.group.

        A cost model may also have ``burst_s(src, dst, action) -> (bucket_s, take_s)``: the send's
        link passes ``bucket_s`` seconds' worth at once after a rest, ``take_s`` of this send
        (``compiled.bursts``; the ``links`` comm model applies it, the others do not)."""


@dataclass(slots=True)
class Span:
    rank: int
    action: Action
    start: float
    end: float
    ready: float = 0.0
    """For a receive: when its message arrived (start..ready is waiting)."""


@dataclass
class Timeline:
    spans: dict[int, list[Span]] = field(default_factory=dict)

    @property
    def makespan(self) -> float:
        return max((s.end for ss in self.spans.values() for s in ss), default=0.0)

    def busy(self, rank: int, kinds: tuple[Kind, ...] = (Kind.FORWARD, Kind.BACKWARD)) -> float:
        return sum(s.end - s.start for s in self.spans[rank] if s.action.kind in kinds)


@dataclass(kw_only=True)
class SimOptions:
    """How communication is priced; the defaults are the shared-channel model."""

    comm: str = "shared"
    """``shared`` (one prioritised comm channel per rank) or ``links`` (contention-free FIFO links)."""
    priorities: Priorities = field(default_factory=Priorities)
    fwd_impact: float = 0.0
    bwd_impact: float = 0.0
    congestion: bool = False
    recv_capacity: float = 1.0
    """Inbound share a rank can absorb (1.0 = one sender at full rate)."""
    ideal_sync: bool = False
    """All-reduces get their own channel and never slow compute (the seed's ``is_ideal``)."""

    def __post_init__(self) -> None:
        if self.comm not in ("shared", "links"):
            raise SimError(f"comm: expected 'shared' or 'links', got {self.comm!r}")
        for name in ("fwd_impact", "bwd_impact"):
            v = getattr(self, name)
            if not 0.0 <= v < 1.0:
                raise SimError(f"{name}: expected 0 <= value < 1 (1 stalls compute, more gives negative rates), "
                               f"got {v}")
        if not self.recv_capacity > 0:
            raise SimError(f"recv_capacity: expected a number > 0, got {self.recv_capacity}")
        if self.comm == "links" and (self.congestion or self.fwd_impact or self.bwd_impact):
            raise SimError("comm='links' is contention-free: congestion and impacts need comm='shared'")


@dataclass
class SimResult:
    """A priced schedule: the timeline (replay's form) plus what contention did to it."""

    timeline: Timeline
    throttled: set[tuple[int, int]] = field(default_factory=set)
    """(rank, index in the rank's list) of transfers slowed by receiver congestion."""
    events: int = 0
    rate_log: list[tuple[float, int, int, float]] | None = None
    """With ``record_rates``: (time, rank, index in the rank's list, new rate) of every transfer."""
    completion: float | None = None
    """The makespan when the timeline was not kept (``spans=False``)."""

    @property
    def makespan(self) -> float:
        return self.completion if self.completion is not None else self.timeline.makespan

    def utilisation(self) -> dict[int, float]:
        """Fraction of the makespan each rank's compute channel is busy."""
        span = self.makespan or 1.0
        return {r: self.timeline.busy(r, (Kind.FORWARD, Kind.BACKWARD, Kind.OPTIMIZER)) / span
                for r in self.timeline.spans}
