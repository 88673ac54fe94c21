"""The ``topology`` comm model: transfers and collectives routed over a network, sharing its links.

Every send and every all-reduce is a bundle of flows (:mod:`torchpp.topology.collectives`)
over the resources of its routes; all bundles in flight share the resources max-min fairly
(:mod:`torchpp.topology.fairshare`), re-divided whenever one starts or ends. Rates are
piecewise constant between events, so finish times are exact. A bundle pays its route
latency after its bytes, holding its share meanwhile. Compute runs at full speed (the core's
own path). Only the connected component of bundles sharing a resource with the one that
started or ended is re-divided: max-min fairness splits over such components.

:func:`bundles_of` prices a plan's schedule on a network; :mod:`.fast` feeds the same core and
model a single pipeline replica whose bundles stand for every replica's copy.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from ..schedules import Action, Kind, Schedule
from ..topology.collectives import Bundle, allreduce, merged, transfer
from ..topology.fairshare import maxmin
from ..topology.routes import Network
from .compiled import AR, OPT, SA, SG, Compiled, check_finished, timeline
from .core import CommHooks, Run, step
from .types import CostModel, SimResult, Timeline

BytesOf = Callable[[int, Action], float]


@dataclass
class Placement:
    """Hosts (topology node ids) of every plan rank: a rank is a tensor-parallel group of ``tp`` hosts."""

    hosts: Mapping[int, Sequence[int]]

    @staticmethod
    def contiguous(ranks: Sequence[int], tp: int = 1) -> "Placement":
        """Rank ``r`` on hosts ``r·tp .. r·tp + tp − 1`` (Megatron's order: tp fastest, then dp, then pp)."""
        return Placement({r: list(range(r * tp, (r + 1) * tp)) for r in ranks})


def action_bundle(net: Network, place: Placement, rank: int, a: Action, nbytes: float,
                  algorithm: str = "ring") -> Bundle:
    """One rank's send or one all-reduce as a bundle: ``tp`` parallel counterparts, each 1/tp of the bytes."""
    src = place.hosts[rank]
    tp = len(src)
    if a.kind in (Kind.SEND_ACT, Kind.SEND_GRAD):
        dst = place.hosts[a.peer]
        return merged([transfer(net, s, d, nbytes / tp) for s, d in zip(src, dst)])
    groups = [[place.hosts[r][i] for r in (a.group or ())] for i in range(tp)]
    return merged([allreduce(net, g, nbytes / tp, algorithm) for g in groups])


def bundles_of(c: Compiled, net: Network, place: Placement, bytes_of: BytesOf,
               algorithm: str = "ring") -> list[Bundle | None]:
    """The bundle of every send and of every all-reduce (on its first member's index)."""
    out: list[Bundle | None] = [None] * len(c.acts)
    ranks, members_of = c.ranks, c.coll_members
    for a, k in enumerate(c.code):
        if k == SA or k == SG or (k == AR and members_of[c.coll[a]][0] == a):
            r = ranks[c.owner[a]]
            out[a] = action_bundle(net, place, r, c.acts[a], bytes_of(r, c.acts[a]), algorithm)
    return out


def compute_durations(c: Compiled, cost: CostModel) -> list[float]:
    """Seconds of every compute action; communication is the network's to price."""
    ranks, acts, owner = c.ranks, c.acts, c.owner
    return [float(cost.compute_s(ranks[owner[a]], acts[a])) if k <= OPT else 0.0 for a, k in enumerate(c.code)]


def simulate_topology(sched: Schedule | Compiled, cost: CostModel, bundles: Sequence[Bundle | None] | Callable,
                      net: Network, *, spans: bool = True) -> SimResult:
    """Price the action lists: compute from ``cost``, every send and all-reduce over ``net``.

    ``bundles``: per action index (see :func:`bundles_of`), or a function of the compiled schedule."""
    c = sched if isinstance(sched, Compiled) else Compiled(sched)
    bl = bundles(c) if callable(bundles) else bundles
    run = Run(c, compute_durations(c, cost))
    step(run, topology_hooks(run, bl, net.capacity))
    check_finished(c, run.pc)
    if not spans:
        res = SimResult(timeline=Timeline({r: [] for r in c.ranks}), completion=max(run.end, default=0.0))
    else:
        res = SimResult(timeline=timeline(c, run.start, run.end, run.ready))
    res.events = run.events
    return res


def topology_hooks(run: Run, bundles: Sequence[Bundle | None], capacity: Sequence[float]) -> CommHooks:
    c = run.c
    members_of, start, dirty, fin, heap = c.coll_members, run.start, run.dirty, run.fin, run.heap
    n = len(c.acts)
    usage, capacity = compress([b.usage if b is not None else {} for b in bundles], capacity)
    rem = [b.volume if b is not None else 0.0 for b in bundles]
    tail = [b.latency_s if b is not None else 0.0 for b in bundles]
    rate, last = [-1.0] * n, [0.0] * n
    on: dict[int, set[int]] = {}
    """Resource -> bundles in flight crossing it."""
    touched: set[int] = set()
    loose: set[int] = set()
    """Bundles in flight that cross nothing (unbounded rate), to be timed at the next settle."""
    push = heapq.heappush

    def begin(k: int, ri: int) -> None:
        if usage[k]:
            for r, _c in usage[k]:
                on.setdefault(r, set()).add(k)
                touched.add(r)
        else:
            loose.add(k)
        dirty.add(ri)

    def end(k: int, ri: int) -> None:
        for r, _c in usage[k]:
            on[r].discard(k)
            touched.add(r)
        dirty.add(ri)

    def post_send(a: int, ri: int, now: float) -> None:
        start[a] = now
        last[a] = now
        begin(a, ri)

    def start_collective(ci: int, now: float) -> None:
        k = members_of[ci][0]
        last[k] = now
        begin(k, c.owner[k])

    def member_done(m: int, mi: int) -> None:
        if members_of[c.coll[m]][0] == m:
            end(m, mi)

    def set_rate(k: int, new: float, now: float) -> None:
        old, dt = rate[k], now - last[k]
        if old > 0 and dt > 0:
            flow = rem[k] / old
            if dt <= flow:
                rem[k] -= old * dt
            else:
                rem[k], tail[k] = 0.0, max(0.0, tail[k] - (dt - flow))
        last[k], rate[k] = now, new
        if new > 0:
            t = now + rem[k] / new + tail[k]
            fin[k] = t
            push(heap, (t, k))
        else:
            fin[k] = -1.0

    def settle(now: float) -> None:
        for k in loose:
            set_rate(k, float("inf"), now)
        loose.clear()
        comp = _component(touched, on, usage)
        touched.clear()
        if comp:
            for k, v in maxmin(comp, usage, capacity).items():
                if v != rate[k]:
                    set_rate(k, v, now)
        dirty.clear()

    return CommHooks(None, post_send, start_collective, end, member_done, settle)


def _component(seed: set[int], on: dict[int, set[int]], usage: Sequence) -> set[int]:
    """Bundles in flight connected through shared resources to the resources in ``seed``."""
    comp: set[int] = set()
    todo = list(seed)
    seen = set(seed)
    while todo:
        for k in on.get(todo.pop(), ()):
            if k not in comp:
                comp.add(k)
                for r, _c in usage[k]:
                    if r not in seen:
                        seen.add(r)
                        todo.append(r)
    return comp


def compress(usages: Sequence[Mapping[int, float]], capacity: Sequence[float]
             ) -> tuple[list[list[tuple[int, float]]], list[float]]:
    """The same constraints with fewer resources: each as ``Σ (flows/capacity)·rate ≤ 1``, and
    resources whose normalised rows are identical (the uplinks of every replica of a stage)
    kept once. Exact: a duplicate constraint allows nothing the other does not."""
    rows: dict[int, list[tuple[int, float]]] = {}
    for k, u in enumerate(usages):
        for r, f in u.items():
            rows.setdefault(r, []).append((k, f / capacity[r]))
    index: dict[tuple, int] = {}
    out: list[list[tuple[int, float]]] = [[] for _ in usages]
    for row in rows.values():
        sig = tuple(row)
        if sig in index:
            continue
        index[sig] = i = len(index)
        for k, w in row:
            out[k].append((i, w))
    return out, [1.0] * len(index)
