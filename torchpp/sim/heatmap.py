"""One heatmap per environment of a sweep: shared priorities and exclusive tiers in one view.

The left panel is the shared-priority triangle (x: ``p_fwd_prop``, y: ``p_grad_prop``,
``p_grad_sync`` the rest); the two strips on the right are the exclusive scenarios
(``fwd_prop`` exclusive across ``p_grad_prop``, ``grad_prop`` exclusive across ``p_fwd_prop``).
All three share one colour scale, and the best cell of the figure is marked.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np

from ..formats import SIM_PARAMS
from .sweep import PRIORITY_COLUMNS, SETTING_COLUMNS, read_results

ENV_COLUMNS = (*SIM_PARAMS, *SETTING_COLUMNS)


def _num(s: str) -> float | None:
    try:
        return float(s)
    except ValueError:
        return None


def environments(rows: list[dict[str, str]]) -> dict[tuple[str, ...], list[dict[str, str]]]:
    out: dict[tuple[str, ...], list[dict[str, str]]] = {}
    for r in rows:
        out.setdefault(tuple(r[c] for c in ENV_COLUMNS), []).append(r)
    return out


def title_of(env: tuple[str, ...]) -> str:
    d = dict(zip(ENV_COLUMNS, env))
    return (f"{d['policy']} {d['schedule']}, {d['stages']} stages × n={d['n']}, sync_freq={d['sync_freq']}\n"
            f"fwd={d['fwd_len']} bwd={d['bwd_len']} prop={d['prop_len']} sync={d['sync_base_len']} "
            f"impact={d['fwd_impact']}/{d['bwd_impact']} congestion={d['congestion']}")


def file_name(env: tuple[str, ...]) -> str:
    d = dict(zip(ENV_COLUMNS, env))
    parts = [f"{k}{d[k]}" for k in ("stages", "n", "sync_freq", "fwd_len", "bwd_len", "prop_len", "sync_base_len",
                                     "fwd_impact", "bwd_impact")]
    parts += [d["policy"], d["schedule"]] + (["congestion"] if d["congestion"] == "true" else [])
    return "heatmap_" + re.sub(r"[^A-Za-z0-9_.-]", "", "_".join(parts)) + ".png"


def plot_environment(env: tuple[str, ...], rows: list[dict[str, str]], path: str | os.PathLike) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pf, pg, ps = PRIORITY_COLUMNS
    shared = [(_num(r[pf]), _num(r[pg]), float(r["completion_time"])) for r in rows
              if _num(r[pf]) is not None and _num(r[pg]) is not None and _num(r[ps]) is not None]
    fwd_ex = sorted((_num(r[pg]), float(r["completion_time"])) for r in rows if r[pf] == "a")
    grad_ex = sorted((_num(r[pf]), float(r["completion_time"])) for r in rows if r[pg] == "a")
    xs = sorted({x for x, _, _ in shared} | {x for x, _ in grad_ex})
    ys = sorted({y for _, y, _ in shared} | {y for y, _ in fwd_ex})
    grid = np.full((len(ys), len(xs)), np.nan)
    for x, y, t in shared:
        grid[ys.index(y), xs.index(x)] = t
    strip_f = np.full((len(ys), 1), np.nan)
    for y, t in fwd_ex:
        strip_f[ys.index(y), 0] = t
    strip_g = np.full((1, len(xs)), np.nan)
    for x, t in grad_ex:
        strip_g[0, xs.index(x)] = t
    allv = np.concatenate([grid[~np.isnan(grid)], strip_f[~np.isnan(strip_f)], strip_g[~np.isnan(strip_g)]])
    vmin, vmax = (float(allv.min()), float(allv.max())) if allv.size else (0.0, 1.0)
    if vmin == vmax:
        vmax = vmin + 1e-9

    fig = plt.figure(figsize=(8.5, 7.5))
    gs = fig.add_gridspec(2, 3, width_ratios=[len(xs), 1.2, 0.4], height_ratios=[1.2, len(ys)], wspace=0.08,
                          hspace=0.08)
    ax = fig.add_subplot(gs[1, 0])
    ax_f = fig.add_subplot(gs[1, 1], sharey=ax)
    ax_g = fig.add_subplot(gs[0, 0], sharex=ax)
    cax = fig.add_subplot(gs[1, 2])
    kw = dict(cmap="viridis_r", vmin=vmin, vmax=vmax, origin="lower", aspect="auto")
    ext = (-0.5, len(xs) - 0.5, -0.5, len(ys) - 0.5)
    im = ax.imshow(grid, extent=ext, **kw)
    ax_f.imshow(strip_f, extent=(-0.5, 0.5, -0.5, len(ys) - 0.5), **kw)
    ax_g.imshow(strip_g, extent=(-0.5, len(xs) - 0.5, -0.5, 0.5), **kw)
    small = len(xs) * len(ys) <= 144
    for (i, j), t in np.ndenumerate(grid):
        if small and not np.isnan(t):
            ax.text(j, i, f"{t:.4g}", ha="center", va="center", fontsize=6, color="w")
    for i, t in enumerate(strip_f[:, 0]):
        if small and not np.isnan(t):
            ax_f.text(0, i, f"{t:.4g}", ha="center", va="center", fontsize=6, color="w")
    for j, t in enumerate(strip_g[0]):
        if small and not np.isnan(t):
            ax_g.text(j, 0, f"{t:.4g}", ha="center", va="center", fontsize=6, color="w")
    best = min(rows, key=lambda r: float(r["completion_time"]))
    ax.set_xticks(range(len(xs)), [f"{x:g}" for x in xs], fontsize=7)
    ax.set_yticks(range(len(ys)), [f"{y:g}" for y in ys], fontsize=7)
    ax.set_xlabel("p_fwd_prop (shared)")
    ax.set_ylabel("p_grad_prop (shared); p_grad_sync = 1 − both")
    ax_f.set_xticks([0], ["fwd_prop\nexclusive"], fontsize=7)
    ax_f.tick_params(labelleft=False)
    ax_g.set_yticks([0], ["grad_prop\nexclusive"], fontsize=7)
    ax_g.tick_params(labelbottom=False)
    fig.colorbar(im, cax=cax, label="completion time")
    fig.suptitle(title_of(env) + f"\nbest {float(best['completion_time']):.6g} at "
                 f"(fwd_prop, grad_prop, grad_sync) = ({best[pf]}, {best[pg]}, {best[ps]})", fontsize=9)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return out


def plot_heatmaps(csv_path: str | os.PathLike, out_dir: str | os.PathLike) -> list[Path]:
    """One PNG per environment configuration of the sweep CSV."""
    rows = read_results(csv_path)
    return [plot_environment(env, rs, Path(out_dir) / file_name(env)) for env, rs in environments(rows).items()]
