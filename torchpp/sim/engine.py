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

    @property
    def makespan(self) -> float:
        return self.timeline.makespan

    def utilisation(self) -> dict[int, float]:
        """Fraction of the makespan each rank's compute channel is busy."""
        span = self.makespan or 1.0
        return {r: self.timeline.busy(r, (Kind.FORWARD, Kind.BACKWARD, Kind.OPTIMIZER)) / span
                for r in self.timeline.spans}


class Compiled:
    """A schedule flattened into arrays once, so that pricing it again (a sweep) is cheap."""

    def __init__(self, sched: Schedule):
        self.sched = sched
        self.ranks = sorted(sched)
        self.rank_pos = {r: i for i, r in enumerate(self.ranks)}
        acts: list[Action] = []
        owner: list[int] = []
        prog: list[list[int]] = []
        for r in self.ranks:
            idx = []
            for a in sched[r]:
                idx.append(len(acts))
                acts.append(a)
                owner.append(self.rank_pos[r])
            prog.append(idx)
        self.acts, self.owner, self.prog = acts, owner, prog
        self.code = [_CODE[a.kind] for a in acts]
        self.step = [0] * len(acts)
        for idx in prog:
            for i, a in enumerate(idx):
                self.step[a] = i
        self.peer = [self.rank_pos.get(a.peer, -1) if a.peer is not None else -1 for a in acts]
        # match each receive with its send: k-th message on a link in list order
        queues: dict[tuple, deque[int]] = {}
        self.match = [-1] * len(acts)
        for a, act in enumerate(acts):
            if act.is_send:
                queues.setdefault((owner[a], self.peer[a], act.microbatch, act.samples, act.kind), deque()).append(a)
        for a, act in enumerate(acts):
            if act.is_recv:
                send_kind = Kind.SEND_ACT if act.kind == Kind.RECV_ACT else Kind.SEND_GRAD
                q = queues.get((self.peer[a], owner[a], act.microbatch, act.samples, send_kind))
                if not q:
                    raise ScheduleError(f"rank {self.ranks[owner[a]]}: {act} has no matching send\n"
                                        + format_schedule(sched, {self.ranks[owner[a]]: self.step[a]}))
                s = q.popleft()
                self.match[a], self.match[s] = s, a
        # collectives: the k-th all-reduce of (group, tied) on each member is one instance
        seen: dict[tuple, int] = {}
        inst: dict[tuple, list[int]] = {}
        self.coll = [-1] * len(acts)
        for a, act in enumerate(acts):
            if act.kind == Kind.ALLREDUCE:
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
                self.coll[a] = len(self.coll_members)
            self.coll_members.append(members)


def simulate(sched: Schedule | Compiled, cost: CostModel, options: SimOptions | None = None) -> SimResult:
    """Price the action lists with ``cost`` under ``options`` (see the module docstring)."""
    c = sched if isinstance(sched, Compiled) else Compiled(sched)
    o = options or SimOptions()
    ranks, acts, code, owner, peer = c.ranks, c.acts, c.code, c.owner, c.peer
    A = len(acts)
    R = len(ranks)
    shared = o.comm == "shared"
    dur = [0.0] * A
    for a in range(A):
        k = code[a]
        r = ranks[owner[a]]
        if k <= _OPT:
            dur[a] = float(cost.compute_s(r, acts[a]))
        elif k == _SA or k == _SG:
            dur[a] = float(cost.transfer_s(r, ranks[peer[a]], acts[a]))
        elif k == _AR and c.coll_members[c.coll[a]][0] == a:
            dur[a] = float(cost.allreduce_s(acts[a]))
        if dur[a] < 0:
            raise SimError(f"cost of {acts[a]} on rank {r}: expected >= 0 seconds, got {dur[a]}")

    # ---- priorities as arrays over comm type
    pr = o.priorities
    tier = [pr.exclusive.get(t) for t in COMM_TYPES]
    prio = [pr.shared.get(t, 0.0) for t in COMM_TYPES]
    impact = {_F: o.fwd_impact, _B: o.bwd_impact, _OPT: 0.0}
    interference = shared and not o.ideal_sync and (o.fwd_impact > 0 or o.bwd_impact > 0)

    # ---- state
    pc = [0] * R
    reached = [0.0] * R          # when the rank reached its current action
    start = [-1.0] * A
    end = [-1.0] * A
    ready_at = [-1.0] * A
    sent = [-1.0] * A            # send action -> arrival time
    waiting_recv = [-1] * A      # send action -> rank blocked on its receive
    coll_q: list[deque[int]] = [deque() for _ in range(R)]
    coll_arrived = [0] * len(c.coll_members)
    coll_start_t = [0.0] * len(c.coll_members)
    arrival = [0.0] * A          # member action -> when it reached the head of its rank's queue
    opt_waiting = [False] * R
    link_free: dict[tuple[int, int], float] = {}
    # fluid tasks (task id = action index; an all-reduce is its first member's index)
    rem = [0.0] * A
    rate = [0.0] * A
    last = [0.0] * A
    ver = [0] * A
    chan: list[list[int]] = [[] for _ in range(R)]      # comm tasks on each rank's channel
    sync_chan: list[list[int]] = [[] for _ in range(R)]  # ideal_sync: all-reduces' own channel
    share: dict[tuple[int, int], float] = {}            # (rank, task) -> share of that channel
    computing = [-1] * R
    throttled: set[int] = set()
    heap: list[tuple[float, int, int, int]] = []
    seq = 0
    dirty: set[int] = set()
    now = 0.0

    def push(t: float, k: int) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(heap, (t, seq, k, ver[k]))

    def set_rate(k: int, new: float) -> None:
        old = rate[k]
        if new == old:
            return
        if old > 0:
            rem[k] -= old * (now - last[k])
            if rem[k] < 0:
                rem[k] = 0.0
        last[k] = now
        rate[k] = new
        ver[k] += 1
        if new > 0:
            push(now + rem[k] / new, k)

    def start_task(k: int, work: float) -> None:
        rem[k], last[k], rate[k] = work, now, 0.0
        start[k] = now

    def compute_rate(ri: int, k: int) -> float:
        if not interference:
            return 1.0
        s = 0.0
        for t in chan[ri]:
            if code[t] == _AR:
                s += share.get((ri, t), 0.0)
        return 1.0 - s * impact[code[k]]

    def coll_arrive(ri: int) -> None:
        """The head of rank ri's collective queue has arrived; start the collective when all have."""
        a = coll_q[ri][0]
        arrival[a] = max(now, arrival[a])
        ci = c.coll[a]
        coll_arrived[ci] += 1
        members = c.coll_members[ci]
        if coll_arrived[ci] < len(members):
            return
        k = members[0]
        coll_start_t[ci] = now
        if not shared:
            rem[k] = dur[k]
            start[k] = now
            push(now + dur[k], k)
            return
        start_task(k, dur[k])
        for m in members:
            (sync_chan if o.ideal_sync else chan)[owner[m]].append(k)
            dirty.add(owner[m])

    def run_thread(ri: int) -> None:
        prog = c.prog[ri]
        while pc[ri] < len(prog):
            a = prog[pc[ri]]
            k = code[a]
            if k <= _OPT:
                if k == _OPT and coll_q[ri]:
                    opt_waiting[ri] = True
                    return
                start[a] = now
                computing[ri] = a
                if shared:
                    start_task(a, dur[a])
                    set_rate(a, compute_rate(ri, a))
                else:
                    rem[a] = dur[a]
                    push(now + dur[a], a)
                return
            if k == _SA or k == _SG:
                if shared:
                    start_task(a, dur[a])
                    chan[ri].append(a)
                    dirty.add(ri)
                else:
                    key = (ri, peer[a])
                    s = max(now, link_free.get(key, 0.0))
                    e = s + dur[a]
                    link_free[key] = e
                    start[a] = s
                    push(e, a)
            elif k == _RA or k == _RG:
                s = c.match[a]
                if sent[s] < 0:
                    waiting_recv[s] = ri
                    return
                start[a], end[a], ready_at[a] = reached[ri], max(reached[ri], sent[s]), sent[s]
            else:  # all-reduce: post it; it starts when every member has reached it
                coll_q[ri].append(a)
                arrival[a] = now
                if len(coll_q[ri]) == 1:
                    coll_arrive(ri)
            pc[ri] += 1
            reached[ri] = now

    def finish(k: int) -> None:
        """Task k (an action, or an all-reduce's first member) completed at ``now``."""
        kk = code[k]
        ri = owner[k]
        if kk <= _OPT:
            end[k] = now
            computing[ri] = -1
            pc[ri] += 1
            reached[ri] = now
            rate[k] = 0.0
            wake.append(ri)
        elif kk == _SA or kk == _SG:
            end[k] = ready_at[k] = sent[k] = now
            if shared:
                chan[ri].remove(k)
                share.pop((ri, k), None)
                rate[k] = 0.0
                dirty.add(ri)
            w = waiting_recv[k]
            if w >= 0:
                waiting_recv[k] = -1
                rv = c.match[k]
                start[rv], end[rv], ready_at[rv] = reached[w], now, now
                pc[w] += 1
                reached[w] = now
                wake.append(w)
        else:
            ci = c.coll[k]
            for m in c.coll_members[ci]:
                mi = owner[m]
                start[m], end[m], ready_at[m] = arrival[m], now, coll_start_t[ci]
                if shared:
                    (sync_chan if o.ideal_sync else chan)[mi].remove(k)
                    share.pop((mi, k), None)
                    dirty.add(mi)
                coll_q[mi].popleft()
                if coll_q[mi]:
                    arrival[coll_q[mi][0]] = now
                    coll_arrive(mi)
                elif opt_waiting[mi]:
                    opt_waiting[mi] = False
                    wake.append(mi)
            rate[k] = 0.0

    ctype = [_CTYPE.get(k, -1) for k in code]
    mbkey = [a.microbatch if a.microbatch is not None else 1 << 30 for a in acts]
    zero = ZERO_PRIORITY
    cap = o.recv_capacity

    def allocate(tasks: list[int], budget: float, out: dict[int, float]) -> None:
        """The three tiers: exclusive letter, proportional shares, zero priority."""
        if not tasks:
            return
        best = None
        for k in tasks:
            t = tier[ctype[k]]
            if t is not None:
                key = (t, mbkey[k], ctype[k])
                if best is None or key < best[0]:
                    best = (key, k)
        if best is not None:
            for k in tasks:
                out[k] = 0.0
            out[best[1]] = budget
            return
        count = [0, 0, 0]
        for k in tasks:
            if prio[ctype[k]] > zero:
                count[ctype[k]] += 1
        if count[0] or count[1] or count[2]:
            tot = sum(prio[i] for i in range(3) if count[i])
            for k in tasks:
                p = prio[ctype[k]]
                out[k] = budget * (p / tot) / count[ctype[k]] if p > zero else 0.0
            return
        each = budget / len(tasks)
        for k in tasks:
            out[k] = each

    def congestion(alloc: list[dict[int, float]]) -> None:
        """Throttle senders so that no rank receives more than ``recv_capacity``."""
        fixed: set[int] = set()
        for _ in range(A + 1):
            inbound: dict[int, list[int]] = {}
            for ri in range(R):
                for k, sh in alloc[ri].items():
                    if sh > 0 and code[k] != _AR:
                        inbound.setdefault(peer[k], []).append(k)
            over = False
            for dst, ks in inbound.items():
                total = sum(alloc[owner[k]][k] for k in ks)
                if total > cap * (1 + 1e-12):
                    over = True
                    for k in ks:
                        alloc[owner[k]][k] *= cap / total
                        fixed.add(k)
                        throttled.add(k)
            if not over:
                return
            for ri in range(R):
                tasks = chan[ri]
                if not any(k in fixed for k in tasks):
                    continue
                used = sum(alloc[ri][k] for k in tasks if k in fixed)
                free = [k for k in tasks if k not in fixed]
                allocate(free, max(0.0, 1.0 - used), alloc[ri])
        # out of rounds: scaling alone never raises another rank's inbound
        inbound = {}
        for ri in range(R):
            for k, sh in alloc[ri].items():
                if sh > 0 and code[k] != _AR:
                    inbound.setdefault(peer[k], []).append(k)
        for dst, ks in inbound.items():
            total = sum(alloc[owner[k]][k] for k in ks)
            if total > cap:
                for k in ks:
                    alloc[owner[k]][k] *= cap / total
                    throttled.add(k)

    def _reallocate(todo: set[int]) -> None:
        rows = range(R) if o.congestion else list(todo)
        alloc: list[dict[int, float]] = [{} for _ in range(R)]
        for ri in rows:
            allocate(chan[ri], 1.0, alloc[ri])
            if o.ideal_sync:
                allocate(sync_chan[ri], 1.0, alloc[ri])
        if o.congestion:
            congestion(alloc)
        changed: set[int] = set()
        for ri in rows:
            for k, sh in alloc[ri].items():
                if share.get((ri, k)) != sh:
                    share[(ri, k)] = sh
                    changed.add(k)
        for k in changed:
            if code[k] == _AR:
                members = c.coll_members[c.coll[k]]
                set_rate(k, min(share.get((owner[m], k), 0.0) for m in members))
            else:
                set_rate(k, share[(owner[k], k)])
        if interference:
            for ri in rows:
                comp = computing[ri]
                if comp >= 0:
                    set_rate(comp, compute_rate(ri, comp))
        todo.clear()

    wake: list[int] = []
    for ri in range(R):
        run_thread(ri)
    events = 0
    while True:
        if shared and dirty:
            _reallocate(dirty)
        if not heap:
            break
        t, _s, k, v = heapq.heappop(heap)
        if v != ver[k]:
            continue
        now = t
        events += 1
        finish(k)
        # everything else finishing at the same instant before reallocating
        while heap and heap[0][0] <= now:
            t2, _s, k2, v2 = heapq.heappop(heap)
            if v2 == ver[k2]:
                finish(k2)
        while wake:
            run_thread(wake.pop())

    # ---- dead-lock check and timeline
    stuck = {ranks[ri]: pc[ri] for ri in range(R) if pc[ri] < len(c.prog[ri])}
    if stuck:
        raise ScheduleError("cannot price a schedule that deadlocks\n" + format_schedule(c.sched, stuck))
    tl = Timeline({r: [] for r in ranks})
    out_throttled: set[tuple[int, int]] = set()
    for ri, r in enumerate(ranks):
        spans = tl.spans[r]
        for a in c.prog[ri]:
            kk = code[a]
            if kk <= _OPT:
                spans.append(Span(r, acts[a], start[a], end[a]))
            elif kk == _SA or kk == _SG:
                spans.append(Span(r, acts[a], start[a], end[a], end[a]))
                if a in throttled:
                    out_throttled.add((r, c.step[a]))
            else:
                spans.append(Span(r, acts[a], start[a], end[a], ready_at[a]))
    return SimResult(timeline=tl, throttled=out_throttled, events=events)
