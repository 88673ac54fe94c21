"""Max-min fair rates of transfers sharing resources (progressive filling).

A *task* is a bundle of flows that all advance at one rate (a send is one flow; a ring
all-reduce is ``n`` flows paced by its slowest); ``usage[t]`` lists ``(resource, flows)``:
how many of its flows cross each resource, so the task at rate ``x`` puts ``flows · x`` on
it. Every resource's load stays within its capacity, and no task can go faster without
slowing one that is no faster than it (max-min fairness, what TCP-like sharing approaches).
A task that crosses nothing (a transfer within a host) is unbounded: ``inf``.
"""
from __future__ import annotations

from typing import Iterable, Sequence

Usage = Sequence[tuple[int, float]]


def maxmin(tasks: Iterable[int], usage: Sequence[Usage], capacity: Sequence[float]) -> dict[int, float]:
    """Rate of each task in ``tasks`` (bytes/s per flow)."""
    rate: dict[int, float] = {}
    left: dict[int, float] = {}
    load: dict[int, float] = {}
    users: dict[int, list[tuple[int, float]]] = {}
    open_: set[int] = set()
    for t in tasks:
        u = usage[t]
        if not u:
            rate[t] = float("inf")
            continue
        open_.add(t)
        for r, c in u:
            if r not in left:
                left[r], load[r], users[r] = capacity[r], 0.0, []
            load[r] += c
            users[r].append((t, c))
    while open_:
        level, tight = float("inf"), []
        for r, ld in load.items():
            if ld > 1e-12:
                x = left[r] / ld
                if x < level * (1 - 1e-12):
                    level, tight = x, [r]
                elif x <= level * (1 + 1e-12):
                    tight.append(r)
        level = max(level, 0.0)
        for r in tight:
            for t, _c in users[r]:
                if t in open_:
                    open_.discard(t)
                    rate[t] = level
                    for r2, c2 in usage[t]:
                        left[r2] -= c2 * level
                        load[r2] -= c2
    return rate
