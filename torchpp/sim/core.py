"""The stepping core: per-rank cursors over the action lists and a heap of predicted finishes.

Each rank runs its list in order. A compute action occupies the rank until it finishes; a
send is posted and the rank moves on; a receive waits for its message; an all-reduce is
queued (a rank's all-reduces run one after another) and starts when its last member
arrives; the optimizer step waits for the rank's outstanding all-reduces. *How long* compute
and communication take is the comm model's business (:mod:`.links`, :mod:`.shared`): it
starts tasks, pushes their predicted finish on the heap and, when a rate changes, pushes a
new one (``fin[k]`` holds the current prediction, so an older heap entry is skipped).

The core and the model share the arrays of :class:`Run` and talk through :class:`CommHooks`.
Hooks are closures over those arrays, not methods: a closure reads its cells faster than a
method reads attributes, and a sweep prices thousands of configurations on this loop.
"""
from __future__ import annotations

import heapq
from collections import deque
from typing import Callable, NamedTuple

from .compiled import AR, OPT, RA, RG, SA, SG, Compiled


class Run:
    """The state of one pricing run, indexed by action or by rank position (``ri``)."""

    __slots__ = ("c", "dur", "pc", "reached", "start", "end", "ready", "sent", "waiting", "coll_q", "arrived",
                 "coll_t0", "opt_wait", "fin", "heap", "dirty", "wake", "events")

    def __init__(self, c: Compiled, dur: list[float]):
        A, R, C = len(c.code), len(c.ranks), len(c.coll_members)
        self.c, self.dur = c, dur
        self.pc = [0] * R
        """Per rank: index in its list of the next action to run."""
        self.reached = [0.0] * R
        """Per rank: when its cursor reached the current position (a receive's start)."""
        self.start, self.end, self.ready = [0.0] * A, [0.0] * A, [0.0] * A
        self.sent = [-1.0] * A
        """Per send: when its message arrived (-1 until then)."""
        self.waiting = [-1] * A
        """Per send: the rank position blocked on its receive, or -1."""
        self.coll_q: list[deque[int]] = [deque() for _ in range(R)]
        self.arrived, self.coll_t0 = [0] * C, [0.0] * C
        self.opt_wait = [False] * R
        self.fin = [-1.0] * A
        """Predicted finish of a task on the heap; -2 once finished."""
        self.heap: list[tuple[float, int]] = []
        self.dirty: set[int] = set()
        """Rank positions whose comm channel changed since the model last settled."""
        self.wake: list[int] = []
        self.events = 0


class CommHooks(NamedTuple):
    """What a comm model does at each step of the core (``now`` is the current time)."""

    start_compute: Callable[[int, int, float], None] | None
    """(action, rank position, now): the rank starts a compute action. None: compute always
    runs at full speed, so the core pushes ``now + duration`` itself."""
    post_send: Callable[[int, int, float], None]
    """(action, rank position, now): the rank posts a send (the hook sets its start)."""
    start_collective: Callable[[int, float], None]
    """(collective, now): the last member arrived."""
    send_done: Callable[[int, int], None] | None
    """(action, rank position) of a finished send; None: nothing to do."""
    member_done: Callable[[int, int], None] | None
    """(member action, its rank position): one member of a finished all-reduce."""
    settle: Callable[[float], None]
    """Called with ``Run.dirty`` non-empty before the next event is taken: re-divide channels."""


def step(run: Run, hooks: CommHooks) -> None:
    """Advance every rank to the end of its list (or until stuck: see ``check_finished``).

    Every task finishing at the same time is finished before any rank moves on or any
    channel is re-divided (a re-division in between would re-rate a task with nothing left).
    The finish of a task is written out in the loop: it runs once per event.
    """
    c = run.c
    code, owner, match, coll, members_of = c.code, c.owner, c.match, c.coll, c.coll_members
    pc, reached, start, end, ready, sent = run.pc, run.reached, run.start, run.end, run.ready, run.sent
    waiting, coll_q, coll_t0, opt_wait = run.waiting, run.coll_q, run.coll_t0, run.opt_wait
    heap, fin, dirty, wake = run.heap, run.fin, run.dirty, run.wake
    send_done, member_done, settle = hooks.send_done, hooks.member_done, hooks.settle
    run_rank, arrive = _cursor(run, hooks)
    pop = heapq.heappop
    for ri in range(len(pc)):
        run_rank(ri, 0.0)
    now = 0.0
    events = 0
    while True:
        if dirty:
            settle(now)
        if not heap:
            break
        t, k = pop(heap)
        if fin[k] != t:
            continue
        now = t
        events += 1
        while True:  # finish k, then every other task due now
            fin[k] = -2.0
            kk = code[k]
            ri = owner[k]
            if kk <= OPT:
                end[k] = now
                pc[ri] += 1
                reached[ri] = now
                wake.append(ri)
            elif kk == SA or kk == SG:
                end[k] = ready[k] = sent[k] = now
                if send_done is not None:
                    send_done(k, ri)
                w = waiting[k]
                if w >= 0:
                    rv = match[k]
                    start[rv], end[rv], ready[rv] = reached[w], now, now
                    pc[w] += 1
                    reached[w] = now
                    wake.append(w)
            else:
                ci = coll[k]
                for m in members_of[ci]:
                    mi = owner[m]
                    end[m], ready[m] = now, coll_t0[ci]
                    if member_done is not None:
                        member_done(m, mi)
                    q = coll_q[mi]
                    q.popleft()
                    if q:
                        start[q[0]] = now
                        arrive(mi, now)
                    elif opt_wait[mi]:
                        opt_wait[mi] = False
                        wake.append(mi)
            while heap and heap[0][0] <= now:
                t, k = pop(heap)
                if fin[k] == t:
                    break
            else:
                break
        while wake:
            run_rank(wake.pop(), now)
    run.events = events


def _cursor(run: Run, hooks: CommHooks) -> tuple[Callable[[int, float], None], Callable[[int, float], None]]:
    """``run_rank(ri, now)`` moves a rank's cursor as far as it can go; ``arrive(ri, now)``
    counts the rank in at the all-reduce at the head of its queue."""
    c = run.c
    code, match, coll, members_of, prog = c.code, c.match, c.coll, c.coll_members, c.prog
    pc, reached, start, end, ready, dur = run.pc, run.reached, run.start, run.end, run.ready, run.dur
    sent, waiting, coll_q, arrived, coll_t0 = run.sent, run.waiting, run.coll_q, run.arrived, run.coll_t0
    opt_wait, fin, heap = run.opt_wait, run.fin, run.heap
    start_compute, post_send, start_collective = hooks.start_compute, hooks.post_send, hooks.start_collective
    push = heapq.heappush

    def arrive(ri: int, now: float) -> None:
        ci = coll[coll_q[ri][0]]
        arrived[ci] += 1
        if arrived[ci] == len(members_of[ci]):
            coll_t0[ci] = now
            start_collective(ci, now)

    def run_rank(ri: int, now: float) -> None:
        p = prog[ri]
        n = len(p)
        i = pc[ri]
        while i < n:
            a = p[i]
            k = code[a]
            if k <= OPT:
                if k == OPT and coll_q[ri]:
                    opt_wait[ri] = True
                    break
                start[a] = now
                if start_compute is None:
                    e = now + dur[a]
                    fin[a] = e
                    push(heap, (e, a))
                else:
                    start_compute(a, ri, now)
                break
            if k == SA or k == SG:
                post_send(a, ri, now)
            elif k == RA or k == RG:
                s = match[a]
                if sent[s] < 0:
                    waiting[s] = ri
                    break
                start[a], end[a], ready[a] = reached[ri], max(reached[ri], sent[s]), sent[s]
            else:
                coll_q[ri].append(a)
                start[a] = now
                if len(coll_q[ri]) == 1:
                    arrive(ri, now)
            i += 1
            reached[ri] = now
        pc[ri] = i

    return run_rank, arrive
