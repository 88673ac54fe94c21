"""The replay's reference: the same contention-free pricing written as a plain loop over the lists.

``torchpp.sim.replay.replay`` (the event engine's ``links`` model) must give the same timeline,
span for span; ``tests/test_sim_engine.py`` holds them equal.
"""
from __future__ import annotations

from torchpp.schedules import COMPUTE, Action, Kind, Schedule, ScheduleError, format_schedule
from torchpp.sim.types import CostModel, Span, Timeline


def replay_direct(sched: Schedule, cost: CostModel) -> Timeline:
    """The same pricing written as a plain loop over the lists (the reference for the engine)."""
    t = {r: 0.0 for r in sched}
    pos = {r: 0 for r in sched}
    link_free: dict[tuple[int, int], float] = {}
    arrived: dict[tuple, list[float]] = {}  # (src, dst, mb, samples, send kind) -> arrival times, in send order
    out = Timeline({r: [] for r in sched})
    progress = True
    while progress:
        progress = False
        for r, acts in sched.items():
            while pos[r] < len(acts):
                a = acts[pos[r]]
                if a.kind in COMPUTE:
                    d = cost.compute_s(r, a)
                    out.spans[r].append(Span(r, a, t[r], t[r] + d))
                    t[r] += d
                elif a.is_send:
                    key = (r, a.peer)
                    start = max(t[r], link_free.get(key, 0.0))
                    end = start + cost.transfer_s(r, a.peer, a)
                    link_free[key] = end
                    arrived.setdefault((r, a.peer, a.microbatch, a.samples, a.kind), []).append(end)
                    out.spans[r].append(Span(r, a, start, end, end))
                elif a.is_recv:
                    send_kind = Kind.SEND_ACT if a.kind == Kind.RECV_ACT else Kind.SEND_GRAD
                    k = (a.peer, r, a.microbatch, a.samples, send_kind)
                    if not arrived.get(k):
                        break
                    ready = arrived[k].pop(0)
                    out.spans[r].append(Span(r, a, t[r], max(t[r], ready), ready))
                    t[r] = max(t[r], ready)
                elif a.kind == Kind.ALLREDUCE:
                    members = a.group or ()
                    heads = [sched[m][pos[m]] if pos[m] < len(sched[m]) else None for m in members]
                    if any(_same_collective(h, a) is None for h in heads):
                        break
                    start = max(t[m] for m in members)
                    end = start + cost.allreduce_s(a)
                    for m in members:
                        out.spans[m].append(Span(m, sched[m][pos[m]], t[m], end, start))
                        t[m] = end
                        pos[m] += 1
                    progress = True
                    continue
                pos[r] += 1
                progress = True
    stuck = {r: p for r, p in pos.items() if p < len(sched[r])}
    if stuck:
        raise ScheduleError("cannot price a schedule that deadlocks\n" + format_schedule(sched, pos))
    return out


def _same_collective(h: Action | None, a: Action) -> Action | None:
    if h is not None and h.kind == Kind.ALLREDUCE and h.group == a.group and h.tied == a.tied:
        return h
    return None
