"""A priced schedule as a predicted Chrome trace, in exactly the runtime's form, and as the
analysis' events.

What :class:`torchpp.runtime.tracing.StepRecorder` writes for a measured step, this writes for
a predicted one: per rank a process ``rank R · stage S · host H`` with rows compute, send,
recv and collective; ``F<mb>``/``B<mb>``/``optimizer`` with {stage, microbatch, layers,
samples, recompute_s}; ``send_*``/``recv_*`` with {stage, microbatch, peer, bytes, samples,
blocked_s}, laid out one after another on their row (a slice starts when its message became
the row's next outstanding one: receives are posted at the start of the step, sends when
reached); ``allreduce`` with {stage, group, tied, bytes}; a flow from each send's start to
its receive's end with the runtime's ids; the per-rank traces merged as
``timeline_step<N>_all.json`` is. A predicted and a measured timeline therefore open side by
side and :mod:`torchpp.trace.analyze` reads both.

:func:`timeline_events` gives the analysis the same events the predicted trace gives when read
back (one layout, :func:`rank_slices`, serves both), without the trace's float round trip;
times are written unrounded so the two analyses agree to 1e-9 s.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from ..cost import stage_time
from ..formats import Plan
from ..schedules import Action, Kind
from ..trace.analyze import Event
from ..trace.chrome import TraceWriter, merge
from .replay import Span, Timeline

_P2P = {Kind.SEND_ACT: ("send", "send_act"), Kind.SEND_GRAD: ("send", "send_grad"),
        Kind.RECV_ACT: ("recv", "recv_act"), Kind.RECV_GRAD: ("recv", "recv_grad")}
PerAction = Callable[[int, Action], float]
"""(rank, action) → a number (bytes moved, seconds of recomputation)."""


_PASS = (Kind.FORWARD, Kind.BACKWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT)


def event_name(a: Action) -> str:
    """``F<mb>``, ``B<mb>``, ``I<mb>``, ``W<mb>`` (chunk in ``args.stage``), or the comm/sync name."""
    if a.kind in _PASS:
        return f"{a.kind.value}{a.microbatch}"
    if a.kind == Kind.OPTIMIZER:
        return "optimizer"
    if a.kind == Kind.ALLREDUCE:
        return "allreduce"
    return _P2P[a.kind][1]


def event_kind(a: Action) -> str:
    """The analysis' kind of an action (``F``, ``B``, ``send_act``, …)."""
    return a.kind.value if a.kind in _PASS else event_name(a)


@dataclass(frozen=True, slots=True)
class Slice:
    """One span as its trace row shows it."""

    row: str
    """compute, send, recv or collective."""
    span: Span
    start: float
    end: float
    blocked: float = 0.0
    """Receives: how long compute waited for the message."""


def rank_slices(spans: list[Span]) -> list[Slice]:
    """Lay one rank's spans out on the trace rows, as the runtime's recorder does."""
    out: list[Slice] = []
    p2p: list[tuple[str, Span, float]] = []
    for s in spans:
        a = s.action
        if a.kind in _PASS or a.kind == Kind.OPTIMIZER:
            out.append(Slice("compute", s, s.start, s.end))
        elif a.kind == Kind.ALLREDUCE:  # the collective itself: from its last member's arrival
            out.append(Slice("collective", s, s.ready, s.end))
        elif a.is_send:
            p2p.append(("send", s, s.start))  # posted when the rank reaches it
        else:
            p2p.append(("recv", s, 0.0))      # every receive of the step is posted up front
    for row in ("send", "recv"):
        prev_end = float("-inf")
        # a message is done when it has arrived (Span.ready); a receive may be reached later
        for _, s, posted in sorted((p for p in p2p if p[0] == row), key=lambda p: p[1].ready):
            start = max(posted, prev_end)
            prev_end = s.ready
            out.append(Slice(row, s, start, s.ready, s.end - s.start if row == "recv" else 0.0))
    return out


def recompute_of(plan: Plan, profiles) -> PerAction:
    """Seconds of recomputation inside each BACKWARD (or BACKWARD_INPUT, which rebuilds the
    activations), from the profiles the plan was priced with (``stage_time(...).recompute``)."""
    def rec(rank: int, a: Action) -> float:
        if a.kind not in (Kind.BACKWARD, Kind.BACKWARD_INPUT):
            return 0.0
        d = plan.stages[a.stage].device(rank)
        n = a.samples[1] - a.samples[0] if a.samples is not None else d.samples
        return stage_time(profiles, d.host, plan.stages[a.stage]).recompute(n)
    return rec


def timeline_events(plan: Plan, timeline: Timeline, *, bytes_of: PerAction | None = None,
                    recompute_of: PerAction | None = None) -> list[Event]:
    """The analysis' events of a predicted timeline: those its predicted trace reads back as."""
    out = []
    for rank in sorted(timeline.spans):
        for sl in rank_slices(timeline.spans[rank]):
            a = sl.span.action
            kind = event_kind(a)
            p2p = sl.row in ("send", "recv")
            nbytes = int(round(bytes_of(rank, a))) if bytes_of is not None and sl.row != "compute" else 0
            rec = recompute_of(rank, a) if recompute_of is not None and kind in ("B", "I") else 0.0
            out.append(Event(rank, a.stage, kind, a.microbatch, sl.start, sl.end, nbytes,
                             a.peer if p2p else None, float(rec or 0.0), sl.blocked if p2p else None))
    return out


def rank_trace(plan: Plan, rank: int, spans: list[Span], *, step: int = 0, bytes_of: PerAction | None = None,
               recompute_of: PerAction | None = None) -> dict[str, Any]:
    """One rank's predicted step, as its runtime recorder would have written it."""
    from ..trace.timeline import p2p_event

    chunks = [s.index for s in plan.stages_of_rank(rank)]
    host = plan.device_of_rank(rank).host
    w = TraceWriter(world_size=plan.world_size, rank=rank, precise=True,
                    metadata={"step": step, "rank": rank, "stage": chunks[0], "stages": chunks, "host": host,
                              "clock_offset_s": 0.0, "clock_rtt_s": 0.0, "clock": "predicted"})
    w.name_process(rank, f"rank {rank} · {process_stages(chunks)} · host {host}")
    nbytes = (lambda a: int(round(bytes_of(rank, a)))) if bytes_of is not None else (lambda a: 0)
    for sl in rank_slices(spans):
        a = sl.span.action
        if sl.row == "compute":
            args: dict[str, Any] = {"stage": a.stage, "microbatch": a.microbatch,
                                    "layers": list(plan.stages[a.stage].layers)}
            if a.samples is not None:
                args["samples"] = list(a.samples)
            if a.kind in (Kind.BACKWARD, Kind.BACKWARD_INPUT) and recompute_of is not None and recompute_of(rank, a):
                args["recompute_s"] = recompute_of(rank, a)
            w.complete(rank, "compute", event_name(a), sl.start, sl.end - sl.start, args)
        elif sl.row == "collective":
            w.complete(rank, "collective", "allreduce", sl.start, sl.end - sl.start,
                       {"stage": a.stage, "group": list(a.group or ()), "tied": a.tied, "bytes": nbytes(a)})
        else:
            p2p_event(w, rank, step, sl.row, a, sl.start, sl.end - sl.start, nbytes(a), sl.blocked)
    return w.to_json()


def process_stages(chunks: list[int]) -> str:
    """``stage 2`` for one chunk, ``stages 0,7`` for a rank holding several."""
    return f"stage {chunks[0]}" if len(chunks) == 1 else "stages " + ",".join(map(str, chunks))


def predicted_trace(plan: Plan, timeline: Timeline, *, step: int = 0, bytes_of: PerAction | None = None,
                    recompute_of: PerAction | None = None, metadata: dict[str, Any] | None = None) -> dict[str, Any]:
    """All ranks merged with zero clock offsets, like the runtime's ``timeline_step<N>_all.json``."""
    ranks = sorted(timeline.spans)
    traces = [rank_trace(plan, r, timeline.spans[r], step=step, bytes_of=bytes_of, recompute_of=recompute_of)
              for r in ranks]
    return merge(traces, [0.0] * len(traces),
                 metadata={"step": step, "predicted": True, "source": "torchpp simulate", **(metadata or {})})
