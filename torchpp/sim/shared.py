"""The ``shared`` comm model: one prioritised comm channel per rank, fluid rates between events.

A rank's outgoing transfers (``fwd_prop`` = activations, ``grad_prop`` = gradients) and its
all-reduces (``grad_sync``) share one channel, divided by :mod:`.tiers`. An all-reduce of
``grad_sync`` slows the rank's compute by ``fwd_impact``/``bwd_impact`` times its share
(interference), and with receiver congestion the inbound shares of a rank are throttled to
its capacity (:mod:`.congestion`). With ``ideal_sync`` all-reduces get a channel of their
own and never slow compute.

A channel entry is a *member* action: a send, or one member's all-reduce action; the fluid
task of an all-reduce is its first member and runs at its slowest member's share. Rates are
piecewise constant between events, so a finish time is exact: whenever a task's rate changes
its remaining work is brought up to date and its new finish pushed on the core's heap.
"""
from __future__ import annotations

import heapq
from typing import Callable

from .compiled import AR, compute_impact
from .congestion import make_congest
from .core import CommHooks, Run
from .tiers import Allocate, make_allocate
from .types import SimOptions

SetRate = Callable[[int, float, float], None]


class Channels:
    """The shared model's state next to the core's :class:`Run` (per action or per rank position)."""

    __slots__ = ("rem", "rate", "last", "share", "base", "chan", "schan", "sync_share", "inb", "contrib", "computing",
                 "throttled", "log")

    def __init__(self, run: Run, o: SimOptions, record_rates: bool):
        A, R = len(run.c.code), len(run.c.ranks)
        self.rem, self.rate, self.last = list(run.dur), [0.0] * A, [0.0] * A
        """Work left at ``last``, and the rate since ``last``, of each fluid task (a task is
        started once, at rate 0 with all its work left: ``set_rate`` sets ``last`` from there)."""
        self.share = [0.0] * A
        """Each channel entry's share after congestion."""
        self.base = [0.0] * A
        """... and before it (the three tiers)."""
        self.chan: list[list[int]] = [[] for _ in range(R)]
        self.schan: list[list[int]] = [[] for _ in range(R)] if o.ideal_sync else self.chan
        """Where a rank's all-reduce members go: its comm channel, or their own with ``ideal_sync``."""
        self.sync_share = [0.0] * R
        """Per rank: the channel share its all-reduces hold (what slows its compute)."""
        self.inb = [0.0] * R
        """With congestion: the inbound base share of each rank ..."""
        self.contrib = [0.0] * A
        """... and each send's part of it."""
        self.computing = [-1] * R
        """Per rank: its last compute action started (finished if ``fin`` says -2)."""
        self.throttled: set[int] = set()
        self.log: list[tuple[float, int, float]] | None = [] if record_rates else None


def shared_hooks(run: Run, o: SimOptions, record_rates: bool = False) -> tuple[CommHooks, Channels]:
    """The model plugged into the core for ``run``; its :class:`Channels` hold what the result reports
    (throttled entries, the rate log)."""
    ch = Channels(run, o, record_rates)
    allocate = make_allocate(o.priorities, run.c.ctype, run.c.mbkey)
    set_rate = _make_set_rate(run, ch)
    starts = _task_hooks(run, ch, o)
    return CommHooks(*starts, _make_settle(run, ch, o, allocate, set_rate)), ch


def _make_set_rate(run: Run, ch: Channels) -> SetRate:
    """``set_rate(task, rate, now)``: bring the task's work left up to ``now`` and push its new finish."""
    rem, rate, last, fin, heap, log = ch.rem, ch.rate, ch.last, run.fin, run.heap, ch.log
    push = heapq.heappush

    def set_rate(k: int, new: float, now: float) -> None:
        old = rate[k]
        if new == old:
            return
        if old > 0:
            r = rem[k] - old * (now - last[k])
            rem[k] = r if r > 0 else 0.0
        last[k] = now
        rate[k] = new
        if log is not None:
            log.append((now, k, new))
        if new > 0:
            t = now + rem[k] / new
            fin[k] = t
            push(heap, (t, k))
        else:
            fin[k] = -1.0

    return set_rate


def _task_hooks(run: Run, ch: Channels, o: SimOptions) -> tuple[Callable | None, ...]:
    """start_compute, post_send, start_collective, send_done, member_done.

    A finished task's rate is left as it was: nothing re-rates it (a finished send or
    all-reduce has left its channel; interference skips a ``computing`` entry that finished).
    """
    c = run.c
    code, owner, peer, members_of = c.code, c.owner, c.peer, c.coll_members
    dur, start, dirty, fin, heap, log = run.dur, run.start, run.dirty, run.fin, run.heap, ch.log
    push = heapq.heappush
    rate, last, share, chan, schan = ch.rate, ch.last, ch.share, ch.chan, ch.schan
    sync_share, inb, contrib, computing = ch.sync_share, ch.inb, ch.contrib, ch.computing
    impact = compute_impact(o.fwd_impact, o.bwd_impact)
    interference = not o.ideal_sync and (o.fwd_impact > 0 or o.bwd_impact > 0)

    def start_compute(a: int, ri: int, now: float) -> None:
        # set_rate from a standing start, written out: this runs once per compute action
        computing[ri] = a
        last[a] = now
        new = 1.0 - sync_share[ri] * impact[code[a]] if interference else 1.0
        rate[a] = new
        if log is not None:
            log.append((now, a, new))
        if new > 0:
            t = now + dur[a] / new
            fin[a] = t
            push(heap, (t, a))
        else:
            fin[a] = -1.0

    def post_send(a: int, ri: int, now: float) -> None:
        start[a] = now
        chan[ri].append(a)
        dirty.add(ri)

    def start_collective(ci: int, now: float) -> None:
        for m in members_of[ci]:
            mi = owner[m]
            schan[mi].append(m)
            dirty.add(mi)

    def send_done(k: int, ri: int) -> None:
        chan[ri].remove(k)
        share[k] = 0.0
        if contrib[k]:
            inb[peer[k]] -= contrib[k]
            contrib[k] = 0.0
        dirty.add(ri)

    def member_done(m: int, mi: int) -> None:
        schan[mi].remove(m)
        share[m] = 0.0
        dirty.add(mi)

    # without interference compute always runs at rate 1: the core's full-speed path is exact
    return start_compute if interference else None, post_send, start_collective, send_done, member_done


def _make_settle(run: Run, ch: Channels, o: SimOptions, allocate: Allocate,
                 set_rate: SetRate) -> Callable[[float], None]:
    """Re-divide the channels of the dirty ranks and update every rate that changed.

    Runs once per event, so the common path (no receiver over capacity) is written out here;
    only a congested step goes through :func:`_make_congestion`.
    """
    c = run.c
    code, peer, coll, members_of, task_of = c.code, c.peer, c.coll, c.coll_members, c.task_of
    dirty, fin = run.dirty, run.fin
    share, base, chan, schan = ch.share, ch.base, ch.chan, ch.schan
    inb, contrib, sync_share, computing = ch.inb, ch.contrib, ch.sync_share, ch.computing
    congestion, ideal = o.congestion, o.ideal_sync
    interference = not ideal and (o.fwd_impact > 0 or o.bwd_impact > 0)
    impact = compute_impact(o.fwd_impact, o.bwd_impact)
    lim = o.recv_capacity * (1 + 1e-9)
    congested_shares, still = _make_congestion(run, ch, o, allocate) if congestion else (None, [False])

    def settle(now: float) -> None:
        for ri in dirty:
            tasks = chan[ri]
            if tasks:
                allocate(tasks, 1.0, base)
                if congestion:  # keep each receiver's inbound base share current
                    for m in tasks:
                        if code[m] != AR:
                            d = base[m] - contrib[m]
                            if d:
                                inb[peer[m]] += d
                                contrib[m] = base[m]
            if ideal and schan[ri]:
                allocate(schan[ri], 1.0, base)
        full = congestion and (still[0] or max(inb) > lim)
        if full:
            changed = congested_shares()
        else:
            changed = []
            for ri in dirty:
                for m in (chan[ri] + schan[ri] if ideal else chan[ri]):
                    v = base[m]
                    if share[m] != v:
                        share[m] = v
                        changed.append(m)
        for m in changed:
            k = task_of[m]
            if k == m and code[m] != AR:
                set_rate(m, share[m], now)
            else:
                ms = members_of[coll[m]]
                low = share[ms[0]]
                for x in ms:
                    if share[x] < low:
                        low = share[x]
                set_rate(k, low, now)
        if interference:  # an all-reduce's share of the channel slows the rank's compute
            for ri in (range(len(chan)) if full else dirty):
                v = 0.0
                for m in chan[ri]:
                    if code[m] == AR:
                        v += share[m]
                if v != sync_share[ri]:
                    sync_share[ri] = v
                    comp = computing[ri]
                    if comp >= 0 and fin[comp] != -2.0:
                        set_rate(comp, 1.0 - v * impact[code[comp]], now)
        dirty.clear()

    return settle


def _make_congestion(run: Run, ch: Channels, o: SimOptions,
                     allocate: Allocate) -> tuple[Callable[[], list[int]], list[bool]]:
    """``congested_shares()``: apply :mod:`.congestion` and return the entries whose share changed.

    The list returned beside it holds whether the last call throttled anything: while it
    does, every event checks in full again (a throttled share is not in ``inb``).
    """
    dirty = run.dirty
    share, base, schan = ch.share, ch.base, ch.schan
    ideal = o.ideal_sync
    congest = make_congest(run.c, ch.chan, base, ch.throttled, allocate, o.recv_capacity)
    still = [False]

    def congested_shares() -> list[int]:
        final, still[0] = congest()
        changed = []
        for m, v in final.items():
            if share[m] != v:
                share[m] = v
                changed.append(m)
        if ideal:
            for ri in dirty:
                for m in schan[ri]:
                    if share[m] != base[m]:
                        share[m] = base[m]
                        changed.append(m)
        return changed

    return congested_shares, still
