"""Gantt charts of one simulated step, for either compute policy: an adapter that turns a
:class:`SimResult` or a :class:`Seed002Result` into :mod:`torchpp.trace.gantt`'s bars.

``single`` draws one row per device (compute above, communication below); ``dual`` draws a
compute row and a comm row per device, stacking overlapping transfers in lanes so shared
bandwidth is visible. Throttled transfers get a red edge, the completion time a red line.
"""
from __future__ import annotations

import os
from pathlib import Path

from ..schedules import Kind
from ..trace.gantt import Bar, save_gantt
from .engine import SimResult
from .seed002 import Seed002Result
from .trace import event_kind

__all__ = ["Bar", "bars_of", "plot_gantt"]
_SEED002 = {"forward": "F", "backward": "B", "optimizer": "optimizer", "fwd_prop": "send_act",
            "grad_prop": "send_grad", "grad_sync": "allreduce"}


def _seed002_bars(result: Seed002Result) -> list[Bar]:
    out = []
    for k, (kind, i, j) in enumerate(result.tasks):
        ch = "compute" if kind in ("forward", "backward") else "comm"
        out.append(Bar(j, ch, _SEED002[kind], f"{kind[0].upper() if ch == 'compute' else ''}{i}", result.start[k],
                       result.end[k], result.throttled[k]))
    return out


def bars_of(result: SimResult | Seed002Result) -> list[Bar]:
    """Compute bars (channel ``compute``), transfers and all-reduces (``comm``) and the time
    compute waited for a receive (``wait``) of every device."""
    if isinstance(result, Seed002Result):
        return _seed002_bars(result)
    out: list[Bar] = []
    for r, spans in result.timeline.spans.items():
        for step, s in enumerate(spans):
            a = s.action
            kind = event_kind(a)
            mb = "" if a.microbatch is None else str(a.microbatch)
            if a.kind in (Kind.FORWARD, Kind.BACKWARD, Kind.OPTIMIZER):
                out.append(Bar(r, "compute", kind, "opt" if kind == "optimizer" else kind + mb, s.start, s.end))
            elif a.is_recv:
                if s.end > s.start:
                    out.append(Bar(r, "wait", kind, "", s.start, s.end))
            else:  # a sync's span starts when the rank reaches it; the transfer itself starts at `ready`
                start = s.ready if a.kind == Kind.ALLREDUCE else s.start
                out.append(Bar(r, "comm", kind, "", start, s.end, (r, step) in result.throttled))
    return out


def plot_gantt(result: SimResult | Seed002Result, path: str | os.PathLike, *, style: str = "dual",
               show_throttling: bool = False, show_completion_time: bool = False, title: str = "") -> Path:
    if style not in ("single", "dual"):
        raise ValueError(f"--style: expected single or dual, got {style!r}")
    bars = bars_of(result)
    names = {d: f"dev {d}" for d in {b.device for b in bars}}
    return save_gantt(path, [(title, bars)], names=names, style=style, xlabel="time", show_throttling=show_throttling,
                      show_completion_time=show_completion_time)
