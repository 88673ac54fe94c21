"""A priced schedule as a predicted Chrome trace, in exactly the runtime's form.

What :class:`torchpp.trace.timeline.StepRecorder` writes for a measured step, this writes for
a predicted one: per rank a process ``rank R · stage S · host H`` with rows compute, send,
recv and collective; ``F<mb>``/``B<mb>``/``optimizer`` with {stage, microbatch, layers,
samples}; ``send_*``/``recv_*`` with {stage, microbatch, peer, bytes, samples, blocked_s},
laid out one after another on their row (a slice starts when its message became the row's
next outstanding one: receives are posted at the start of the step, sends when reached);
``allreduce`` with {stage, group, tied, bytes}; a flow from each send's start to its
receive's end with the runtime's ids; the per-rank traces merged as
``timeline_step<N>_all.json`` is. A predicted and a measured timeline therefore open side by
side and :mod:`torchpp.trace.analyze` reads both.
"""
from __future__ import annotations

from typing import Any, Callable

from ..formats import Plan
from ..schedules import Action, Kind
from ..trace.chrome import TraceWriter, merge
from .replay import Span, Timeline

_P2P = {Kind.SEND_ACT: ("send", "send_act"), Kind.SEND_GRAD: ("send", "send_grad"),
        Kind.RECV_ACT: ("recv", "recv_act"), Kind.RECV_GRAD: ("recv", "recv_grad")}


def event_name(a: Action) -> str:
    if a.kind == Kind.FORWARD:
        return f"F{a.microbatch}"
    if a.kind == Kind.BACKWARD:
        return f"B{a.microbatch}"
    if a.kind == Kind.OPTIMIZER:
        return "optimizer"
    if a.kind == Kind.ALLREDUCE:
        return "allreduce"
    return _P2P[a.kind][1]


def rank_trace(plan: Plan, rank: int, spans: list[Span], *, step: int = 0,
               bytes_of: Callable[[int, Action], float] | None = None) -> dict[str, Any]:
    """One rank's predicted step, as its runtime recorder would have written it."""
    from ..trace.timeline import p2p_event

    st = plan.stage_of_rank(rank)
    host = plan.device_of_rank(rank).host
    w = TraceWriter(world_size=plan.world_size, rank=rank,
                    metadata={"step": step, "rank": rank, "stage": st.index, "host": host, "clock_offset_s": 0.0,
                              "clock_rtt_s": 0.0, "clock": "predicted"})
    w.name_process(rank, f"rank {rank} · stage {st.index} · host {host}")
    nbytes = (lambda a: int(round(bytes_of(rank, a)))) if bytes_of is not None else (lambda a: 0)
    p2p: list[tuple[str, Span, float]] = []
    for s in spans:
        a = s.action
        if a.kind in (Kind.FORWARD, Kind.BACKWARD, Kind.OPTIMIZER):
            args: dict[str, Any] = {"stage": a.stage, "microbatch": a.microbatch, "layers": list(st.layers)}
            if a.samples is not None:
                args["samples"] = list(a.samples)
            w.complete(rank, "compute", event_name(a), s.start, s.end - s.start, args)
        elif a.kind == Kind.ALLREDUCE:
            w.complete(rank, "collective", "allreduce", s.ready, s.end - s.ready,
                       {"stage": a.stage, "group": list(a.group or ()), "tied": a.tied, "bytes": nbytes(a)})
        elif a.is_send:
            p2p.append(("send", s, s.start))  # posted when the rank reaches it
        else:
            p2p.append(("recv", s, 0.0))      # every receive of the step is posted up front
    for row in ("send", "recv"):
        prev_end = float("-inf")
        # a message is done when it has arrived (Span.ready); a receive may be reached later
        for _, s, posted in sorted((p for p in p2p if p[0] == row), key=lambda p: p[1].ready):
            a = s.action
            start = max(posted, prev_end)
            prev_end = s.ready
            blocked = s.end - s.start if row == "recv" else 0.0
            p2p_event(w, rank, step, row, a, start, s.ready - start, nbytes(a), blocked)
    return w.to_json()


def predicted_trace(plan: Plan, timeline: Timeline, *, step: int = 0,
                    bytes_of: Callable[[int, Action], float] | None = None,
                    metadata: dict[str, Any] | None = None) -> dict[str, Any]:
    """All ranks merged with zero clock offsets, like the runtime's ``timeline_step<N>_all.json``."""
    ranks = sorted(timeline.spans)
    traces = [rank_trace(plan, r, timeline.spans[r], step=step, bytes_of=bytes_of) for r in ranks]
    return merge(traces, [0.0] * len(traces),
                 metadata={"step": step, "predicted": True, "source": "torchpp simulate", **(metadata or {})})
