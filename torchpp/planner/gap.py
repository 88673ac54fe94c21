"""Why a plan is slower than the lower bound: its predicted step split into the bound and what
each thing the bound leaves out adds.

The bound (:mod:`.bound`) counts every sample's per-sample work and every optimizer update,
spread as evenly as memory allows. A plan also pays for communication, per-call costs, the
pipeline's fill and drain, recomputation, and whole layers on whole devices. Each is taken out
of the same replay in turn, so the parts add up to the predicted step exactly:

    step = bound + placement + recompute + fill/drain + per-call + runtime + communication

- communication: the step minus the step with free links;
- runtime: that minus the step with free links and none of the runtime's own seconds per call
  (what ``torchpp profile``'s call probe measured: dispatch, posting sends and receives, copies),
  the part of a call's cost the runtime can cut;
- per-call: that minus the step with free links and free calls (blocks' fixed seconds per call,
  a split backward's per layer and call): the model's own cost of a call whatever its samples,
  which larger micro-batches amortise;
- fill/drain: that minus the busiest rank's busy time (compute and optimizer) in it;
- recompute: that rank's recomputation in it;
- placement: the rest of that rank's work above the bound (whole layers on whole devices, device
  groups, what memory forces).

The order matters where parts overlap (a transfer hidden behind a call that got shorter); it is
the order above, fixed, so plans compare part for part.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Mapping

from ..cost import FreeLinks, Profiles
from ..formats import Plan
from ..schedules import COMPUTE, Kind, build
from ..sim.compiled import Compiled
from ..sim.measured import price
from ..sim.trace import recompute_of


LABELS = {"placement": "placement", "recompute": "recompute", "fill_drain": "fill/drain", "per_call": "per-call",
          "runtime_call": "runtime per call", "communication": "communication"}


@dataclass(frozen=True)
class Gap:
    """A predicted step in parts, seconds; they sum to ``step_s``."""

    step_s: float
    bound_s: float
    placement_s: float
    recompute_s: float
    fill_drain_s: float
    per_call_s: float
    communication_s: float
    runtime_call_s: float | None = None
    """The runtime's own seconds per call; None in a plan priced before it was said apart from
    ``per_call_s`` (which then holds both)."""

    PARTS = ("placement", "recompute", "fill_drain", "per_call", "runtime_call", "communication")

    def as_dict(self) -> dict[str, float]:
        return asdict(self)

    def part_s(self, part: str) -> float:
        return getattr(self, f"{part}_s") or 0.0

    def largest(self) -> str:
        """The part that adds the most above the bound."""
        return max(self.PARTS, key=self.part_s)

    def line(self) -> str:
        parts = " + ".join(f"{self.part_s(p):.3g} {LABELS[p]}" for p in self.PARTS
                           if p != "runtime_call" or self.runtime_call_s is not None)
        return f"{self.step_s:.4g} s = {self.bound_s:.4g} bound + {parts}"


def gap_to_bound(plan: Plan, profiles: Profiles, links, bound_s: float,
                 optimizer_s_per_byte: Mapping[str, float] | float | None = None, step_s: float | None = None) -> Gap:
    """The plan's replayed step split as the module says (``links``: what the plan was priced with;
    ``step_s``: its step on them where already replayed, else it is replayed here). The parts past
    the step are the same plan replayed on other costs (free links; free links and calls)."""
    hosts = sorted({d.host for s in plan.stages for d in s.devices})
    lists = Compiled(build(plan))  # the same action lists on every cost: built once
    step = step_s if step_s is not None else price(plan, profiles, links, optimizer_s_per_byte, schedule=lists)[0]
    no_comm, _ = price(plan, profiles, FreeLinks(), optimizer_s_per_byte, schedule=lists)
    no_runtime, _ = price(plan, profiles.without_runtime_calls(hosts), FreeLinks(), optimizer_s_per_byte,
                          schedule=lists)
    work = profiles.per_sample_only(hosts)
    bare, tl = price(plan, work, FreeLinks(), optimizer_s_per_byte, schedule=lists)
    rec = recompute_of(plan, work)
    busy = {r: sum(sp.end - sp.start for sp in spans if sp.action.kind in COMPUTE) for r, spans in tl.spans.items()}
    busiest = max(busy, key=busy.get)
    recompute = sum(rec(busiest, sp.action) for sp in tl.spans[busiest]
                    if sp.action.kind in (Kind.BACKWARD, Kind.BACKWARD_INPUT))
    return Gap(step_s=step, bound_s=bound_s, placement_s=busy[busiest] - recompute - bound_s, recompute_s=recompute,
               fill_drain_s=bare - busy[busiest], per_call_s=no_runtime - bare, runtime_call_s=no_comm - no_runtime,
               communication_s=step - no_comm)
