"""Vocabulary shared by both compute policies: task types, priorities, errors."""
from __future__ import annotations

from dataclasses import dataclass, field

TASK_TYPES = ("forward", "backward", "fwd_prop", "grad_prop", "grad_sync")
COMM_TYPES = ("fwd_prop", "grad_prop", "grad_sync")
"""Activation send, gradient send, data-parallel gradient all-reduce: the comm channel's users."""
ZERO_PRIORITY = 1e-9
"""Shared priorities at or below this run only when nothing else is ready."""


class SimError(ValueError):
    """A configuration the simulator cannot price (bad input, deadlock, livelock)."""


@dataclass(kw_only=True, frozen=True)
class Priorities:
    """How a device's comm channel is divided among ready transfers.

    ``exclusive`` maps a comm type to a tier letter ('a' beats 'b' ...): a ready task of a
    tiered type takes the whole channel. Otherwise ``shared`` values in (0, 1] split the
    channel in proportion; types at 0 run only when nothing else is ready.
    """

    shared: dict[str, float] = field(default_factory=lambda: {t: 1.0 for t in COMM_TYPES})
    exclusive: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for k, v in self.shared.items():
            if k not in COMM_TYPES:
                raise SimError(f"priorities: unknown comm type {k!r}; expected one of {', '.join(COMM_TYPES)}")
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 <= v <= 1.0:
                raise SimError(f"priorities.{k}: expected a number in [0, 1], got {v!r}")
        for k, v in self.exclusive.items():
            if k not in COMM_TYPES:
                raise SimError(f"exclusive_tiers: unknown comm type {k!r}; expected one of {', '.join(COMM_TYPES)}")
            if not (isinstance(v, str) and len(v) == 1 and v.isalpha() and v.islower()):
                raise SimError(f"exclusive_tiers.{k}: expected one lower-case letter ('a' is highest), got {v!r}")

    @staticmethod
    def of(shared: dict[str, float] | None = None, exclusive: dict[str, str | None] | None = None) -> "Priorities":
        """Build from JSON-like dicts where a missing or null tier means 'not exclusive'."""
        sh = {t: 1.0 for t in COMM_TYPES} if shared is None else {t: float(shared.get(t, 0.0)) for t in COMM_TYPES}
        ex = {k: v for k, v in (exclusive or {}).items() if v is not None}
        return Priorities(shared=sh, exclusive=ex)

    def label(self, kind: str) -> str:
        """What a CSV column shows for one type: its tier letter or its shared value."""
        return self.exclusive.get(kind) or f"{self.shared.get(kind, 0.0):g}"
