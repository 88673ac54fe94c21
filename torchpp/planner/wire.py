"""Wire formats and data-parallel sync periods, chosen for a plan whose split is already chosen.

A post-pass over the searched plan (the split, groups, micro-batching and schedule stay as the
search chose them), run only with ``--allow-lossy``, because every choice here changes the
arithmetic of training:

1. Each pipeline link (chunk i to i+1), in order: every allowed format (``bf16``, ``fp16``,
   ``int8``) is priced by the one cost model (the predicted step of the whole plan: bytes on the
   wire over the measured link, the measured encode/decode CPU of both hosts, overlap with compute
   as the schedule allows); the link keeps fp32 unless a format shortens the predicted step by at
   least ``min_gain``. On a fast link the transfer hides behind compute, nothing is gained, and
   the link stays fp32.
2. Each device group of two or more: ``diloco`` (if allowed) with the smallest H in
   :data:`PERIODS` whose predicted step is within ``min_gain`` of the best period's (the cost model
   does not price DiLoCo's staleness, so the shortest period that buys the time is taken), in the
   wire format its ``outer`` all-reduce may use that is allowed; else a ``bf16`` gradient
   all-reduce if allowed and it pays. Groups of the tied-weight all-reduce do not take diloco
   (``formats.plan`` refuses it). DiLoCo changes the optimisation itself (not a rounding of what
   crosses the link), so it is taken only where it shortens the predicted step by ``diloco_gain``
   (20%): where the all-reduce dominates, not where it is a tenth of the step.

``price(plan) -> seconds`` is the planner's own prediction, so this module needs nothing of the
search's internals and applies to any plan.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Callable, Iterable

from ..formats import LOSSY, Plan, Sync

PERIODS = (2, 4, 8, 16, 32, 64, 128)
"""The DiLoCo periods H tried (OpenDiLoCo and INTELLECT-1 run H in the hundreds)."""
LINK_FORMATS = ("bf16", "fp16", "int8")
MIN_GAIN = 0.03
"""A lossy format is taken only where it shortens the predicted step by at least this fraction."""
DILOCO_GAIN = 0.2
"""DiLoCo changes the optimisation itself (not a rounding of what crosses a link): at least this fraction."""


def parse_allow(text: str | Iterable[str] | None) -> frozenset[str]:
    """``"bf16,int8,diloco"`` -> the allowed lossy choices; raises ValueError naming an unknown one."""
    items = [x.strip() for x in (text.split(",") if isinstance(text, str) else text or ()) if x.strip()]
    bad = [x for x in items if x not in LOSSY]
    if bad:
        raise ValueError(f"--allow-lossy: expected a comma-separated subset of {','.join(LOSSY)}, got {bad[0]!r}")
    return frozenset(items)


@dataclass
class WireChoice:
    """What the pass chose and the predicted step before and after."""

    plan: Plan
    fp32_step_s: float
    step_s: float
    decisions: list[str] = field(default_factory=list)


def choose(plan: Plan, price: Callable[[Plan], float], allow: frozenset[str], min_gain: float = MIN_GAIN,
           diloco_gain: float = DILOCO_GAIN) -> WireChoice:
    """``plan`` with the wire format of each link and the sync of each group that pay (module docstring)."""
    best = copy.deepcopy(plan)
    base = best_s = price(best)
    out = WireChoice(plan=best, fp32_step_s=base, step_s=base)
    tied = plan.model.tied_embeddings and set(plan.stages[0].ranks) != set(plan.stages[-1].ranks)
    for s in best.stages[:-1]:
        for fmt in (f for f in LINK_FORMATS if f in allow):
            s.wire, old = fmt, s.wire
            t = price(best)
            if t < best_s * (1 - min_gain) and (old is None or t < best_s):
                best_s = t
            else:
                s.wire = old
        if s.wire:
            out.decisions.append(f"stages[{s.index}] -> stages[{s.index + 1}]: {s.wire}")
    for s in best.stages:
        if len(s.devices) < 2:
            continue
        cands: list[Sync] = []  # least lossy first: the first near the best is taken
        if "bf16" in allow:
            cands.append(Sync(kind="allreduce", wire="bf16"))
        if "powersgd" in allow:
            cands.append(Sync(kind="powersgd"))
        if "diloco" in allow and not (tied and (s.has_embed or s.has_tail)):
            outer = "int8" if "int8" in allow else "bf16" if "bf16" in allow else "fp32"
            cands += [Sync(kind="diloco", H=h, wire=outer) for h in PERIODS]
        priced = []
        for c in cands:
            s.sync = c
            priced.append((price(best), c))
        s.sync = None
        if not priced:
            continue
        top = min(t for t, _ in priced)
        if top >= best_s * (1 - min_gain):
            continue
        t, c = next((t, c) for t, c in priced if t <= top * (1 + min_gain))  # the least lossy that is near the best
        if c.kind == "diloco" and t >= best_s * (1 - diloco_gain):
            continue
        s.sync, best_s = c, t
        out.decisions.append(f"stages[{s.index}] group {s.ranks}: {c.kind}"
                             + (f" H={c.H}" if c.kind == "diloco" else "") + f" ({c.wire})")
    out.step_s = best_s
    return out
