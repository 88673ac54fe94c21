"""The ``links`` comm model: contention-free FIFO links, every task at full speed.

Every directed link (src, dst) carries one transfer at a time, in the order the sender
posts them, each for its full-speed duration; compute never slows down; a rank's
all-reduces run one after another (the core's queue). This is exactly :func:`.replay`'s
pricing, the one the planner ranks plans with. Nothing here ever changes a rate, so every
task's finish is known when it starts and ``settle`` is never needed; compute is left
to the core (full speed).
"""
from __future__ import annotations

import heapq

from .core import CommHooks, Run


def links_hooks(run: Run) -> CommHooks:
    c = run.c
    dur, fin, heap, start = run.dur, run.fin, run.heap, run.start
    peer, members_of = c.peer, c.coll_members
    link_free: dict[tuple[int, int], float] = {}
    push = heapq.heappush

    def post_send(a: int, ri: int, now: float) -> None:
        key = (ri, peer[a])
        s = link_free.get(key, 0.0)
        if s < now:
            s = now
        e = s + dur[a]
        link_free[key] = e
        start[a] = s
        fin[a] = e
        push(heap, (e, a))

    def start_collective(ci: int, now: float) -> None:
        k = members_of[ci][0]
        e = now + dur[k]
        fin[k] = e
        push(heap, (e, k))

    def never(now: float) -> None:
        raise RuntimeError("the links model never marks a channel dirty")

    return CommHooks(None, post_send, start_collective, None, None, never)
