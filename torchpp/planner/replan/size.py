"""Whether a re-plan may change the micro-batch size, or the plan at all: only on evidence.

The corrected costs are fitted on one run at one micro-batch size. At that size they are checked
against the run itself; at another they rest on carrying the fit (its split of each call into a
per-call and a per-sample part) to a size nobody measured. So a new size must win by more than the
corrected costs miss the run they were fitted on; otherwise the best plan at the measured size is
kept. On bench_prove run 31 the re-plan moved from 8 × 4 to 4 × 8 for a predicted 0.3% (the
corrected costs missed the run by 5.7%) and measured 6% slower than the 8 × 4 plan.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SizeChoice:
    """The measured size's best against the search's best at another size."""

    measured_size: int
    kept: bool
    """True: the best plan at the measured size is kept."""
    margin: float
    """What another size must win by: the corrected costs' relative error on the measured run."""
    gain: float | None
    """Predicted gain of the other size's best over the measured size's best (None: none fits)."""

    def line(self, other_size: int) -> str:
        if self.gain is None:
            return (f"micro-batch size {other_size}: no plan at the run's size {self.measured_size} fits the "
                    "corrected costs, so the size changes")
        verb = "kept" if self.kept else "changed"
        how = "inside" if self.kept else "beyond"
        return (f"micro-batch size {verb}: the best plan at {other_size} samples is predicted {100 * self.gain:.1f}% faster "
                f"than the best at the run's {self.measured_size}, {how} the corrected costs' "
                f"{100 * self.margin:.1f}% error on the run they were fitted to")


def choose_size(measured_size: int, measured_s: float, repriced_s: float, free_step_s: float,
                same_size_step_s: float | None) -> SizeChoice:
    """Keep ``measured_size`` unless the free search's plan (``free_step_s``) beats the best plan at
    that size (``same_size_step_s``; None: none fits) by more than ``|repriced − measured| / measured``."""
    margin = abs(repriced_s - measured_s) / measured_s
    if same_size_step_s is None:
        return SizeChoice(measured_size, kept=False, margin=margin, gain=None)
    gain = same_size_step_s / free_step_s - 1.0
    return SizeChoice(measured_size, kept=gain <= margin, margin=margin, gain=gain)


@dataclass(frozen=True)
class PlanChoice:
    """The searched plan against the run's own plan, both priced with the corrected costs."""

    kept: bool
    """True: the run's plan is kept (the searched plan's gain is inside the costs' error on the run)."""
    margin: float
    gain: float

    def line(self) -> str:
        if self.kept:
            return (f"plan kept: the best plan found is predicted {100 * self.gain:+.1f}% throughput over the run's, "
                    f"inside the corrected costs' {100 * self.margin:.1f}% error on the run they were fitted to "
                    f"(--any-gain takes it)")
        return (f"plan changed: predicted {100 * self.gain:+.1f}% throughput over the run's, beyond the corrected "
                f"costs' {100 * self.margin:.1f}% error on the run")


def choose_plan(measured_s: float, repriced_s: float, new_s: float) -> PlanChoice:
    """Keep the run's plan unless the searched plan (``new_s``) beats its re-pricing (``repriced_s``)
    by more than ``|repriced − measured| / measured``: a gain the costs cannot tell from their own miss
    on the run is no reason to move (one demo re-plan moved two Pi 4s' stages for a predicted 0.1%
    and measured 3.5% slower)."""
    margin = abs(repriced_s - measured_s) / measured_s
    gain = repriced_s / new_s - 1.0
    return PlanChoice(kept=gain <= margin, margin=margin, gain=gain)

