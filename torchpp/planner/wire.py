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
   (20%): where the all-reduce dominates, not where it is a tenth of the step. PowerSGD (a low-rank
   gradient, not a rounding) is held to the same 20%, at the rank :func:`powersgd_rank` gives for
   the optimizer, hidden size and group (under AdamW not at all beyond 3 members).
3. The tied weight between the first and the last stage: ``rows`` first (exact: only the rows the
   step's tokens touch cross, each way; ``formats.rows_refusal`` says where it cannot apply), then
   the lossy all-reduces; the least lossy within ``min_gain`` of the best that pays. PowerSGD (a
   low-rank gradient, not a rounding) is held to DiLoCo's 20%, at :func:`powersgd_rank`'s rank.

``price(plan) -> seconds`` is the planner's own prediction, so this module needs nothing of the
search's internals and applies to any plan.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Callable, Iterable

from ..formats import LOSSY, OPTIMIZERS, POWERSGD_RANK, Plan, Sync, rows_refusal

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
choice costs in loss is not priced (:func:`powersgd_rank` keeps the rank high enough to train)."""
ADAPTIVE = ("adamw",)
"""Optimizers that rescale each coordinate by its own gradient history, so a low-rank gradient's error
in a small coordinate becomes a full-size step."""
ADAPTIVE_RANK_FRACTION = 16
"""Under an adaptive optimizer PowerSGD's rank is at least hidden × (members − 1) / this."""
ADAPTIVE_MAX_MEMBERS = 4
"""Under an adaptive optimizer PowerSGD is offered to groups of at most this many members (measured up to
4; from 5 its rank's bytes, 2 × rank / hidden = (members − 1) / 8 of fp32's, are no fewer than bf16's)."""
OPTIMISATION_KINDS = ("diloco", "powersgd")
"""Sync kinds held to :data:`DILOCO_GAIN` rather than :data:`MIN_GAIN`."""


def changes_optimisation(lossy: Iterable[str]) -> bool:
    """Whether a plan's lossy choices (``Plan.lossy``) include one of :data:`OPTIMISATION_KINDS`."""
    return any(k in x for x in lossy for k in OPTIMISATION_KINDS)


def powersgd_rank(optimizer: str, hidden: int, members: int) -> int | None:
    """The PowerSGD rank the planner offers a sync of ``members`` ranks (None: not offered).

    Under SGD :data:`POWERSGD_RANK` (4). Under AdamW, which rescales each coordinate so that a low-rank
    error in a small one becomes a full-size step, at least hidden × (members − 1) / 16, in groups of at
    most 4. Measured (benchmarks/bench_powersgd.py, 250 steps, loss at equal tokens against fp32,
    docs/links.md): qwen3-small cut to 3 layers (hidden 256) over 2 ranks +12.8% at rank 4, +3.6% at 8,
    +0.90% at 16; over 3 ranks +12.5% at 4, +2.6% at 16, +1.3% at 32; over 4 ranks (three seeds, mean ±
    standard error) +7.4 ± 2.6% at 16, +1.9 ± 1.7% at 32, +0.88 ± 0.81% at 48, +0.42 ± 0.79% at 64;
    qwen3-tiny (hidden 64) over 2 +1.0% at rank 4; a plain all-reduce for the first 10% of the steps
    (rank 4, 2 ranks) still +7.2%.
    The cost model prices the rank's bytes (2r/hidden of each weight), so a high rank is chosen only
    where it still pays."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer: expected one of {', '.join(OPTIMIZERS)}, got {optimizer!r}")
    if optimizer not in ADAPTIVE:
        return POWERSGD_RANK
    if members > ADAPTIVE_MAX_MEMBERS:
        return None
    return max(POWERSGD_RANK, -(-hidden * (members - 1) // ADAPTIVE_RANK_FRACTION))


def powersgd_note(optimizer: str, hidden: int) -> str:
    """What ``torchpp plan --allow-lossy ...,powersgd`` says of the ranks it offers under ``optimizer``."""
    if optimizer not in ADAPTIVE:
        return f"powersgd under {optimizer}: offered at rank {POWERSGD_RANK}"
    offers = [f"{powersgd_rank(optimizer, hidden, n)} to " + ("a pair" if n == 2 else f"a group of {n}")
              for n in range(2, ADAPTIVE_MAX_MEMBERS + 1)]
    return (f"powersgd under {optimizer}: offered at rank {', '.join(offers[:-1])} and {offers[-1]} (hidden {hidden}: "
            f"at least hidden x (members - 1) / {ADAPTIVE_RANK_FRACTION}; at rank 4 under adamw it trained measurably "
            "worse than fp32), not to larger groups, where that rank sends no fewer bytes than bf16 (docs/links.md); "
            "--optimizer sgd if the run uses sgd")


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
           diloco_gain: float = DILOCO_GAIN, tied_rows: int = 0, optimizer: str = "adamw") -> WireChoice:
    """``plan`` with the wire format of each link and the sync of each group that pay (module docstring);
    ``tied_rows``: the distinct token ids a step is expected to touch (0: every token of the step);
    ``optimizer``: the run's (the PowerSGD rank offered depends on it)."""
    def psgd(members: int, what: str) -> list[Sync]:
        if "powersgd" not in allow:
            return []
        rank = powersgd_rank(optimizer, plan.model.hidden_size, members)
        if rank is None:
            note = (f"powersgd is not offered to {what} ({members} ranks) under {optimizer}: measured to train within "
                    f"2% of fp32 in groups of at most {ADAPTIVE_MAX_MEMBERS} (docs/links.md)")
            out.notes += [] if note in out.notes else [note]
            return []
        return [Sync(kind="powersgd", rank=rank)]

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
        cands += psgd(len(s.devices), f"stages[{s.index}]'s group")
        if "diloco" in allow and not (tied and (s.has_embed or s.has_tail)):
            outer = "int8" if "int8" in allow else "bf16" if "bf16" in allow else "fp32"
            cands += [Sync(kind="diloco", H=h, wire=outer) for h in PERIODS]
        s.sync, best_s = _best_sync(s, cands, best, price, best_s, min_gain, diloco_gain)
        if s.sync is not None:
            out.decisions.append(f"stages[{s.index}] group {s.ranks}: {_describe(s.sync, optimizer)}")
    if tied:
        members = len(set(plan.stages[0].ranks) | set(plan.stages[-1].ranks))
        cands = ([Sync(kind="rows", rows=tied_rows)] if rows_refusal(best) is None else []) + [
            Sync(kind="allreduce", wire=f) for f in ("bf16", "int8") if f in allow and (f != "int8" or members == 2)] + (
            psgd(members, "the tied weight"))
        best.tied_sync, best_s = _best_sync(best, cands, best, price, best_s, min_gain, diloco_gain, key="tied_sync")
        if best.tied_sync is not None and best.tied_sync.kind == "rows":
            out.decisions.append("tied-weight sync: the touched rows (exact)")
        elif best.tied_sync is not None:
            out.decisions.append(f"tied-weight all-reduce: {_describe(best.tied_sync, optimizer)}")
    out.step_s = best_s
    return out


def _describe(sync: Sync, optimizer: str) -> str:
    """A group's or the tied weight's sync as the pass's decisions name it."""
    return (sync.kind + (f" H={sync.H}" if sync.kind == "diloco" else "")
            + (f" rank {sync.rank} under {optimizer}" if sync.kind == "powersgd" else "") + f" ({sync.wire})")


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
