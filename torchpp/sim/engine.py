"""Event-driven pricing of torchpp's action lists with shared, prioritised communication.

Each rank runs its list in order (the runtime's order, from :func:`torchpp.schedules.build`):
compute actions occupy the rank's exclusive compute channel, sends and all-reduces are
posted without blocking, a receive waits for its message, the optimizer step waits for the
rank's outstanding all-reduces. Communication runs in one of two models:

- ``links``: every directed link is its own FIFO and every transfer runs at full speed;
  all-reduces of a rank run one after another. This is exactly :func:`replay`'s pricing.
- ``shared``: each rank has one comm channel that its outgoing transfers (``fwd_prop`` =
  activations, ``grad_prop`` = gradients) and its all-reduces (``grad_sync``) share by
  priority (exclusive tiers, proportional shares, zero priority). An all-reduce of
  ``grad_sync`` slows the rank's compute by ``fwd_impact``/``bwd_impact`` times its share,
  and with receiver congestion the inbound shares of a rank are throttled to its capacity.

Rates are piecewise constant between events, so a task's finish time is exact: a heap holds
the predicted finish of every task, invalidated by a version number whenever its rate
changes. A task whose rate never changes finishes at ``start + duration`` exactly.
"""
from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field

from ..schedules import Action, Kind, Schedule, ScheduleError, format_schedule
from .model import COMM_TYPES, ZERO_PRIORITY, Priorities, SimError
from .replay import CostModel, Span, Timeline

# action codes
_F, _B, _OPT, _SA, _SG, _RA, _RG, _AR = range(8)
_CODE = {Kind.FORWARD: _F, Kind.BACKWARD: _B, Kind.OPTIMIZER: _OPT, Kind.SEND_ACT: _SA, Kind.SEND_GRAD: _SG,
         Kind.RECV_ACT: _RA, Kind.RECV_GRAD: _RG, Kind.ALLREDUCE: _AR}
# comm type of a comm task: 0 fwd_prop, 1 grad_prop, 2 grad_sync (the tie order of the seed)
_CTYPE = {_SA: 0, _SG: 1, _AR: 2}
_INF = float("inf")


@dataclass(kw_only=True)
class SimOptions:
    """How communication is priced; the defaults are the shared-channel model."""

    comm: str = "shared"
    """``shared`` (one prioritised comm channel per rank) or ``links`` (contention-free FIFO links)."""
    priorities: Priorities = field(default_factory=Priorities)
    fwd_impact: float = 0.0
    bwd_impact: float = 0.0
    congestion: bool = False
    recv_capacity: float = 1.0
    """Inbound share a rank can absorb (1.0 = one sender at full rate)."""
    ideal_sync: bool = False
    """All-reduces get their own channel and never slow compute (the seed's ``is_ideal``)."""

    def __post_init__(self) -> None:
        if self.comm not in ("shared", "links"):
            raise SimError(f"comm: expected 'shared' or 'links', got {self.comm!r}")
        for name in ("fwd_impact", "bwd_impact"):
            v = getattr(self, name)
            if not 0.0 <= v < 1.0:
                raise SimError(f"{name}: expected 0 <= value < 1 (1 stalls compute, more gives negative rates), "
                               f"got {v}")
        if not self.recv_capacity > 0:
            raise SimError(f"recv_capacity: expected a number > 0, got {self.recv_capacity}")
        if self.comm == "links" and (self.congestion or self.fwd_impact or self.bwd_impact):
            raise SimError("comm='links' is contention-free: congestion and impacts need comm='shared'")


@dataclass
class SimResult:
    """A priced schedule: the timeline (replay's form) plus what contention did to it."""

    timeline: Timeline
    throttled: set[tuple[int, int]] = field(default_factory=set)
    """(rank, index in the rank's list) of transfers slowed by receiver congestion."""
    events: int = 0
    rate_log: list[tuple[float, int, int, float]] | None = None
    """With ``record_rates``: (time, rank, index in the rank's list, new rate) of every transfer."""
    completion: float | None = None
    """The makespan when the timeline was not kept (``spans=False``)."""

    @property
    def makespan(self) -> float:
        return self.completion if self.completion is not None else self.timeline.makespan

    def utilisation(self) -> dict[int, float]:
        """Fraction of the makespan each rank's compute channel is busy."""
        span = self.makespan or 1.0
        return {r: self.timeline.busy(r, (Kind.FORWARD, Kind.BACKWARD, Kind.OPTIMIZER)) / span
                for r in self.timeline.spans}


class Compiled:
    """A schedule flattened into arrays once, so that pricing it again (a sweep) is cheap."""

    def __init__(self, sched: Schedule):
        self.sched = sched
        self.ranks = ranks = sorted(sched)
        self.rank_pos = pos = {r: i for i, r in enumerate(ranks)}
        acts: list[Action] = []
        owner: list[int] = []
        step: list[int] = []
        code: list[int] = []
        peer: list[int] = []
        prog: list[list[int]] = []
        sends: dict[tuple, list[int]] = {}
        recvs: list[int] = []
        ars: list[int] = []
        code_of = _CODE
        for ri, r in enumerate(ranks):
            idx = []
            for i, a in enumerate(sched[r]):
                ix = len(acts)
                idx.append(ix)
                acts.append(a)
                owner.append(ri)
                step.append(i)
                k = code_of[a.kind]
                code.append(k)
                pr = -1 if a.peer is None else pos.get(a.peer, -1)
                peer.append(pr)
                if k == _SA or k == _SG:
                    sends.setdefault((ri, pr, a.microbatch, a.samples, k), []).append(ix)
                elif k == _RA or k == _RG:
                    recvs.append(ix)
                elif k == _AR:
                    ars.append(ix)
            prog.append(idx)
        self.acts, self.owner, self.prog, self.step, self.code, self.peer = acts, owner, prog, step, code, peer
        # match each receive with its send: the k-th message of a kind on a link, in list order
        match = [-1] * len(acts)
        for a in recvs:
            act = acts[a]
            q = sends.get((peer[a], owner[a], act.microbatch, act.samples, code[a] - 2))
            if not q:
                raise ScheduleError(f"rank {ranks[owner[a]]}: {act} has no matching send\n"
                                    + format_schedule(sched, {ranks[owner[a]]: step[a]}))
            s = q.pop(0)
            match[a], match[s] = s, a
        self.match = match
        # collectives: the k-th all-reduce of (group, tied) on each member is one instance
        seen: dict[tuple, int] = {}
        inst: dict[tuple, list[int]] = {}
        coll = [-1] * len(acts)
        for a in ars:
            act = acts[a]
            key = (act.group, act.tied, owner[a])
            k = seen.get(key, 0)
            seen[key] = k + 1
            inst.setdefault((act.group, act.tied, k), []).append(a)
        self.coll_members: list[list[int]] = []
        for (group, _tied, _k), members in inst.items():
            if len(members) != len(group or ()):
                raise ScheduleError(f"all-reduce over {group}: {len(members)} of {len(group or ())} members "
                                    "reach it\n" + format_schedule(sched))
            for a in members:
                coll[a] = len(self.coll_members)
            self.coll_members.append(members)
        self.coll = coll
        self._comm: tuple | None = None

    @property
    def ctype(self) -> list[int]:
        return self._comm_arrays()[0]

    @property
    def mbkey(self) -> list[int]:
        return self._comm_arrays()[1]

    @property
    def task_of(self) -> list[int]:
        return self._comm_arrays()[2]

    def _comm_arrays(self) -> tuple[list[int], list[int], list[int]]:
        """Per comm entry: type (0 fwd_prop, 1 grad_prop, 2 grad_sync), tie key, fluid task."""
        if self._comm is None:
            cm = self.coll_members
            self._comm = ([_CTYPE.get(k, -1) for k in self.code],
                          [a.microbatch if a.microbatch is not None else 1 << 30 for a in self.acts],
                          [cm[ci][0] if ci >= 0 else a for a, ci in enumerate(self.coll)])
        return self._comm


def simulate(sched: Schedule | Compiled, cost: CostModel, options: SimOptions | None = None, *,
             record_rates: bool = False, spans: bool = True) -> SimResult:
    """Price the action lists with ``cost`` under ``options`` (see the module docstring).

    ``spans=False`` keeps only the makespan (a sweep needs nothing else).
    """
    c = sched if isinstance(sched, Compiled) else Compiled(sched)
    o = options or SimOptions()
    if o.comm == "links":
        return _simulate_links(c, _durations(c, cost), spans)
    return _simulate_shared(c, _durations(c, cost), o, record_rates, spans)


def _durations(c: Compiled, cost: CostModel) -> list[float]:
    """Seconds of every action at full speed (an all-reduce's on its first member's index)."""
    fast = getattr(cost, "durations", None)
    if fast is not None:
        return fast(c)
    return _durations_generic(c, cost)


def _durations_generic(c: Compiled, cost: CostModel) -> list[float]:
    ranks, acts, code, owner, peer = c.ranks, c.acts, c.code, c.owner, c.peer
    dur = [0.0] * len(acts)
    for a, k in enumerate(code):
        r = ranks[owner[a]]
        if k <= _OPT:
            d = float(cost.compute_s(r, acts[a]))
        elif k == _SA or k == _SG:
            d = float(cost.transfer_s(r, ranks[peer[a]], acts[a]))
        elif k == _AR and c.coll_members[c.coll[a]][0] == a:
            d = float(cost.allreduce_s(acts[a]))
        else:
            continue
        if not d >= 0:
            raise SimError(f"cost of {acts[a]} on rank {r}: expected >= 0 seconds, got {d}")
        dur[a] = d
    return dur


def _timeline(c: Compiled, start: list[float], end: list[float], ready: list[float]) -> Timeline:
    tl = Timeline({r: [] for r in c.ranks})
    acts, code = c.acts, c.code
    for ri, r in enumerate(c.ranks):
        spans = tl.spans[r]
        for a in c.prog[ri]:
            kk = code[a]
            if kk <= _OPT:
                spans.append(Span(r, acts[a], start[a], end[a]))
            else:
                spans.append(Span(r, acts[a], start[a], end[a], ready[a]))
    return tl


def _deadlock(c: Compiled, pc: list[int]) -> None:
    stuck = {c.ranks[ri]: pc[ri] for ri in range(len(c.ranks)) if pc[ri] < len(c.prog[ri])}
    if stuck:
        raise ScheduleError("cannot price a schedule that deadlocks\n" + format_schedule(c.sched, stuck))


def _simulate_links(c: Compiled, dur: list[float], spans: bool = True) -> SimResult:
    """Contention-free: replay's pricing, event by event."""
    code, owner, peer, match, coll, members_of, prog = c.code, c.owner, c.peer, c.match, c.coll, c.coll_members, c.prog
    A, R = len(code), len(c.ranks)
    pc = [0] * R
    reached = [0.0] * R
    start = [0.0] * A
    end = [0.0] * A
    ready = [0.0] * A
    sent = [-1.0] * A
    waiting = [-1] * A
    coll_q: list[deque[int]] = [deque() for _ in range(R)]
    arrived = [0] * len(members_of)
    coll_t0 = [0.0] * len(members_of)
    opt_wait = [False] * R
    link_free: dict[tuple[int, int], float] = {}
    heap: list[tuple[float, int]] = []
    push, pop = heapq.heappush, heapq.heappop
    wake: list[int] = []
    now = 0.0

    def arrive(ri: int) -> None:
        a = coll_q[ri][0]
        ci = coll[a]
        arrived[ci] += 1
        if arrived[ci] == len(members_of[ci]):
            coll_t0[ci] = now
            push(heap, (now + dur[members_of[ci][0]], members_of[ci][0]))

    def run(ri: int) -> None:
        p = prog[ri]
        n = len(p)
        i = pc[ri]
        while i < n:
            a = p[i]
            k = code[a]
            if k <= _OPT:
                if k == _OPT and coll_q[ri]:
                    opt_wait[ri] = True
                    break
                start[a] = now
                push(heap, (now + dur[a], a))
                break
            if k == _SA or k == _SG:
                key = (ri, peer[a])
                s = link_free.get(key, 0.0)
                if s < now:
                    s = now
                e = s + dur[a]
                link_free[key] = e
                start[a] = s
                push(heap, (e, a))
            elif k == _RA or k == _RG:
                s = match[a]
                if sent[s] < 0:
                    waiting[s] = ri
                    break
                start[a], end[a], ready[a] = reached[ri], max(reached[ri], sent[s]), sent[s]
            else:
                coll_q[ri].append(a)
                start[a] = now
                if len(coll_q[ri]) == 1:
                    arrive(ri)
            i += 1
            reached[ri] = now
        pc[ri] = i

    for ri in range(R):
        run(ri)
    while heap:
        now, k = pop(heap)
        kk = code[k]
        ri = owner[k]
        if kk <= _OPT:
            end[k] = now
            pc[ri] += 1
            reached[ri] = now
            run(ri)
        elif kk == _SA or kk == _SG:
            end[k] = ready[k] = sent[k] = now
            w = waiting[k]
            if w >= 0:
                rv = match[k]
                start[rv], end[rv], ready[rv] = reached[w], now, now
                pc[w] += 1
                reached[w] = now
                run(w)
        else:
            ci = coll[k]
            for m in members_of[ci]:
                mi = owner[m]
                end[m], ready[m] = now, coll_t0[ci]
                q = coll_q[mi]
                q.popleft()
                if q:
                    start[q[0]] = now
                    arrive(mi)
                elif opt_wait[mi]:
                    opt_wait[mi] = False
                    wake.append(mi)
            while wake:
                run(wake.pop())
    _deadlock(c, pc)
    if not spans:
        return SimResult(timeline=Timeline({r: [] for r in c.ranks}), completion=max(end, default=0.0))
    return SimResult(timeline=_timeline(c, start, end, ready))


def _simulate_shared(c: Compiled, dur: list[float], o: SimOptions, record_rates: bool = False,
                     spans: bool = True) -> SimResult:
    """Shared prioritised comm channels, interference and congestion (fluid rates between events).

    A comm channel entry is a *member* action: a send, or one member's all-reduce action; the
    fluid task of an all-reduce is its first member. ``share[m]`` is m's share of its channel.
    """
    code, owner, peer, match, coll, members_of, prog = c.code, c.owner, c.peer, c.match, c.coll, c.coll_members, c.prog
    A, R = len(code), len(c.ranks)
    ctype, mbkey, task_of = c.ctype, c.mbkey, c.task_of
    pr = o.priorities
    tier = [pr.exclusive.get(t) for t in COMM_TYPES]
    prio = [pr.shared.get(t, 0.0) for t in COMM_TYPES]
    any_tier = any(t is not None for t in tier)
    impact = [o.fwd_impact, o.bwd_impact, 0.0]
    interference = not o.ideal_sync and (o.fwd_impact > 0 or o.bwd_impact > 0)
    congestion, cap, ideal = o.congestion, o.recv_capacity, o.ideal_sync
    zero = ZERO_PRIORITY

    pc = [0] * R
    reached = [0.0] * R
    start = [0.0] * A
    end = [0.0] * A
    ready = [0.0] * A
    sent = [-1.0] * A
    waiting = [-1] * A
    coll_q: list[deque[int]] = [deque() for _ in range(R)]
    arrived = [0] * len(members_of)
    coll_t0 = [0.0] * len(members_of)
    opt_wait = [False] * R
    rem = [0.0] * A
    rate = [0.0] * A
    last = [0.0] * A
    fin = [-1.0] * A          # predicted finish of a fluid task; -2 once done
    share = [0.0] * A
    base = [0.0] * A          # three-tier share before congestion
    chan: list[list[int]] = [[] for _ in range(R)]
    schan: list[list[int]] = [[] for _ in range(R)] if ideal else chan
    sync_share = [0.0] * R
    inb = [0.0] * R           # with congestion: inbound base share of each rank
    contrib = [0.0] * A       # ... and each send's part of it
    congested = False
    computing = [-1] * R
    throttled: set[int] = set()
    heap: list[tuple[float, int]] = []
    push, pop = heapq.heappush, heapq.heappop
    dirty: set[int] = set()
    wake: list[int] = []
    log: list[tuple[float, int, float]] | None = [] if record_rates else None
    now = 0.0

    def set_rate(k: int, new: float) -> None:
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

    def allocate(tasks: list[int], budget: float, out: list[float]) -> None:
        """The three tiers: exclusive letter, proportional shares, zero priority."""
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

    def congest() -> tuple[dict[int, float], bool]:
        """Final shares of every channel entry with no rank receiving more than ``cap``.

        Also says whether any share was throttled (then the next event checks again in full).
        """
        final: dict[int, float] = {}
        inbound: dict[int, float] = {}
        for ri in range(R):
            for m in chan[ri]:
                s = base[m]
                final[m] = s
                if s > 0 and code[m] != _AR:
                    d = peer[m]
                    inbound[d] = inbound.get(d, 0.0) + s
        if all(v <= cap * (1 + 1e-12) for v in inbound.values()):
            return final, False
        fixed: set[int] = set()
        for _ in range(A + 1):
            by_dst: dict[int, list[int]] = {}
            for m, s in final.items():
                if s > 0 and code[m] != _AR:
                    by_dst.setdefault(peer[m], []).append(m)
            over = False
            for ms in by_dst.values():
                total = 0.0
                for m in ms:
                    total += final[m]
                if total > cap * (1 + 1e-12):
                    over = True
                    f = cap / total
                    for m in ms:
                        final[m] *= f
                        fixed.add(m)
                        throttled.add(m)
            if not over:
                return final, True
            for ri in range(R):
                tasks = chan[ri]
                if not any(m in fixed for m in tasks):
                    continue
                used = sum(final[m] for m in tasks if m in fixed)
                free = [m for m in tasks if m not in fixed]
                if free:
                    out = {}
                    _alloc_into(free, max(0.0, 1.0 - used), out)
                    final.update(out)
        by_dst = {}
        for m, s in final.items():
            if s > 0 and code[m] != _AR:
                by_dst.setdefault(peer[m], []).append(m)
        for ms in by_dst.values():
            total = sum(final[m] for m in ms)
            if total > cap:
                for m in ms:
                    final[m] *= cap / total
                    throttled.add(m)
        return final, True

    def _alloc_into(tasks: list[int], budget: float, out: dict[int, float]) -> None:
        scratch = base_scratch
        allocate(tasks, budget, scratch)
        for m in tasks:
            out[m] = scratch[m]

    base_scratch = [0.0] * A

    def reallocate() -> None:
        nonlocal congested
        changed: list[int] = []
        full = False
        for ri in dirty:
            tasks = chan[ri]
            if tasks:
                allocate(tasks, 1.0, base)
                if congestion:
                    for m in tasks:
                        if code[m] != _AR:
                            d = base[m] - contrib[m]
                            if d:
                                inb[peer[m]] += d
                                contrib[m] = base[m]
            if ideal and schan[ri]:
                allocate(schan[ri], 1.0, base)
        if congestion:
            full = congested
            if not full:
                lim = cap * (1 + 1e-9)
                for v in inb:
                    if v > lim:
                        full = True
                        break
        if full:
            final, congested = congest()
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
        else:
            for ri in dirty:
                for m in chan[ri]:
                    v = base[m]
                    if share[m] != v:
                        share[m] = v
                        changed.append(m)
                if ideal:
                    for m in schan[ri]:
                        v = base[m]
                        if share[m] != v:
                            share[m] = v
                            changed.append(m)
        for m in changed:
            k = task_of[m]
            if k == m and code[m] != _AR:
                set_rate(m, share[m])
            else:
                ms = members_of[coll[m]]
                low = share[ms[0]]
                for x in ms:
                    if share[x] < low:
                        low = share[x]
                set_rate(k, low)
        if interference:
            for ri in (range(R) if full else dirty):
                v = 0.0
                for m in chan[ri]:
                    if code[m] == _AR:
                        v += share[m]
                if v != sync_share[ri]:
                    sync_share[ri] = v
                    comp = computing[ri]
                    if comp >= 0:
                        set_rate(comp, 1.0 - v * impact[code[comp]])
        dirty.clear()

    def arrive(ri: int) -> None:
        a = coll_q[ri][0]
        ci = coll[a]
        arrived[ci] += 1
        ms = members_of[ci]
        if arrived[ci] < len(ms):
            return
        k = ms[0]
        coll_t0[ci] = now
        rem[k], last[k], rate[k] = dur[k], now, 0.0
        for m in ms:
            mi = owner[m]
            schan[mi].append(m)
            dirty.add(mi)

    def run(ri: int) -> None:
        p = prog[ri]
        n = len(p)
        i = pc[ri]
        while i < n:
            a = p[i]
            k = code[a]
            if k <= _OPT:
                if k == _OPT and coll_q[ri]:
                    opt_wait[ri] = True
                    break
                start[a] = now
                computing[ri] = a
                rem[a], last[a], rate[a] = dur[a], now, 0.0
                set_rate(a, 1.0 - sync_share[ri] * impact[k] if interference else 1.0)
                break
            if k == _SA or k == _SG:
                start[a] = now
                rem[a], last[a], rate[a] = dur[a], now, 0.0
                chan[ri].append(a)
                dirty.add(ri)
            elif k == _RA or k == _RG:
                s = match[a]
                if sent[s] < 0:
                    waiting[s] = ri
                    break
                start[a], end[a], ready[a] = reached[ri], max(reached[ri], sent[s]), sent[s]
            else:
                coll_q[ri].append(a)
                start[a] = now
                if len(coll_q[ri]) == 1:
                    arrive(ri)
            i += 1
            reached[ri] = now
        pc[ri] = i

    def finish(k: int) -> None:
        fin[k] = -2.0
        rate[k] = 0.0
        kk = code[k]
        ri = owner[k]
        if kk <= _OPT:
            end[k] = now
            computing[ri] = -1
            pc[ri] += 1
            reached[ri] = now
            wake.append(ri)
        elif kk == _SA or kk == _SG:
            end[k] = ready[k] = sent[k] = now
            chan[ri].remove(k)
            share[k] = 0.0
            if contrib[k]:
                inb[peer[k]] -= contrib[k]
                contrib[k] = 0.0
            dirty.add(ri)
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
                schan[mi].remove(m)
                share[m] = 0.0
                dirty.add(mi)
                q = coll_q[mi]
                q.popleft()
                if q:
                    start[q[0]] = now
                    arrive(mi)
                elif opt_wait[mi]:
                    opt_wait[mi] = False
                    wake.append(mi)

    for ri in range(R):
        run(ri)
    events = 0
    while True:
        if dirty:
            reallocate()
        if not heap:
            break
        t, k = pop(heap)
        if fin[k] != t:
            continue
        now = t
        events += 1
        finish(k)
        while heap and heap[0][0] <= now:
            t2, k2 = pop(heap)
            if fin[k2] == t2:
                finish(k2)
        while wake:
            run(wake.pop())
    _deadlock(c, pc)
    if not spans:
        return SimResult(timeline=Timeline({r: [] for r in c.ranks}), completion=max(end, default=0.0),
                         events=events)
    tl = _timeline(c, start, end, ready)
    out_throttled = {(c.ranks[owner[m]], c.step[m]) for m in throttled}
    rate_log = None
    if log is not None:
        rate_log = [(t, c.ranks[owner[k]], c.step[k], v) for t, k, v in log if code[k] in (_SA, _SG, _AR)]
    return SimResult(timeline=tl, throttled=out_throttled, events=events, rate_log=rate_log)
