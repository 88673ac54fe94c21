"""The original's comm channel rules: its three tiers and its receiver-congestion repetition.

Kept apart from :mod:`torchpp.sim.tiers` and :mod:`torchpp.sim.congestion` on purpose: these
reproduce the original's arithmetic and its fixed number of repetitions step for step (a
throttled share is divided by the total, not scaled to a capacity; only the middle gpus are
receivers; the loop runs ``2 * G`` times whether or not anything is still over).
"""
from __future__ import annotations

from typing import Callable

from ..model import COMM_TYPES, Priorities
from .tasks import FPROP, GPROP, SYNC

EPS = 1e-9
_TYPE_ORDER = {FPROP: 0, GPROP: 1, SYNC: 2}

Allocate = Callable[[list[int], float, dict[int, float]], None]


def make_allocate(priorities: Priorities, typ: list[int], mb: list[int]) -> Allocate:
    """``allocate(tasks, budget, alloc)``: exclusive letter, shared proportional, zero-priority equal split."""
    tier: list[str | None] = [None] * 5
    prio = [0.0] * 5
    for name, t in zip(COMM_TYPES, (FPROP, GPROP, SYNC)):
        tier[t] = priorities.exclusive.get(name)
        prio[t] = priorities.shared.get(name, 0.0)

    def allocate(tasks: list[int], budget: float, alloc: dict[int, float]) -> None:
        if not tasks or budget <= 0:
            return
        excl = [k for k in tasks if tier[typ[k]] is not None]
        if excl:
            k = min(excl, key=lambda k: (tier[typ[k]], mb[k], _TYPE_ORDER[typ[k]]))
            alloc[k] = budget
            return
        shared = [k for k in tasks if prio[typ[k]] > EPS]
        if shared:
            count: dict[int, int] = {}
            for k in shared:
                count[typ[k]] = count.get(typ[k], 0) + 1
            tot = sum(prio[t] for t in count)
            for k in shared:
                alloc[k] = budget * (prio[typ[k]] / tot) / count[typ[k]]
            return
        share = budget / len(tasks)
        for k in tasks:
            alloc[k] = share

    return allocate


def congest(alloc: dict[int, float], ready_comm: list[list[int]], typ: list[int], allocate: Allocate,
            throttled: list[bool]) -> None:
    """The original's receiver congestion on ``alloc`` (in place): ``2 * G`` rounds of
    scaling each middle gpu's inbound sends to a total of 1 and re-dividing their channels."""
    G = len(ready_comm)
    fixed: set[int] = set()
    for _ in range(2 * G):
        for r in range(1, G - 1):
            incoming = [k for k in ready_comm[r - 1] if typ[k] == FPROP]
            incoming += [k for k in ready_comm[r + 1] if typ[k] == GPROP]
            incoming = [k for k in incoming if alloc.get(k, 0.0) > 0]
            total = sum(alloc.get(k, 0.0) for k in incoming)
            if total > 1.0:
                for k in incoming:
                    alloc[k] = alloc.get(k, 0.0) / total
                    fixed.add(k)
                    throttled[k] = True
        for j in range(G):
            tasks = ready_comm[j]
            if not tasks:
                continue
            used = sum(alloc.get(k, 0.0) for k in tasks if k in fixed)
            free = [k for k in tasks if k not in fixed]
            for k in free:
                alloc.pop(k, None)
            allocate(free, 1.0 - used, alloc)
