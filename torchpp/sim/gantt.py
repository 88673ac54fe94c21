"""Gantt charts of one simulated step, for either compute policy.

``single`` draws one row per device (compute above, communication below); ``dual`` draws a
compute row and a comm row per device, stacking overlapping transfers in lanes so shared
bandwidth is visible. Throttled transfers get a red edge, the completion time a red line.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ..schedules import Kind
from .engine import SimResult
from .seed002 import Seed002Result

COLOURS = {"forward": "#4C72B0", "backward": "#DD8452", "optimizer": "#8C8C8C", "fwd_prop": "#55A868",
           "grad_prop": "#C44E52", "grad_sync": "#8172B3"}
_KIND = {Kind.FORWARD: "forward", Kind.BACKWARD: "backward", Kind.OPTIMIZER: "optimizer", Kind.SEND_ACT: "fwd_prop",
         Kind.SEND_GRAD: "grad_prop", Kind.ALLREDUCE: "grad_sync"}


@dataclass(frozen=True)
class Bar:
    device: int
    channel: str
    """``compute`` or ``comm``."""
    kind: str
    label: str
    start: float
    end: float
    throttled: bool = False


def bars_of(result: SimResult | Seed002Result) -> list[Bar]:
    out: list[Bar] = []
    if isinstance(result, Seed002Result):
        for k, (kind, i, j) in enumerate(result.tasks):
            ch = "compute" if kind in ("forward", "backward") else "comm"
            out.append(Bar(j, ch, kind, f"{kind[0].upper() if ch == 'compute' else ''}{i}", result.start[k],
                           result.end[k], result.throttled[k]))
        return out
    for r, spans in result.timeline.spans.items():
        for step, s in enumerate(spans):
            kind = _KIND.get(s.action.kind)
            if kind is None:
                continue
            ch = "compute" if kind in ("forward", "backward", "optimizer") else "comm"
            mb = "" if s.action.microbatch is None else str(s.action.microbatch)
            label = {"forward": "F", "backward": "B", "optimizer": "opt"}.get(kind, "") + mb
            # a sync's span starts when the rank reaches it; the transfer itself starts at `ready`
            start = s.ready if kind == "grad_sync" else s.start
            out.append(Bar(r, ch, kind, label, start, s.end, (r, step) in result.throttled))
    return out


def _lanes(bars: list[Bar]) -> list[int]:
    """Greedy interval colouring: overlapping transfers of one device get different lanes."""
    order = sorted(range(len(bars)), key=lambda i: (bars[i].start, bars[i].end))
    ends: list[float] = []
    lane = [0] * len(bars)
    for i in order:
        for j, e in enumerate(ends):
            if e <= bars[i].start + 1e-12:
                ends[j] = bars[i].end
                lane[i] = j
                break
        else:
            lane[i] = len(ends)
            ends.append(bars[i].end)
    return lane


def plot_gantt(result: SimResult | Seed002Result, path: str | os.PathLike, *, style: str = "dual",
               show_throttling: bool = False, show_completion_time: bool = False, title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    if style not in ("single", "dual"):
        raise ValueError(f"--style: expected single or dual, got {style!r}")
    bars = bars_of(result)
    devices = sorted({b.device for b in bars})
    makespan = max((b.end for b in bars), default=0.0)
    rows_per = 2 if style == "dual" else 1
    fig, ax = plt.subplots(figsize=(max(8.0, min(24.0, makespan / 2 + 6)), 0.9 * rows_per * len(devices) + 1.5))
    yticks, ylabels = [], []
    for d_i, d in enumerate(devices):
        base = (len(devices) - 1 - d_i) * rows_per
        comm = [b for b in bars if b.device == d and b.channel == "comm" and b.end > b.start]
        lanes = _lanes(comm)
        n_lanes = max(lanes, default=0) + 1
        for b in bars:
            if b.device != d or b.channel != "compute":
                continue
            y0, h = (base + 1.05, 0.8) if style == "dual" else (base + 0.5, 0.45)
            ax.broken_barh([(b.start, b.end - b.start)], (y0, h), color=COLOURS[b.kind], edgecolor="k", lw=0.3)
            if b.end - b.start > makespan / 80:
                ax.text((b.start + b.end) / 2, y0 + h / 2, b.label, ha="center", va="center", fontsize=6)
        for b, lane in zip(comm, lanes):
            top, height = (base + 0.05, 0.8) if style == "dual" else (base + 0.02, 0.45)
            h = height / n_lanes
            y0 = top + lane * h
            edge, lw = ("red", 1.4) if (show_throttling and b.throttled) else ("k", 0.3)
            ax.broken_barh([(b.start, b.end - b.start)], (y0, h), color=COLOURS[b.kind], edgecolor=edge, lw=lw,
                           alpha=0.9)
        if style == "dual":
            yticks += [base + 1.45, base + 0.45]
            ylabels += [f"dev {d} compute", f"dev {d} comm"]
        else:
            yticks.append(base + 0.5)
            ylabels.append(f"dev {d}")
    if show_completion_time:
        ax.axvline(makespan, color="red", ls="--", lw=1.2)
        ax.text(makespan, rows_per * len(devices) + 0.05, f" {makespan:.6g}", color="red", fontsize=8, va="bottom")
    ax.set_yticks(yticks, ylabels, fontsize=8)
    ax.set_ylim(-0.2, rows_per * len(devices) + 0.4)
    ax.set_xlim(0, makespan * 1.02 if makespan else 1)
    ax.set_xlabel("time")
    handles = [Patch(color=c, label=k) for k, c in COLOURS.items() if any(b.kind == k for b in bars)]
    if show_throttling:
        handles.append(Patch(facecolor="white", edgecolor="red", label="throttled"))
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.08), ncol=len(handles), fontsize=8)
    ax.set_title(title or f"completion time {makespan:.6g}", fontsize=9)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return out
