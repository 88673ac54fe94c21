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

Where the cost model says hosts' interfaces are shared (``nic_s``: the probe's fan-out and fan-in
rates), a transfer also waits for its sender's uplink and its receiver's downlink
(:func:`through_nics`): a 10 Mbit/s Pi that sends a gradient back and an activation on at once
sends them one after the other.
"""
from __future__ import annotations

import heapq

from .compiled import OPT, RA, RG, SA, SG, Compiled
from .core import CommHooks, Run


def transfer(link_free: dict[tuple[int, int], float], key: tuple[int, int], now: float, d: float,
             bucket: tuple[float, float] | None) -> tuple[float, float]:
    """(start, arrival) of a send of ``d`` seconds posted at ``now`` on link ``key``, whose FIFO frees
    at ``link_free[key]`` (updated); ``bucket``: (its depth, what a full one takes off), or None."""
    s = link_free.get(key, 0.0)
    if s < now:
        s = now
    e = s + d
    link_free[key] = e
    if bucket is not None and bucket[0] > 0.0:
        depth, take = bucket
        e = max(now + d - take, e - depth, now)  # never before it was sent (rounding)
        s = max(now, e - d)
    return s, e


def through_nics(nic_free: list[float], s: float, e: float, d: float, take: float,
                 nic: tuple[int, float, int, float]) -> tuple[float, float]:
    """(start, arrival) of a transfer that its link alone would carry from ``s`` to ``e`` (``d``
    seconds at the link's rate, ``take`` of them passed at once if its bucket was full), held
    back by its sender's uplink and its receiver's downlink: each interface is a FIFO that a
    transfer holds for its bytes at the interface's rate (``nic``: uplink, seconds on it,
    downlink, seconds on it). An interface that was idle at ``s`` passes the transfer as its
    link does (rested: the burst too); a busy one starts it when its earlier transfers are
    through. Two sends posted together on an uplink of one link's rate arrive ``d`` and ``2d``
    later; on an uplink of twice that rate both arrive after ``d``."""
    up, x_up, down, x_down = nic
    for i, x in ((up, x_up), (down, x_down)):
        if x > 0.0:
            f = nic_free[i]
            done = f + x if f > s else s + x - take
            nic_free[i] = done
            if done > e:
                e = done
    return max(s, e - d), e


def links_hooks(run: Run, burst: list[tuple[float, float]] | None = None,
                nic: list[tuple[int, float, int, float]] | None = None) -> CommHooks:
    """``burst``: per send, (its link's bucket, what a full one takes off it) in seconds, or None;
    ``nic``: per send, its interfaces and the seconds it holds each (``compiled.nics``), or None.
    Interfaces are shared by sends of different ranks, so they need the core's time order: the
    list-by-list walk (:func:`replay_links`) is for models without them."""
    c = run.c
    dur, fin, heap, start = run.dur, run.fin, run.heap, run.start
    peer, members_of = c.peer, c.coll_members
    link_free: dict[tuple[int, int], float] = {}
    nic_free = [0.0] * (1 + max((max(n[0], n[2]) for n in nic), default=0)) if nic is not None else []
    push = heapq.heappush

    def post_send(a: int, ri: int, now: float) -> None:
        b = None if burst is None else burst[a]
        s, e = transfer(link_free, (ri, peer[a]), now, dur[a], b)
        if nic is not None:
            s, e = through_nics(nic_free, s, e, dur[a], 0.0 if b is None or b[0] <= 0.0 else b[1], nic[a])
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


def replay_links(c: Compiled, dur: list[float], burst: list[tuple[float, float]] | None = None
                 ) -> tuple[list[float], list[float], list[float], list[int]]:
    """The ``links`` model's run without the event heap: (start, end, ready, cursor per rank).

    Nothing in this model depends on the order in which simultaneous events are handled: a
    link's transfers queue in its sender's list order, a rank's all-reduces in its own list order,
    and every time is a max or a sum of earlier ones. So each rank's list is walked once, a
    rank pausing only where it needs a time not known yet (a receive whose send its peer has not
    posted, the optimizer step before the rank's all-reduces are priced) and resuming when it is:
    the same numbers as the core's event loop (``tests/test_sim_links_walk.py`` holds them equal
    bit for bit), for a fraction of its cost (a search prices thousands of plans this way).
    A rank left stopped before its list's end is a deadlock (``compiled.check_finished``)."""
    w = _Walk(c, dur, burst)
    _walk(w)
    return w.start, w.end, w.ready, w.pc


class _Walk:
    """The state of one walk, indexed by action or by rank position."""

    __slots__ = ("c", "dur", "burst", "start", "end", "ready", "sent", "waiting", "t", "pc", "queue", "head", "left",
                 "t0", "last_end", "at_opt", "runnable")

    def __init__(self, c: Compiled, dur: list[float], burst: list[tuple[float, float]] | None):
        A, R = len(c.code), len(c.prog)
        self.c, self.dur, self.burst = c, dur, burst
        self.start, self.end, self.ready = [0.0] * A, [0.0] * A, [0.0] * A
        self.sent = [-1.0] * A
        """Per send: when its message arrives (-1 until its sender posts it)."""
        self.waiting = [-1] * A
        """Per send: the rank stopped at its receive, or -1."""
        self.t, self.pc = [0.0] * R, [0] * R
        """Per rank: where its cursor is, and when it got there."""
        # all-reduces: each rank's queue in list order; a member arrives when its rank reached it and
        # the rank's previous all-reduce ended; a collective starts when its last member arrives
        self.queue: list[list[int]] = [[] for _ in range(R)]
        self.head = [0] * R
        """Per rank: index in ``queue`` of its first all-reduce not yet ended."""
        self.left = [len(m) for m in c.coll_members]
        self.t0 = [0.0] * len(c.coll_members)
        self.last_end = [0.0] * R
        """Per rank: when its latest ended all-reduce ended."""
        self.at_opt = [False] * R
        self.runnable = list(range(R))


def _arrive(w: _Walk, a: int, when: float) -> None:
    """All-reduce member ``a`` arrives at ``when``; a collective whose members are all in is priced,
    and each member's next all-reduce arrives in turn."""
    coll, members_of, owner, start = w.c.coll, w.c.coll_members, w.c.owner, w.start
    todo = [(a, when)]
    while todo:
        a, when = todo.pop()
        start[a] = when
        ci = coll[a]
        if when > w.t0[ci] or w.left[ci] == len(members_of[ci]):
            w.t0[ci] = when
        w.left[ci] -= 1
        if w.left[ci]:
            continue
        s = w.t0[ci]
        e = s + w.dur[members_of[ci][0]]
        for m in members_of[ci]:
            w.end[m], w.ready[m] = e, s
            ri = owner[m]
            q = w.queue[ri]
            w.head[ri] += 1
            w.last_end[ri] = e
            if w.head[ri] < len(q):  # the rank's next all-reduce was waiting behind this one
                nxt = q[w.head[ri]]
                todo.append((nxt, start[nxt] if start[nxt] > e else e))
            elif w.at_opt[ri]:
                w.at_opt[ri] = False
                w.runnable.append(ri)


def _walk(w: _Walk) -> None:
    """Move every rank's cursor as far as it goes, until none can move."""
    c = w.c
    code, peer, match, prog, dur, burst = c.code, c.peer, c.match, c.prog, w.dur, w.burst
    start, end, ready, sent, waiting, runnable = w.start, w.end, w.ready, w.sent, w.waiting, w.runnable
    queue, head, last_end = w.queue, w.head, w.last_end
    link_free: dict[tuple[int, int], float] = {}
    while runnable:
        ri = runnable.pop()
        p = prog[ri]
        n = len(p)
        i = w.pc[ri]
        now = w.t[ri]
        while i < n:
            a = p[i]
            k = code[a]
            if k < OPT:
                start[a] = now
                now = now + dur[a]
                end[a] = now
            elif k == OPT:
                if head[ri] < len(queue[ri]):
                    w.at_opt[ri] = True
                    break
                if last_end[ri] > now:
                    now = last_end[ri]
                start[a] = now
                now = now + dur[a]
                end[a] = now
            elif k == SA or k == SG:
                s, e = transfer(link_free, (ri, peer[a]), now, dur[a], None if burst is None else burst[a])
                start[a], end[a], ready[a], sent[a] = s, e, e, e
                if waiting[a] >= 0:
                    runnable.append(waiting[a])
                    waiting[a] = -1
            elif k == RA or k == RG:
                e = sent[match[a]]
                if e < 0.0:
                    waiting[match[a]] = ri
                    break
                start[a], ready[a] = now, e
                if e > now:
                    now = e
                end[a] = now
            else:  # an all-reduce: queued behind the rank's earlier ones, the rank goes on
                q = queue[ri]
                q.append(a)
                start[a] = now
                if head[ri] == len(q) - 1:
                    _arrive(w, a, now if now > last_end[ri] else last_end[ri])
            i += 1
        w.t[ri], w.pc[ri] = now, i
