"""Gantt charts of pipeline timelines (measured or predicted) as PNG."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

from .analyze import Event

COLORS = {"F": "#4c72b0", "B": "#55a868", "send_act": "#c44e52", "recv_act": "#e8a0a2",
          "send_grad": "#8172b2", "recv_grad": "#c0b6e0", "allreduce": "#ccb974", "optimizer": "#64b5cd"}
# compute row and comm row per rank: sends live on their own row, as in the trace threads
_ROW = {"F": 0, "B": 0, "optimizer": 0, "recv_act": 0, "recv_grad": 0, "allreduce": 0,
        "send_act": 1, "send_grad": 1}


def draw(ax, events: Sequence[Event], title: str, t0: float | None = None, label_mb: bool = True) -> None:
    """One panel: a compute row and a send row per rank, micro-batch numbers on F/B bars."""
    if not events:
        ax.set_title(f"{title} (no events)")
        return
    t0 = min(e.start for e in events) if t0 is None else t0
    ranks = sorted({e.rank for e in events})
    ypos = {r: i for i, r in enumerate(ranks)}
    for e in events:
        y = ypos[e.rank] * 2.2 + _ROW.get(e.kind, 0)
        ax.barh(y, e.dur, left=e.start - t0, height=0.9 if _ROW.get(e.kind, 0) == 0 else 0.5,
                color=COLORS.get(e.kind, "#999999"), edgecolor="black", linewidth=0.2)
        if label_mb and e.kind in ("F", "B") and e.microbatch is not None:
            ax.text(e.start - t0 + e.dur / 2, y, str(e.microbatch), ha="center", va="center", fontsize=6,
                    color="white")
    stage = {e.rank: e.stage for e in events}
    ax.set_yticks([ypos[r] * 2.2 for r in ranks])
    ax.set_yticklabels([f"rank {r} · s{stage[r]}" for r in ranks], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    ax.set_title(title, fontsize=9)


def save_gantt(path: str | Path, panels: Sequence[tuple[str, Sequence[Event]]], xmax: float | None = None) -> Path:
    """Stack panels (e.g. measured over predicted) sharing the time axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    n_ranks = max((len({e.rank for e in ev}) for _, ev in panels), default=1)
    fig, axes = plt.subplots(len(panels), 1, figsize=(12, 1.0 + 0.55 * n_ranks * len(panels)), sharex=True,
                             squeeze=False)
    for ax, (title, ev) in zip(axes[:, 0], panels):
        draw(ax, ev, title)
    if xmax:
        axes[0, 0].set_xlim(0, xmax)
    kinds = sorted({e.kind for _, ev in panels for e in ev}, key=list(COLORS).index)
    fig.legend(handles=[Patch(color=COLORS[k], label=k) for k in kinds], loc="upper right", fontsize=7, ncol=4)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
