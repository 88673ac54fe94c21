"""The ``links`` comm model: contention-free FIFO links, every task at full speed.

Every directed link (src, dst) carries one transfer at a time, in the order the sender
posts them, each for its full-speed duration; compute never slows down; a rank's
all-reduces run one after another (the core's queue). This is exactly :func:`.replay`'s
pricing, the one the planner ranks plans with. Nothing here ever changes a rate, so every
task's finish is known when it starts and ``settle`` is never needed; compute is left
to the core (full speed).

Where the cost model prices bursts (``compiled.bursts``), each link is a token bucket: a link
keeps ``V``, when its FIFO at full rate would drain (the bucket is full again then); a send of
duration ``d`` posted at ``t`` makes ``V' = max(V, t) + d`` and arrives at ``max(t + d − take,
V' − depth)``: a rested link passes the first ``depth`` seconds' worth at once, a busy one
only what it refilled since. The fluid token bucket, exactly; without bursts, ``V'`` itself.
"""
from __future__ import annotations

import heapq

from .core import CommHooks, Run


def links_hooks(run: Run, burst: list[tuple[float, float]] | None = None) -> CommHooks:
    """``burst``: per send, (its link's bucket, what a full one takes off it) in seconds, or None."""
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
        d = dur[a]
        e = s + d
        link_free[key] = e
        if burst is not None:
            depth, take = burst[a]
            if depth > 0.0:
                e = max(now + d - take, e - depth)
                s = max(now, e - d)
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
