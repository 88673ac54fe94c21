"""The original's task graph: five task types per (micro-batch, gpu) and their dependencies.

Forward and backward on every gpu, an activation send (``fwd_prop``) from every gpu but the
last, a gradient send (``grad_prop``) from every gpu but the first, and a gradient sync
after every ``sync_freq`` backward passes (the last one carrying what is left). The
dependencies are the original's 1F1B: gpu 0 admits ``G`` forwards before its first
backward, the last gpu alternates forward and backward.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..model import TASK_TYPES

FWD, BWD, FPROP, GPROP, SYNC = range(5)


@dataclass
class TaskGraph:
    """Tasks in the original's creation order (gpu by gpu, micro-batch by micro-batch)."""

    names: list[tuple[str, int, int]] = field(default_factory=list)
    """(type, microbatch, gpu) of every task."""
    typ: list[int] = field(default_factory=list)
    gpu: list[int] = field(default_factory=list)
    mb: list[int] = field(default_factory=list)
    need: list[float] = field(default_factory=list)
    """Work of each task (its length; a sync's length times the backward passes it carries)."""
    index: dict[tuple[int, int, int], int] = field(default_factory=dict)
    waiting: list[int] = field(default_factory=list)
    """Unfinished dependencies of each task."""
    dependents: list[list[int]] = field(default_factory=list)

    def add(self, t: int, i: int, j: int, work: float) -> None:
        self.index[(t, i, j)] = len(self.typ)
        self.names.append((TASK_TYPES[t], i, j))
        self.typ.append(t)
        self.gpu.append(j)
        self.mb.append(i)
        self.need.append(float(work))


def build_tasks(G: int, n: int, sync_freq: int, lengths: dict[str, float]) -> TaskGraph:
    g = TaskGraph()
    for j in range(G):
        for i in range(n):
            g.add(FWD, i, j, lengths["forward"])
            g.add(BWD, i, j, lengths["backward"])
            if j < G - 1:
                g.add(FPROP, i, j, lengths["fwd_prop"])
            if j > 0:
                g.add(GPROP, i, j, lengths["grad_prop"])
            if (i + 1) % sync_freq == 0:
                g.add(SYNC, i, j, lengths["grad_sync"] * sync_freq)
            elif i == n - 1:
                g.add(SYNC, i, j, lengths["grad_sync"] * (n % sync_freq))
    deps = _dependencies(g.index, G, sync_freq)
    g.waiting = [len(d) for d in deps]
    g.dependents = [[] for _ in deps]
    for k, d in enumerate(deps):
        for x in d:
            g.dependents[x].append(k)
    return g


def _dependencies(index: dict[tuple[int, int, int], int], G: int, sync_freq: int) -> list[list[int]]:
    deps: list[list[int]] = [[] for _ in range(len(index))]
    for (t, i, j), k in index.items():
        d = deps[k]
        if t == FWD:
            if j == 0:
                if i > 0:
                    d.append(index[(FWD, i - 1, 0)] if i < G else index[(BWD, i - G, 0)])
            else:
                d.append(index[(FPROP, i, j - 1)])
                if j == G - 1 and i > 0:
                    d.append(index[(BWD, i - 1, G - 1)])
        elif t == BWD:
            d.append(index[(FWD, i, j)])
            if j < G - 1:
                d.append(index[(GPROP, i, j + 1)])
        elif t == FPROP:
            d.append(index[(FWD, i, j)])
        elif t == GPROP:
            d.append(index[(BWD, i, j)])
        else:
            d.append(index[(BWD, i, j)])
            prev = index.get((SYNC, i - sync_freq, j))
            if prev is not None:
                d.append(prev)
    return deps
