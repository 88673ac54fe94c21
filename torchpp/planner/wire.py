"""Wire formats and data-parallel sync periods, chosen for a plan whose split is already chosen.

A pass over one candidate plan (the split, groups, micro-batching and schedule stay as they are),
run only with ``--allow-lossy``, because every choice here changes the arithmetic of training. The
planner (``api._choose_wire``) runs it over several candidates: the fp32 search's plan, the plan the
search finds with every link priced as each allowed format (``cost.FormatLinks``), and the pp and dp
plans; the fastest wins. On one plan:

1. Pipeline links (chunk i to i+1): each allowed format (``bf16``, ``fp16``, ``int8``) on every
   link at once is priced by the one cost model (the predicted step of the whole plan: bytes on
   the wire over the measured link, the measured encode/decode CPU of both hosts, overlap with
   compute as the schedule allows; links in series bottleneck together, so one link alone often
   buys nothing); the best is kept if it shortens the predicted step by at least ``min_gain``,
   then each link in turn goes back to fp32 where that costs under ``TIE`` of the step, or to
   another format where that gains more than ``TIE``. On fast links the transfers hide behind
   compute, nothing is gained, and the links stay fp32.
2. Each device group of two or more: ``diloco`` (if allowed) with the smallest H in
   :data:`PERIODS` whose predicted step is within ``min_gain`` of the best period's (the cost model
   does not price DiLoCo's staleness, so the shortest period that buys the time is taken), in the
   wire format its ``outer`` all-reduce may use that is allowed; else a ``bf16`` (or, in a group
   of two, ``int8`` with error feedback) gradient all-reduce if allowed and it pays. Groups of
   the tied-weight all-reduce do not take diloco
   (``formats.plan`` refuses it). DiLoCo changes the optimisation itself (not a rounding of what
   crosses the link), so it is taken only where it shortens the predicted step by ``diloco_gain``
   (20%): where the all-reduce dominates, not where it is a tenth of the step. PowerSGD is not
   offered for a group (:data:`GROUP_POWERSGD_REFUSED`).
3. The tied weight between the first and the last stage: ``rows`` first (exact: only the rows the
   step's tokens touch cross, each way; ``formats.rows_refusal`` says where it cannot apply), then
   the lossy all-reduces; the least lossy within ``min_gain`` of the best that pays. PowerSGD (a
   low-rank gradient, not a rounding) is held to DiLoCo's 20%.

``price(plan) -> seconds`` is the planner's own prediction, so this module needs nothing of the
search's internals and applies to any plan.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Callable, Iterable

from ..formats import LOSSY, Plan, Sync, rows_refusal

PERIODS = (2, 4, 8, 16, 32, 64, 128)
"""The DiLoCo periods H tried (OpenDiLoCo and INTELLECT-1 run H in the hundreds)."""
LINK_FORMATS = ("bf16", "fp16", "int8")
MIN_GAIN = 0.03
"""A lossy format is taken only where it shortens the predicted step by at least this fraction."""
TIE = 0.005
"""Per-link refinement: a link goes back to fp32 when that costs less than this fraction of the step."""
DILOCO_GAIN = 0.2
"""DiLoCo and PowerSGD change the optimisation itself (not a rounding of what crosses a link): at least
this fraction. PowerSGD's low-rank gradients are not a rounding either: on seed 003's cluster at
100 Mbit/s a data-parallel plan with a rank-4 PowerSGD all-reduce under AdamW ended 15% above fp32's
loss at equal tokens (docs/links.md); the margin keeps it out where it buys little, and what a lossy
choice costs in loss is not priced."""
GROUP_POWERSGD_REFUSED = ("powersgd is offered for the tied weight only, not for a data-parallel group's gradient: "
                          "a rank-4 PowerSGD all-reduce of every weight ended 15% above fp32's loss under AdamW "
                          "(docs/links.md); name it in a plan by hand to try it")
"""Why the pass offers PowerSGD to the tied weight only: on seed 003's cluster at 100 Mbit/s the
planner's data-parallel plan with a rank-4 PowerSGD all-reduce of every weight ended 15.1% above fp32's
loss at equal tokens under AdamW (250 steps) and never reached it, where the tied weight's PowerSGD
all-reduce stayed within 1.7-2.1%. A plan may still name ``{"kind": "powersgd"}`` for a group."""
OPTIMISATION_KINDS = ("diloco", "powersgd")
"""Sync kinds held to :data:`DILOCO_GAIN` rather than :data:`MIN_GAIN`."""


def changes_optimisation(lossy: Iterable[str]) -> bool:
    """Whether a plan's lossy choices (``Plan.lossy``) include one of :data:`OPTIMISATION_KINDS`."""
    return any(k in x for x in lossy for k in OPTIMISATION_KINDS)


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
    notes: list[str] = field(default_factory=list)
    """Allowed choices the pass did not offer, and why (not decisions: the plan is unchanged by them)."""


def choose(plan: Plan, price: Callable[[Plan], float], allow: frozenset[str], min_gain: float = MIN_GAIN,
           diloco_gain: float = DILOCO_GAIN, tied_rows: int = 0) -> WireChoice:
    """``plan`` with the wire format of each link and the sync of each group that pay (module docstring);
    ``tied_rows``: the distinct token ids a step is expected to touch (0: every token of the step)."""
    best = copy.deepcopy(plan)
    base = best_s = price(best)
    out = WireChoice(plan=best, fp32_step_s=base, step_s=base)
    tied = plan.model.tied_embeddings and set(plan.stages[0].ranks) != set(plan.stages[-1].ranks)
    links = best.stages[:-1]
    formats = [f for f in LINK_FORMATS if f in allow]
    if links and formats:  # one format on every link first: links in series bottleneck together
        uniform = []
        for fmt in formats:
            for s in links:
                s.wire = fmt
            uniform.append((price(best), fmt))
        t, fmt = min(uniform)
        for s in links:
            s.wire = fmt if t < best_s * (1 - min_gain) else None
        best_s = min(best_s, t)
        if links[0].wire:  # then each link alone: fp32 where it costs (almost) nothing, else its best format
            for s in links:
                for fmt in (None, *formats):
                    old, s.wire = s.wire, fmt
                    t = price(best)
                    if t <= best_s * (1 + TIE) if fmt is None else t < best_s * (1 - TIE):
                        best_s = min(best_s, t)
                    else:
                        s.wire = old
    out.decisions += [f"stages[{s.index}] -> stages[{s.index + 1}]: {s.wire}" for s in links if s.wire]
    for s in best.stages:
        if len(s.devices) < 2:
            continue
        cands: list[Sync] = []  # least lossy first: the first near the best is taken
        if "bf16" in allow:
            cands.append(Sync(kind="allreduce", wire="bf16"))
        if "int8" in allow and len(s.devices) == 2:  # all-gathered: beyond two members a ring sends less
            cands.append(Sync(kind="allreduce", wire="int8"))
        if "powersgd" in allow and GROUP_POWERSGD_REFUSED not in out.notes:
            out.notes.append(GROUP_POWERSGD_REFUSED)
        if "diloco" in allow and not (tied and (s.has_embed or s.has_tail)):
            outer = "int8" if "int8" in allow else "bf16" if "bf16" in allow else "fp32"
            cands += [Sync(kind="diloco", H=h, wire=outer) for h in PERIODS]
        s.sync, best_s = _best_sync(s, cands, best, price, best_s, min_gain, diloco_gain)
        if s.sync is not None:
            out.decisions.append(f"stages[{s.index}] group {s.ranks}: {s.sync.kind}"
                                 + (f" H={s.sync.H}" if s.sync.kind == "diloco" else "") + f" ({s.sync.wire})")
    if tied:
        pair = len(set(plan.stages[0].ranks) | set(plan.stages[-1].ranks)) == 2
        cands = ([Sync(kind="rows", rows=tied_rows)] if rows_refusal(best) is None else []) + [
            Sync(kind="allreduce", wire=f) for f in ("bf16", "int8") if f in allow and (f != "int8" or pair)] + (
            [Sync(kind="powersgd")] if "powersgd" in allow else [])
        best.tied_sync, best_s = _best_sync(best, cands, best, price, best_s, min_gain, diloco_gain, key="tied_sync")
        if best.tied_sync is not None and best.tied_sync.kind == "rows":
            out.decisions.append("tied-weight sync: the touched rows (exact)")
        elif best.tied_sync is not None:
            out.decisions.append(f"tied-weight all-reduce: {best.tied_sync.kind} ({best.tied_sync.wire})")
    out.step_s = best_s
    return out


def _best_sync(owner, cands: list[Sync], plan: Plan, price: Callable[[Plan], float], base_s: float, min_gain: float,
               diloco_gain: float, key: str = "sync") -> tuple[Sync | None, float]:
    """The least lossy of ``cands`` (listed least lossy first) within ``min_gain`` of the best one that
    pays (diloco and powersgd: ``diloco_gain``), set as ``owner.<key>``; (None, ``base_s``) when none pays."""
    priced = []
    for c in cands:
        setattr(owner, key, c)
        t = price(plan)
        if t < base_s * (1 - (diloco_gain if c.kind in OPTIMISATION_KINDS else min_gain)):
            priced.append((t, c))
    setattr(owner, key, None)
    if not priced:
        return None, base_s
    top = min(t for t, _ in priced)
    t, c = next((t, c) for t, c in priced if t <= top * (1 + min_gain))
    return c, t
