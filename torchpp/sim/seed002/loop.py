"""The original simulator's time-stepping loop.

Every step: idle compute channels take their best ready task (greedy, forward first, lower
micro-batch first, never pre-empted); each comm channel is divided among its ready tasks
(:mod:`.channels`), a task counting as started once it gets a share; with congestion the
middle gpus' inbound shares are throttled; a compute task runs at ``1 - sync share x
impact``; time advances to the first finish (at least ``EPS``); finished tasks release
their dependents.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from ..model import TASK_TYPES, Priorities, SimError
from .channels import EPS, Allocate, congest, make_allocate
from .tasks import BWD, SYNC, TaskGraph, build_tasks

CRAWL_LIMIT = 20_000
"""Consecutive 1e-9 steps forced by a task that accrues work without running before the
original is declared livelocked (it would need ~1e9 more steps to get anywhere)."""


class LivelockError(SimError):
    """The original simulator would never finish this configuration."""


@dataclass(kw_only=True)
class Seed002Result:
    completion_time: float
    tasks: list[tuple[str, int, int]]
    """(type, microbatch, gpu) of every task, indexed like ``start``/``end``."""
    start: list[float]
    end: list[float]
    throttled: list[bool]
    steps: int = 0
    lengths: dict[str, float] = field(default_factory=dict)


def simulate_seed002(*, num_gpus: int, n: int, sync_freq: int, lengths: dict[str, float],
                     priorities: Priorities, fwd_impact: float, bwd_impact: float,
                     is_ideal: bool = False, use_recv_congestion: bool = False) -> Seed002Result:
    """Run the original's time-stepping loop; see ``seeds/002_reference_semantics.md``."""
    _check(num_gpus, n, sync_freq, lengths, fwd_impact, bwd_impact)
    g = build_tasks(num_gpus, n, sync_freq, lengths)
    st = _Channels(g, num_gpus, is_ideal)
    allocate = make_allocate(priorities, g.typ, g.mb)
    steps = _run(g, st, allocate, (fwd_impact, bwd_impact), is_ideal, use_recv_congestion and num_gpus > 2)
    return Seed002Result(completion_time=max(st.end), tasks=g.names, start=st.start, end=st.end,
                         throttled=st.throttled, steps=steps, lengths=dict(lengths))


def _check(G: int, n: int, sync_freq: int, lengths: dict[str, float], fwd_impact: float, bwd_impact: float) -> None:
    if G < 1 or n < 1:
        raise SimError(f"num_gpus and n: expected >= 1, got {G} and {n}")
    if sync_freq < 1:
        raise SimError(f"sync_freq: expected an integer >= 1, got {sync_freq}")
    for name, v in (("fwd_impact", fwd_impact), ("bwd_impact", bwd_impact)):
        if not 0.0 <= v < 1.0:
            raise SimError(f"{name}: expected 0 <= value < 1 (1 stalls compute, more gives negative rates), got {v}")
    for k in TASK_TYPES:
        if k not in lengths or lengths[k] < 0:
            raise SimError(f"lengths.{k}: expected a length >= 0, got {lengths.get(k)!r}")


class _Channels:
    """Per task: progress and times; per gpu: its ready queues and the compute task it runs."""

    def __init__(self, g: TaskGraph, G: int, is_ideal: bool):
        T = len(g.typ)
        self.done = [0.0] * T
        self.finished = [False] * T
        self.running = [False] * T
        self.throttled = [False] * T
        self.start = [-1.0] * T
        self.end = [-1.0] * T
        self.ready_compute: list[list[tuple[int, int, int]]] = [[] for _ in range(G)]
        self.ready_comm: list[list[int]] = [[] for _ in range(G)]
        self.ready_sync: list[list[int]] = [[] for _ in range(G)]
        """With ``is_ideal``: grad_sync's own channel."""
        self.current = [-1] * G
        self.is_ideal = is_ideal
        for k in range(T):
            if g.waiting[k] == 0:
                self.make_ready(g, k)

    def make_ready(self, g: TaskGraph, k: int) -> None:
        t = g.typ[k]
        if t <= BWD:
            heapq.heappush(self.ready_compute[g.gpu[k]], (t, g.mb[k], k))
        elif t == SYNC and self.is_ideal:
            self.ready_sync[g.gpu[k]].append(k)
        else:
            self.ready_comm[g.gpu[k]].append(k)

    def complete(self, g: TaskGraph, k: int, now: float) -> None:
        """Task ``k`` finished at ``now``: free its channel and release its dependents."""
        self.finished[k] = True
        self.end[k] = now
        t = g.typ[k]
        if t <= BWD:
            self.current[g.gpu[k]] = -1
        elif t == SYNC and self.is_ideal:
            self.ready_sync[g.gpu[k]].remove(k)
        else:
            self.ready_comm[g.gpu[k]].remove(k)
        waiting = g.waiting
        for x in g.dependents[k]:
            waiting[x] -= 1
            if waiting[x] == 0:
                self.make_ready(g, x)


def _run(g: TaskGraph, st: _Channels, allocate: Allocate, impact: tuple[float, float], is_ideal: bool,
         congestion: bool) -> int:
    """Step until every task finished; returns the number of steps."""
    need, done, running, finished, ready_comm, ready_sync = g.need, st.done, st.running, st.finished, \
        st.ready_comm, st.ready_sync
    G = len(st.current)
    now = 0.0
    left = len(need)
    steps = 0
    crawl = 0
    while left:
        steps += 1
        alloc = _divide(g, st, allocate, now)
        if congestion:
            congest(alloc, ready_comm, g.typ, allocate, st.throttled)
        rate = _rates(g, st, alloc, impact)
        if not rate:
            stuck = [g.names[k] for k in range(len(need)) if not finished[k]]
            raise SimError(f"nothing can run at t={now}: waiting tasks {stuck[:6]}")
        dt = min((need[k] - done[k]) / r for k, r in rate.items() if r > 0)
        if dt < EPS:
            crawl = _crawl(g, st, rate, crawl, now)
            dt = EPS
        else:
            crawl = 0
        now += dt
        for k, r in rate.items():
            done[k] += r * dt
        for k, r in list(rate.items()):
            if running[k] and done[k] >= need[k] - EPS and not finished[k]:
                st.complete(g, k, now)
                left -= 1
        # running tasks that did not advance (zero share) but are complete, e.g. zero-length
        for j in range(G):
            for lst in (ready_comm[j], ready_sync[j]):
                for k in list(lst):
                    if k not in rate and running[k] and done[k] >= need[k] - EPS:
                        st.complete(g, k, now)
                        left -= 1
    return steps


def _divide(g: TaskGraph, st: _Channels, allocate: Allocate, now: float) -> dict[int, float]:
    """Start idle compute channels' best ready tasks; divide every comm channel (a task that
    gets a share counts as started)."""
    current, running, start = st.current, st.running, st.start
    for j, q in enumerate(st.ready_compute):
        if current[j] < 0 and q:
            k = heapq.heappop(q)[2]
            current[j] = k
            running[k] = True
            start[k] = now
    alloc: dict[int, float] = {}
    if st.is_ideal:
        for comm, sync in zip(st.ready_comm, st.ready_sync):
            allocate(comm, 1.0, alloc)
            allocate(sync, 1.0, alloc)
    else:
        for comm in st.ready_comm:
            allocate(comm, 1.0, alloc)
    for k, s in alloc.items():
        if s > 0 and not running[k]:
            running[k] = True
            start[k] = now
    return alloc


def _rates(g: TaskGraph, st: _Channels, alloc: dict[int, float], impact: tuple[float, float]) -> dict[int, float]:
    """Comm tasks at their shares; compute at ``1 - (the gpu's sync share) x impact``."""
    typ, ideal, ready_comm = g.typ, st.is_ideal, st.ready_comm
    rate = {k: s for k, s in alloc.items() if s > 0}
    for j, k in enumerate(st.current):
        if k >= 0:
            s = 0.0 if ideal else sum(alloc.get(x, 0.0) for x in ready_comm[j] if typ[x] == SYNC)
            rate[k] = 1.0 - s * impact[typ[k]]
    return rate


def _crawl(g: TaskGraph, st: _Channels, rate: dict[int, float], crawl: int, now: float) -> int:
    """Count a forced 1e-9 step; raise once a task has crawled ``CRAWL_LIMIT`` steps in a row."""
    need, done, running = g.need, st.done, st.running
    culprit = [k for k, r in rate.items() if r > 0 and not running[k] and need[k] - done[k] < EPS * r]
    crawl = crawl + 1 if culprit else 0
    if crawl > CRAWL_LIMIT:
        name = g.names[culprit[0]]
        raise LivelockError(
            f"livelock at t={now:.9f}: {name[0]}(microbatch {name[1]}, gpu {name[2]}) "
            "accrues bandwidth from the congestion re-allocation without ever starting, so the "
            "original simulator would advance in 1e-9 steps forever")
    return crawl
