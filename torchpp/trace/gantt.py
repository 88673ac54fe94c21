"""The one Gantt renderer: measured and predicted timelines, and simulated steps, as PNG.

Every chart draws the same thing the same way: per rank a compute row (``F``/``B`` with their
micro-batch, the optimizer, and the time compute waited for a receive, pale) and a comm row
(sends and all-reduces; overlapping transfers stacked in lanes so shared bandwidth shows),
one colour per action kind and one legend. ``style="single"`` folds the two rows of a rank
into one (compute above, comm below). Throttled transfers can get a red edge and the
completion time a red line. Callers turn their records into :class:`Bar` s: analysis
:class:`~torchpp.trace.analyze.Event` s through :func:`bars_from_events`, simulator results
through :mod:`torchpp.sim.gantt`.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping, Sequence

from .analyze import Event

COLOURS = {"F": "#4c72b0", "B": "#dd8452", "I": "#ccb974", "W": "#64b5cd", "optimizer": "#8c8c8c", "recv_act": "#a6c8e8", "recv_grad": "#f2c6a4",
           "send_act": "#55a868", "send_grad": "#c44e52", "allreduce": "#8172b3"}
LABELS = {"F": "forward", "B": "backward", "I": "backward: input gradient", "W": "backward: weight gradient",
          "optimizer": "optimizer", "recv_act": "waiting for activations",
          "recv_grad": "waiting for gradients", "send_act": "activation transfer", "send_grad": "gradient transfer",
          "allreduce": "all-reduce"}
CHANNELS = ("compute", "wait", "comm")
"""compute: F/B (or I and W)/optimizer; wait: compute blocked on a receive (drawn on the compute row); comm."""


@dataclass(frozen=True, slots=True)
class Bar:
    device: int
    """The rank (or simulated device) whose rows the bar is on."""
    channel: str
    kind: str
    """A key of :data:`COLOURS`."""
    label: str
    start: float
    end: float
    throttled: bool = False


def bars_from_events(events: Iterable[Event]) -> list[Bar]:
    """Bars of a timeline's events; a receive is drawn as the time compute waited for it."""
    out = []
    for e in events:
        if e.kind in ("F", "B", "I", "W"):
            out.append(Bar(e.rank, "compute", e.kind, f"{e.kind}{'' if e.microbatch is None else e.microbatch}",
                           e.start, e.end))
        elif e.kind == "optimizer":
            out.append(Bar(e.rank, "compute", e.kind, "opt", e.start, e.end))
        elif e.kind.startswith("recv"):
            blocked = e.dur if e.blocked_s is None else e.blocked_s
            if blocked > 0:
                out.append(Bar(e.rank, "wait", e.kind, "", e.end - blocked, e.end))
        elif e.kind in COLOURS:
            out.append(Bar(e.rank, "comm", e.kind, "", e.start, e.end))
    return out


def rank_names(events: Iterable[Event]) -> dict[int, str]:
    return {e.rank: f"rank {e.rank} · s{e.stage}" for e in events}


def lanes(bars: Sequence[Bar]) -> list[int]:
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


def _draw_device(ax, bars: Sequence[Bar], base: float, style: str, t0: float, span: float,
                 show_throttling: bool) -> None:
    # one collection per colour and row, not one per bar: a plan's chart has thousands of bars
    y0, h = (base + 1.05, 0.8) if style == "dual" else (base + 0.5, 0.45)
    rows: dict[tuple, list[tuple[float, float]]] = {}
    for b in bars:
        if b.channel == "comm" or b.end <= b.start:
            continue
        rows.setdefault((b.kind, y0, h, "k", 0.3, 1.0), []).append((b.start - t0, b.end - b.start))
        if b.label and b.end - b.start > span / 80:
            ax.text((b.start + b.end) / 2 - t0, y0 + h / 2, b.label, ha="center", va="center", fontsize=6)
    comm = [b for b in bars if b.channel == "comm" and b.end > b.start]
    lane = lanes(comm)
    top, height = (base + 0.05, 0.8) if style == "dual" else (base + 0.02, 0.45)
    hl = height / (max(lane, default=0) + 1)
    for b, k in zip(comm, lane):
        edge, lw = ("red", 1.4) if (show_throttling and b.throttled) else ("k", 0.3)
        rows.setdefault((b.kind, top + k * hl, hl, edge, lw, 0.9), []).append((b.start - t0, b.end - b.start))
    for (kind, y, height_, edge, lw, alpha), xs in rows.items():
        ax.broken_barh(xs, (y, height_), color=COLOURS[kind], edgecolor=edge, lw=lw, alpha=alpha)


def draw(ax, bars: Sequence[Bar], title: str = "", *, names: Mapping[int, str] | None = None, style: str = "dual",
         t0: float | None = None, show_throttling: bool = False, show_completion_time: bool = False) -> None:
    """One panel: every device's rows, first device on top."""
    if style not in ("single", "dual"):
        raise ValueError(f"--style: expected single or dual, got {style!r}")
    if not bars:
        ax.set_title(f"{title} (no events)", fontsize=9)
        return
    t0 = min(b.start for b in bars) if t0 is None else t0
    end = max(b.end for b in bars) - t0
    devices = sorted({b.device for b in bars})
    rows = 2 if style == "dual" else 1
    ticks, labels = [], []
    for i, d in enumerate(devices):
        base = (len(devices) - 1 - i) * rows
        _draw_device(ax, [b for b in bars if b.device == d], base, style, t0, end or 1.0, show_throttling)
        name = (names or {}).get(d, f"rank {d}")
        if style == "dual":
            ticks += [base + 1.45, base + 0.45]
            labels += [f"{name} compute", f"{name} comm"]
        else:
            ticks.append(base + 0.5)
            labels.append(name)
    if show_completion_time:
        ax.axvline(end, color="red", ls="--", lw=1.2)
        ax.text(end, rows * len(devices) + 0.05, f" {end:.6g}", color="red", fontsize=8, va="bottom")
    ax.set_yticks(ticks, labels, fontsize=7)
    ax.set_ylim(-0.2, rows * len(devices) + 0.4)
    ax.set_xlim(0, end * 1.02 if end else 1)
    ax.set_title(title or f"completion time {end:.6g}", fontsize=9)


def save_gantt(path: str | Path, panels: Sequence[tuple[str, Sequence[Bar]]], *,
               names: Mapping[int, str] | None = None, style: str = "dual", xlabel: str = "seconds",
               show_throttling: bool = False, show_completion_time: bool = False) -> Path:
    """Stack panels (e.g. measured over predicted) sharing the time axis, one legend below."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    rows = (2 if style == "dual" else 1) * sum(len({b.device for b in bars}) or 1 for _, bars in panels)
    span = max((b.end - min(x.start for x in bars) for _, bars in panels for b in bars), default=0.0)
    fig, axes = plt.subplots(len(panels), 1, figsize=(max(8.0, min(24.0, span / 2 + 6)), 0.45 * rows + 1.5),
                             sharex=True, squeeze=False)
    for ax, (title, bars) in zip(axes[:, 0], panels):
        draw(ax, bars, title, names=names, style=style, show_throttling=show_throttling,
             show_completion_time=show_completion_time)
    axes[-1, 0].set_xlabel(xlabel)
    kinds = {b.kind for _, bars in panels for b in bars if b.end > b.start}
    handles = [Patch(color=c, label=LABELS[k]) for k, c in COLOURS.items() if k in kinds]
    if show_throttling:
        handles.append(Patch(facecolor="white", edgecolor="red", label="throttled"))
    fig.tight_layout()
    fig.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=min(len(handles), 5) or 1,
               fontsize=7)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return out
