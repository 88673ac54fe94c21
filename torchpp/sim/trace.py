"""A priced schedule as a predicted Chrome trace, in exactly the runtime's form (DESIGN.md).

One process per rank named ``rank R · stage S · host H``; threads compute, send, recv and
collective; ``X`` events F<mb>/B<mb>/send_act/recv_act/send_grad/recv_grad/allreduce/optimizer
with args {stage, microbatch, bytes, layers}; a flow from each send to its receive. A
predicted and a measured timeline therefore open side by side and one analyser reads both.
"""
from __future__ import annotations

from typing import Any, Callable

from ..formats import Plan
from ..schedules import Action, Kind
from ..trace.chrome import TraceWriter
from .replay import Timeline

_NAME = {Kind.SEND_ACT: "send_act", Kind.RECV_ACT: "recv_act", Kind.SEND_GRAD: "send_grad",
         Kind.RECV_GRAD: "recv_grad", Kind.ALLREDUCE: "allreduce", Kind.OPTIMIZER: "optimizer"}
_THREAD = {Kind.FORWARD: "compute", Kind.BACKWARD: "compute", Kind.OPTIMIZER: "compute", Kind.SEND_ACT: "send",
           Kind.SEND_GRAD: "send", Kind.RECV_ACT: "recv", Kind.RECV_GRAD: "recv", Kind.ALLREDUCE: "collective"}


def event_name(a: Action) -> str:
    if a.kind == Kind.FORWARD:
        return f"F{a.microbatch}"
    if a.kind == Kind.BACKWARD:
        return f"B{a.microbatch}"
    return _NAME[a.kind]


def predicted_trace(plan: Plan, timeline: Timeline, *, bytes_of: Callable[[int, Action], float] | None = None,
                    metadata: dict[str, Any] | None = None) -> TraceWriter:
    """Events of every rank in one writer (like the runtime's merged ``timeline_step<N>_all.json``)."""
    w = TraceWriter(world_size=plan.world_size,
                    metadata={"predicted": True, "source": "torchpp simulate", "world_size": plan.world_size,
                              **(metadata or {})})
    sends: dict[tuple, dict[str, Any]] = {}
    recvs: dict[tuple, dict[str, Any]] = {}
    for r in sorted(timeline.spans):
        st = plan.stage_of_rank(r)
        host = plan.device_of_rank(r).host
        w.name_process(r, f"rank {r} · stage {st.index} · host {host}")
        for s in timeline.spans[r]:
            a = s.action
            nbytes = float(bytes_of(r, a)) if bytes_of is not None else 0.0
            args = {"stage": a.stage, "microbatch": a.microbatch, "bytes": int(round(nbytes)),
                    "layers": list(plan.stages[a.stage].layers)}
            if a.kind == Kind.ALLREDUCE:
                args["group"] = list(a.group or ())
                args["tied"] = a.tied
            elif a.peer is not None:
                args["peer"] = a.peer
            if a.samples is not None:
                args["samples"] = list(a.samples)
            ev = w.complete(r, _THREAD[a.kind], event_name(a), s.start, s.end - s.start, args)
            if a.is_send:
                sends[(r, a.peer, a.kind, a.microbatch, a.samples)] = ev
            elif a.is_recv:
                send_kind = Kind.SEND_ACT if a.kind == Kind.RECV_ACT else Kind.SEND_GRAD
                recvs[(a.peer, r, send_kind, a.microbatch, a.samples)] = ev
    for i, (key, ev) in enumerate(sorted(sends.items(), key=lambda kv: (kv[1]["ts"], kv[0][0], kv[0][1]))):
        if key in recvs:
            w.flow(i + 1, ev, recvs[key], name=ev["name"])
    return w
