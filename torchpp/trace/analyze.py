"""Read a step's timeline (measured or predicted) and say where the time went.

The same function reads measured traces from the runtime and predicted timelines from the
simulator (``torchpp.sim.trace.timeline_events``, or the predicted Chrome trace read back),
so a plan's predicted bubble and ``torchpp analyze`` of its predicted trace are one number.

Bubble split, in seconds of one step [t0, t1] (T = t1 − t0), per rank then averaged over
ranks; every term is a sum of measured intervals on the rank's compute thread, none is a
remainder of the others and none is negative:

- **useful** U_r: the F/B (and zero-bubble I/W) durations less the recomputation inside the
  B (or I) events.
- **recompute** r_r: the B/I events' ``recompute_s``.
- **communication** k_r: the part of each receive's blocked time after the matching send
  started on the peer (the transfer itself), plus all-reduce and optimizer time (both are
  synchronisation the step waits for; the optimizer is counted here, not as useful work).
- **pipeline wait** W_r: the gaps with no action, plus the part of each receive's blocked
  time before the matching send started (waiting for the peer's compute). A receive whose
  send is not in the timeline counts wholly as communication. W_r is split into
  **ideal** = min(W_r, (d − 1)·Σ_s c_s / S), the fill/drain a balanced pipeline of d device
  groups and S chunks has (c_s the per-micro-batch F+B time of chunk s on its slowest device;
  one chunk per device: d = S and this is (p − 1)·c̄), and **imbalance** = W_r − ideal.

A *stage* here is a chunk: a rank may hold several (interleaved, V), its events carry the
chunk in ``args.stage``, and the per-stage figures are per chunk.

The intervals are swept in time order and clipped where they overlap (clock noise in
measured traces), so U_r + r_r + k_r + W_r = T and ``real`` = T − U_r =
ideal + imbalance + communication + recompute, exact up to rounding (checked in code).
``compute_bound_s`` = Σ_s c_s + (m − 1)·max_s c_s, the makespan with free communication.
"""
from __future__ import annotations

import bisect
import re
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Iterable

COMPUTE_KINDS = ("F", "B", "I", "W")
BACKWARD_KINDS = ("B", "I", "W")
"""The full backward, and the zero-bubble schedules' input- and weight-gradient halves."""
RECOMPUTING = ("B", "I")
"""Backward kinds that run the recomputed forwards (``recompute_s``)."""
COMM_KINDS = ("send_act", "recv_act", "send_grad", "recv_grad", "allreduce")
KINDS = COMPUTE_KINDS + COMM_KINDS + ("optimizer",)
BUBBLE_TERMS = ("ideal", "imbalance", "communication", "recompute")
_MB = re.compile(r"^([FBIW])(\d+)$")


@dataclass(slots=True)
class Event:
    rank: int
    stage: int
    kind: str
    microbatch: int | None
    start: float
    end: float
    bytes: int = 0
    peer: int | None = None
    recompute_s: float = 0.0
    blocked_s: float | None = None
    """For a receive: how long compute waited for it (None: the event itself is the wait)."""

    @property
    def wait_s(self) -> float:
        return self.dur if self.blocked_s is None else min(self.blocked_s, self.dur)

    @property
    def dur(self) -> float:
        return self.end - self.start


def events_from_trace(trace: dict[str, Any]) -> list[Event]:
    """Pipeline events of a Chrome trace (per-block events and metadata are skipped)."""
    out = []
    for ev in trace["traceEvents"]:
        if ev.get("ph") != "X":
            continue
        name, args = ev.get("name", ""), ev.get("args") or {}
        m = _MB.match(name)
        kind = m.group(1) if m else name
        if kind not in KINDS or "stage" not in args:
            continue
        mb = int(m.group(2)) if m else args.get("microbatch")
        start = ev["ts"] * 1e-6
        out.append(Event(rank=int(ev["pid"]), stage=int(args["stage"]), kind=kind, microbatch=mb, start=start,
                         end=start + ev.get("dur", 0.0) * 1e-6, bytes=int(args.get("bytes") or 0),
                         peer=args.get("peer"), recompute_s=float(args.get("recompute_s") or 0.0),
                         blocked_s=float(args["blocked_s"]) if args.get("blocked_s") is not None else None))
    return out


WIRE_KINDS = ("send_act", "send_grad", "allreduce")
"""Events whose ``bytes`` crossed a link: p2p sends and all-reduce payloads, as their wire format encoded them."""


def wire_bytes(traces: Iterable[dict[str, Any]], kinds: tuple[str, ...] = WIRE_KINDS) -> int:
    """Bytes the ranks of ``traces`` put on the wire (one counter for every report of bytes per step)."""
    return sum(e.bytes for t in traces for e in events_from_trace(t) if e.kind in kinds)


@dataclass
class RankStats:
    rank: int
    stage: int
    """The rank's first chunk (``chunks`` has them all)."""
    compute_s: float = 0.0
    forward_s: float = 0.0
    backward_s: float = 0.0
    recompute_s: float = 0.0
    recv_wait_s: float = 0.0
    send_s: float = 0.0
    allreduce_s: float = 0.0
    optimizer_s: float = 0.0
    idle_s: float = 0.0
    microbatches: int = 0
    useful_s: float = 0.0
    """F/B time less recomputation."""
    wait_s: float = 0.0
    """Pipeline wait: gaps plus receive time before the peer's send started."""
    transfer_s: float = 0.0
    """Receive time after the peer's send started."""
    real_s: float = 0.0
    ideal_s: float = 0.0
    imbalance_s: float = 0.0
    communication_s: float = 0.0
    chunk_compute_s: dict[int, float] = field(default_factory=dict)
    """Per chunk the rank holds: its F/B/I/W seconds."""

    @property
    def chunks(self) -> list[int]:
        return sorted(self.chunk_compute_s) or [self.stage]


@dataclass
class StepAnalysis:
    step_time_s: float
    num_stages: int
    num_microbatches: int
    ranks: dict[int, RankStats]
    stage_forward_s: list[float]
    """Per stage (chunk): forward seconds per micro-batch (slowest device of the group)."""
    stage_backward_s: list[float]
    bubble: dict[str, float]
    """Seconds per rank on average: real, ideal, imbalance, communication, recompute; and
    compute_bound_s."""
    critical_path: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"step_time_s": self.step_time_s, "num_stages": self.num_stages,
                "num_microbatches": self.num_microbatches, "stage_forward_s": self.stage_forward_s,
                "stage_backward_s": self.stage_backward_s, "bubble": self.bubble,
                "critical_path": self.critical_path,
                "ranks": {str(r): vars(s) for r, s in sorted(self.ranks.items())}}


def analyze(events: Iterable[Event]) -> StepAnalysis:
    evs = sorted(events, key=lambda e: (e.start, e.end))
    if not evs:
        raise ValueError("timeline has no pipeline events (F<mb>/B<mb>/send/recv/allreduce/optimizer with args.stage)")
    t0, t1 = min(e.start for e in evs), max(e.end for e in evs)
    T = t1 - t0
    ranks = rank_stats(evs, T)
    p = max(max(s.chunks) for s in ranks.values()) + 1
    m = max((s.microbatches for s in ranks.values()), default=0) or 1
    fwd, bwd = chunk_times(evs, ranks, p)
    c = [f + b for f, b in zip(fwd, bwd)]
    d = len({tuple(s.chunks) for s in ranks.values()})
    fill = (d - 1) * sum(c) / p
    by_rank: dict[int, list[Event]] = defaultdict(list)
    for e in evs:
        by_rank[e.rank].append(e)
    sends = send_starts(evs)
    for r, st in ranks.items():
        split_rank(st, by_rank[r], sends, t0, t1, fill)
    n = len(ranks)
    bubble = {"real": sum(s.real_s for s in ranks.values()) / n,
              "ideal": sum(s.ideal_s for s in ranks.values()) / n,
              "imbalance": sum(s.imbalance_s for s in ranks.values()) / n,
              "communication": sum(s.communication_s for s in ranks.values()) / n,
              "recompute": sum(s.recompute_s for s in ranks.values()) / n,
              "compute_bound_s": sum(c) + (m - 1) * max(c)}
    return StepAnalysis(step_time_s=T, num_stages=p, num_microbatches=m, ranks=ranks, stage_forward_s=fwd,
                        stage_backward_s=bwd, bubble=bubble, critical_path=critical_path(evs))


def rank_stats(evs: list[Event], T: float) -> dict[int, RankStats]:
    """Per rank, the seconds of each kind of event (as recorded, before any clipping)."""
    ranks: dict[int, RankStats] = {}
    mbs: dict[int, set] = defaultdict(set)
    for e in evs:
        st = ranks.setdefault(e.rank, RankStats(e.rank, e.stage))
        if e.kind in COMPUTE_KINDS:
            st.chunk_compute_s[e.stage] = st.chunk_compute_s.get(e.stage, 0.0) + e.dur
            st.stage = min(st.stage, e.stage)
        if e.kind == "F":
            st.forward_s += e.dur
            mbs[e.rank].add(e.microbatch)
        elif e.kind in BACKWARD_KINDS:
            st.backward_s += e.dur
        elif e.kind.startswith("recv"):
            st.recv_wait_s += e.wait_s
        elif e.kind.startswith("send"):
            st.send_s += e.dur
        elif e.kind == "allreduce":
            st.allreduce_s += e.dur
        elif e.kind == "optimizer":
            st.optimizer_s += e.dur
    for r, st in ranks.items():
        st.compute_s = st.forward_s + st.backward_s
        st.microbatches = len(mbs[r])
        st.idle_s = max(0.0, T - st.compute_s - st.recv_wait_s - st.allreduce_s - st.optimizer_s)
    return ranks


def chunk_times(evs: list[Event], ranks: dict[int, RankStats], p: int) -> tuple[list[float], list[float]]:
    """Per chunk, forward and backward seconds per micro-batch on its slowest device."""
    per: dict[tuple[int, int], list[float]] = defaultdict(lambda: [0.0, 0.0])
    for e in evs:
        if e.kind in COMPUTE_KINDS:
            per[(e.rank, e.stage)][0 if e.kind == "F" else 1] += e.dur
    fwd, bwd = [0.0] * p, [0.0] * p
    for (r, c), (f, b) in per.items():
        k = max(ranks[r].microbatches, 1)
        if (f + b) / k > fwd[c] + bwd[c]:
            fwd[c], bwd[c] = f / k, b / k
    return fwd, bwd


def message_key(e: Event) -> tuple:
    """What pairs a send with its receive: (src, dst, act|grad, microbatch, boundary), the boundary
    being the chunk an activation leaves (c for c -> c+1; a gradient goes back over it), so two
    chunks of one rank sending to the same peer (interleaved) are told apart."""
    act = e.kind.endswith("_act")
    if e.kind.startswith("send"):
        return (e.rank, e.peer, e.kind[5:], e.microbatch, e.stage if act else e.stage - 1)
    return (e.peer, e.rank, e.kind[5:], e.microbatch, e.stage - 1 if act else e.stage)


def send_starts(evs: list[Event]) -> dict[tuple, float]:
    """``message_key`` → when that send started on its rank."""
    return {message_key(e): e.start for e in evs if e.kind.startswith("send")}


def occupancy(evs: list[Event], sends: dict[tuple, float]) -> list[tuple[float, float, str, float]]:
    """The rank's compute thread as (start, end, what, recompute) intervals, what ∈ {compute,
    sync, wait, transfer}; a blocked receive is cut where the matching send started."""
    out = []
    for e in evs:
        if e.kind in COMPUTE_KINDS:
            out.append((e.start, e.end, "compute", e.recompute_s if e.kind in RECOMPUTING else 0.0))
        elif e.kind in ("allreduce", "optimizer"):
            out.append((e.start, e.end, "sync", 0.0))
        elif e.kind.startswith("recv"):
            blocked = e.dur if e.blocked_s is None else e.blocked_s
            if blocked <= 0.0:
                continue
            b0, b1 = e.end - blocked, e.end
            sent = sends.get(message_key(e))
            cut = b0 if sent is None else min(max(sent, b0), b1)
            out += [(b0, cut, "wait", 0.0), (cut, b1, "transfer", 0.0)]
    return sorted(out, key=lambda x: (x[0], x[1]))


def split_rank(st: RankStats, evs: list[Event], sends: dict[tuple, float], t0: float, t1: float,
               fill: float) -> None:
    """Fill in the rank's bubble terms from its intervals (see the module docstring)."""
    acc = {"compute": 0.0, "sync": 0.0, "wait": 0.0, "transfer": 0.0}
    recompute, cursor = 0.0, t0
    for start, end, what, rec in occupancy(evs, sends):
        if end <= cursor:
            continue
        acc["wait"] += max(0.0, start - cursor)  # nothing ran: the rank waited for the pipeline
        length = end - max(start, cursor)
        acc[what] += length
        recompute += min(rec, length)
        cursor = end
    acc["wait"] += t1 - cursor
    st.recompute_s = recompute
    st.useful_s = acc["compute"] - recompute
    st.wait_s, st.transfer_s = acc["wait"], acc["transfer"]
    st.communication_s = acc["transfer"] + acc["sync"]
    st.ideal_s = min(st.wait_s, fill)
    st.imbalance_s = st.wait_s - st.ideal_s
    st.real_s = (t1 - t0) - st.useful_s
    parts = st.ideal_s + st.imbalance_s + st.communication_s + st.recompute_s
    if abs(parts - st.real_s) > 1e-9 * max(t1 - t0, 1e-300):
        raise RuntimeError(f"rank {st.rank}: bubble terms add up to {parts!r}, not real {st.real_s!r}")


def critical_path(evs: list[Event]) -> dict[str, float]:
    """Seconds per kind along the chain of work that ends last (they add up to the step time).

    Walk back in time from the last event: a receive that made compute wait is explained by
    the matching send on its peer (continue there, before the send started); anything else
    by the previous event on its own rank; gaps with no explanation count as ``idle``.
    """
    eps = 1e-9
    seq: dict[int, list[Event]] = defaultdict(list)
    for e in evs:
        if e.kind in COMPUTE_KINDS or e.kind in ("optimizer", "allreduce"):
            seq[e.rank].append(e)
        elif e.kind.startswith("recv") and e.wait_s > eps:  # the part of a receive compute waited for
            seq[e.rank].append(Event(e.rank, e.stage, e.kind, e.microbatch, e.end - e.wait_s, e.end, e.bytes, e.peer))
    if not seq:
        return {}
    for lst in seq.values():
        lst.sort(key=lambda e: (e.end, e.start))
    ends = {r: [e.end for e in lst] for r, lst in seq.items()}  # built once: the walk stays linear
    sends = {message_key(e): e for e in evs if e.kind.startswith("send")}
    t_first = min(e.start for e in evs)
    rank = max(seq, key=lambda r: seq[r][-1].end)
    frontier = max(e.end for e in evs)
    path: dict[str, float] = defaultdict(float)
    for _ in range(2 * len(evs) + 2):
        lst = seq[rank]
        k = bisect.bisect_right(ends[rank], frontier + eps) - 1
        while k >= 0 and lst[k].start >= frontier - eps:
            k -= 1  # already walked, starts after the frontier, or takes no time there (a 0 s optimizer)
        if k < 0:
            break
        cur = lst[k]
        path["idle"] += max(0.0, frontier - cur.end)
        snd = sends.get(message_key(cur)) if cur.kind.startswith("recv") else None
        if snd is not None:
            t_send = min(max(snd.start, cur.start), cur.end)
            path[cur.kind.replace("recv", "wait")] += cur.end - t_send
            rank, frontier = snd.rank, t_send
            continue
        path[cur.kind] += min(cur.dur, max(0.0, min(frontier, cur.end) - cur.start))
        frontier = min(frontier, cur.start)
    path["idle"] += max(0.0, frontier - t_first)
    return {k: v for k, v in path.items() if v > 0}
