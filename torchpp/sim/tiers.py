"""How one rank's comm channel is divided among its ready transfers: the three tiers.

1. Exclusive: if any entry's comm type has a tier letter, the best one ('a' before 'b',
   then the lower micro-batch, then fwd_prop < grad_prop < grad_sync) takes the whole budget.
2. Proportional: the types with a shared priority above ``ZERO_PRIORITY`` split the budget
   in proportion to their priorities, equally among the entries of one type.
3. Zero priority: if no entry has a priority, all split the budget equally.
"""
from __future__ import annotations

from typing import Callable

from .model import COMM_TYPES, ZERO_PRIORITY, Priorities

Allocate = Callable[[list[int], float, list[float]], None]
"""(entries, budget, out): write each entry's share of ``budget`` into ``out[entry]``."""


def make_allocate(priorities: Priorities, ctype: list[int], mbkey: list[int]) -> Allocate:
    """The three tiers for these priorities; ``ctype``/``mbkey`` give each entry's type and micro-batch."""
    fwd, grad, sync = COMM_TYPES  # written out: this runs once per priced configuration
    ex, sh = priorities.exclusive, priorities.shared
    tier = (ex.get(fwd), ex.get(grad), ex.get(sync))
    prio = (sh.get(fwd, 0.0), sh.get(grad, 0.0), sh.get(sync, 0.0))
    any_tier = tier != (None, None, None)
    zero = ZERO_PRIORITY

    def allocate(tasks: list[int], budget: float, out: list[float]) -> None:
        n = len(tasks)
        if n == 1:
            out[tasks[0]] = budget
            return
        if any_tier:
            best = None
            for m in tasks:
                t = tier[ctype[m]]
                if t is not None:
                    key = (t, mbkey[m], ctype[m])
                    if best is None or key < best:
                        best, bm = key, m
            if best is not None:
                for m in tasks:
                    out[m] = 0.0
                out[bm] = budget
                return
        c0 = c1 = c2 = 0
        for m in tasks:
            t = ctype[m]
            if t == 0:
                c0 += 1
            elif t == 1:
                c1 += 1
            else:
                c2 += 1
        p0 = prio[0] if c0 and prio[0] > zero else 0.0
        p1 = prio[1] if c1 and prio[1] > zero else 0.0
        p2 = prio[2] if c2 and prio[2] > zero else 0.0
        tot = p0 + p1 + p2
        if tot > 0:
            each = (budget * p0 / tot / c0 if p0 else 0.0, budget * p1 / tot / c1 if p1 else 0.0,
                    budget * p2 / tot / c2 if p2 else 0.0)
            for m in tasks:
                out[m] = each[ctype[m]]
            return
        e = budget / n
        for m in tasks:
            out[m] = e

    return allocate
