"""The original 1F1B simulator's rules, step for step (the ``seed002`` compute policy).

This is a compatibility mode: it reproduces the completion times of the simulator that
seed 002 describes, including its greedy forward-first compute rule, its sync placement,
its fixed-repetition congestion algorithm and its time stepping (every step at least
1e-9, so a zero-length task costs 1e-9). The one behaviour it does not copy is the
livelock: where the original would crawl forever it raises :class:`LivelockError` naming
the task. The default ``schedule`` policy (:mod:`torchpp.sim.engine`) prices torchpp's own
action lists instead.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from .model import COMM_TYPES, TASK_TYPES, Priorities, SimError

EPS = 1e-9
FWD, BWD, FPROP, GPROP, SYNC = range(5)
_TYPE_ORDER = {FPROP: 0, GPROP: 1, SYNC: 2}
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
    G = num_gpus
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

    # ---- tasks and dependencies
    names: list[tuple[str, int, int]] = []
    typ: list[int] = []
    gpu: list[int] = []
    mb: list[int] = []
    need: list[float] = []
    index: dict[tuple[int, int, int], int] = {}

    def add(t: int, i: int, j: int, work: float) -> None:
        index[(t, i, j)] = len(typ)
        names.append((TASK_TYPES[t], i, j))
        typ.append(t); gpu.append(j); mb.append(i); need.append(float(work))

    for j in range(G):
        for i in range(n):
            add(FWD, i, j, lengths["forward"])
            add(BWD, i, j, lengths["backward"])
            if j < G - 1:
                add(FPROP, i, j, lengths["fwd_prop"])
            if j > 0:
                add(GPROP, i, j, lengths["grad_prop"])
            if (i + 1) % sync_freq == 0:
                add(SYNC, i, j, lengths["grad_sync"] * sync_freq)
            elif i == n - 1:
                add(SYNC, i, j, lengths["grad_sync"] * (n % sync_freq))
    T = len(typ)
    deps: list[list[int]] = [[] for _ in range(T)]
    for (t, i, j), k in index.items():
        d = deps[k]
        if t == FWD:
            if j == 0:
                if i > 0:
                    d.append(index[(FWD, i - 1, 0)] if i < G else index[(BWD, i - G, 0)])
            else:
                d.append(index[(FPROP, i, j - 1)])
                if j == G - 1 and i > 0:
                    d.append(index[(BWD, i - 1, G - 1)])
        elif t == BWD:
            d.append(index[(FWD, i, j)])
            if j < G - 1:
                d.append(index[(GPROP, i, j + 1)])
        elif t == FPROP:
            d.append(index[(FWD, i, j)])
        elif t == GPROP:
            d.append(index[(BWD, i, j)])
        else:
            d.append(index[(BWD, i, j)])
            prev = index.get((SYNC, i - sync_freq, j))
            if prev is not None:
                d.append(prev)
    waiting = [len(d) for d in deps]
    dependents: list[list[int]] = [[] for _ in range(T)]
    for k, d in enumerate(deps):
        for x in d:
            dependents[x].append(k)

    # ---- priorities per type (comm types only)
    tier = [None] * 5
    prio = [0.0] * 5
    for name, t in zip(COMM_TYPES, (FPROP, GPROP, SYNC)):
        tier[t] = priorities.exclusive.get(name)
        prio[t] = priorities.shared.get(name, 0.0)

    def allocate(tasks: list[int], budget: float, alloc: dict[int, float]) -> None:
        """The three tiers: exclusive letter, shared proportional, zero-priority equal split."""
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

    # ---- state
    done = [0.0] * T
    finished = [False] * T
    running = [False] * T
    throttled = [False] * T
    start = [-1.0] * T
    end = [-1.0] * T
    ready_compute: list[list[tuple[int, int, int]]] = [[] for _ in range(G)]
    ready_comm: list[list[int]] = [[] for _ in range(G)]
    ready_sync: list[list[int]] = [[] for _ in range(G)]  # ideal mode: grad_sync's own channel
    current = [-1] * G

    def make_ready(k: int) -> None:
        t = typ[k]
        if t <= BWD:
            heapq.heappush(ready_compute[gpu[k]], (t, mb[k], k))
        elif t == SYNC and is_ideal:
            ready_sync[gpu[k]].append(k)
        else:
            ready_comm[gpu[k]].append(k)

    for k in range(T):
        if waiting[k] == 0:
            make_ready(k)

    now = 0.0
    left = T
    steps = 0
    crawl = 0
    impact = (fwd_impact, bwd_impact)
    while left:
        steps += 1
        rate: dict[int, float] = {}
        # compute channels: non-preemptive, greedy forward-first
        for j in range(G):
            if current[j] < 0 and ready_compute[j]:
                k = heapq.heappop(ready_compute[j])[2]
                current[j] = k
                running[k] = True
                start[k] = now
        # comm channels: first allocation marks tasks running
        alloc: dict[int, float] = {}
        for j in range(G):
            allocate(ready_comm[j], 1.0, alloc)
            if is_ideal:
                allocate(ready_sync[j], 1.0, alloc)
        for k, s in alloc.items():
            if s > 0 and not running[k]:
                running[k] = True
                start[k] = now
        if use_recv_congestion and G > 2:
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
        for k, s in alloc.items():
            if s > 0:
                rate[k] = s
        for j in range(G):
            k = current[j]
            if k >= 0:
                s = 0.0 if is_ideal else sum(alloc.get(x, 0.0) for x in ready_comm[j] if typ[x] == SYNC)
                rate[k] = 1.0 - s * impact[typ[k]]
        if not rate:
            stuck = [names[k] for k in range(T) if not finished[k]]
            raise SimError(f"nothing can run at t={now}: waiting tasks {stuck[:6]}")
        dt = min((need[k] - done[k]) / r for k, r in rate.items() if r > 0)
        if dt < EPS:
            culprit = [k for k, r in rate.items() if r > 0 and not running[k] and need[k] - done[k] < EPS * r]
            crawl = crawl + 1 if culprit else 0
            if crawl > CRAWL_LIMIT:
                k = culprit[0]
                raise LivelockError(
                    f"livelock at t={now:.9f}: {names[k][0]}(microbatch {names[k][1]}, gpu {names[k][2]}) "
                    "accrues bandwidth from the congestion re-allocation without ever starting, so the "
                    "original simulator would advance in 1e-9 steps forever")
            dt = EPS
        else:
            crawl = 0
        now += dt
        for k, r in rate.items():
            done[k] += r * dt
        for k, r in list(rate.items()):
            if running[k] and done[k] >= need[k] - EPS and not finished[k]:
                finished[k] = True
                end[k] = now
                left -= 1
                t = typ[k]
                if t <= BWD:
                    current[gpu[k]] = -1
                elif t == SYNC and is_ideal:
                    ready_sync[gpu[k]].remove(k)
                else:
                    ready_comm[gpu[k]].remove(k)
                for x in dependents[k]:
                    waiting[x] -= 1
                    if waiting[x] == 0:
                        make_ready(x)
        # running tasks that did not advance (zero share) but are complete, e.g. zero-length
        for j in range(G):
            for lst in (ready_comm[j], ready_sync[j]):
                for k in list(lst):
                    if k not in rate and running[k] and done[k] >= need[k] - EPS:
                        finished[k] = True
                        end[k] = now
                        left -= 1
                        lst.remove(k)
                        for x in dependents[k]:
                            waiting[x] -= 1
                            if waiting[x] == 0:
                                make_ready(x)
    return Seed002Result(completion_time=max(end), tasks=names, start=start, end=end, throttled=throttled,
                         steps=steps, lengths=dict(lengths))
