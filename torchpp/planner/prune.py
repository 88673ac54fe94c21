"""Lower bounds on a layout's priced step, known before it is built or priced, so the search can
skip layouts that cannot win.

A rank's compute actions run one after another in the replay (one compute thread per rank), so
a step is at least the busiest rank's compute. Over a group holding b samples of every
micro-batch, with any shares of at least one sample each, the busiest device computes at least
``b / Σ_d 1/τ_d`` per micro-batch (τ_d: its seconds per sample, nothing recomputed: recomputation
only adds) plus its seconds per call, at least the group's smallest; m micro-batches pass. A
layout whose bound is not below the step it would have to beat (the best priced step, or the
current step of a local search) is never priced: the search's answer is unchanged.

Where the backward is not split, a step is also at least one sample's path: its forward through
every chunk in pipeline order, then its backward back, each on one device of the chunk's group,
that device computing at least this sample (all b of them where the group is one device).
"""
from __future__ import annotations

from typing import Sequence

from .tables import Tables


def group_bound(t: Tables, group: Sequence[int], cuts: Sequence[tuple[int, int]], b: int, m: int) -> float:
    """Least compute seconds of a step on the busiest device of ``group`` holding chunks ``cuts``
    (kept in the tables' memo: layouts one move apart share most of their groups)."""
    key = ("bound", tuple(group), tuple(cuts), b, m)
    got = t.memo.get(key)
    if got is None:
        got = t.memo[key] = _group_bound(t, group, cuts, b, m)
    return got


def _group_bound(t: Tables, group: Sequence[int], cuts: Sequence[tuple[int, int]], b: int, m: int) -> float:
    per_sample = [sum(float(t.tau[(h, 0)][c]) for c in cuts) for h in group]
    per_call = min(sum(float(t.tau0[(h, 0)][c]) for c in cuts) for h in group)
    # a device whose per-sample time reads 0 (a tiny model all per-call cost) bounds that part by 0
    samples = 0.0 if min(per_sample) <= 0.0 else b / sum(1.0 / x for x in per_sample)
    return m * (samples + per_call)


def path_bound(t: Tables, chunks: Sequence[tuple[tuple[int, int], Sequence[int]]], b: int) -> float:
    """One sample's forward and backward through ``chunks`` (pipeline order), each chunk on the
    device of its group that passes it soonest."""
    total = 0.0
    for c, g in chunks:
        n = b if len(g) == 1 else 1
        total += min(n * float(t.tau[(h, 0)][c]) + float(t.tau0[(h, 0)][c]) for h in g)
    return total


def layout_bound(t: Tables, stages: Sequence[tuple[tuple[int, int], Sequence[int]]], b: int, m: int,
                 split: bool = True) -> float:
    """A one-chunk layout's bound: stages as (layer cut, group of host indices); ``split``: the
    kind splits its backward (no path bound)."""
    busiest = max(group_bound(t, g, [c], b, m) for c, g in stages)
    return busiest if split else max(busiest, path_bound(t, stages, b))


def chunk_bound(t: Tables, groups: Sequence[Sequence[int]], bounds: Sequence[int], position: Sequence[int], b: int,
                m: int, split: bool = True) -> float:
    """A chunked layout's bound: chunk c holds layers [bounds[c], bounds[c+1]) on ``groups[position[c]]``."""
    cuts: list[list[tuple[int, int]]] = [[] for _ in groups]
    for c, g in enumerate(position):
        cuts[g].append((bounds[c], bounds[c + 1]))
    busiest = max(group_bound(t, groups[g], cuts[g], b, m) for g in range(len(groups)) if cuts[g])
    if split:
        return busiest
    return max(busiest, path_bound(t, [((bounds[c], bounds[c + 1]), groups[g]) for c, g in enumerate(position)], b))
