"""Read a step's timeline (measured or predicted) and say where the time went.

Bubble split (seconds of one step, per rank on average), with p stages, m micro-batches,
c_s the per-micro-batch compute of stage s (its slowest device), c̄ their mean, c_max the
largest and r̄ the mean per-micro-batch recompute:

    real          = T − m·(c̄ − r̄)                 idle time of the average rank
    ideal         = (p − 1)·c̄                      fill/drain of a balanced pipeline
    imbalance     = (m − 1)·(c_max − c̄)            the slowest stage holding the rest up
    communication = T − (Σ_s c_s + (m − 1)·c_max)  everything above the compute-bound makespan
    recompute     = m·r̄

so that real = ideal + imbalance + communication + recompute exactly. The same function
reads measured traces from the runtime and predicted traces from the simulator.
"""
from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Iterable

COMPUTE_KINDS = ("F", "B")
COMM_KINDS = ("send_act", "recv_act", "send_grad", "recv_grad", "allreduce")
KINDS = COMPUTE_KINDS + COMM_KINDS + ("optimizer",)
_MB = re.compile(r"^([FB])(\d+)$")


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
                         peer=args.get("peer"), recompute_s=float(args.get("recompute_s") or 0.0)))
    return out


@dataclass
class RankStats:
    rank: int
    stage: int
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


@dataclass
class StepAnalysis:
    step_time_s: float
    num_stages: int
    num_microbatches: int
    ranks: dict[int, RankStats]
    stage_forward_s: list[float]
    """Per stage: forward seconds per micro-batch (slowest device of the group)."""
    stage_backward_s: list[float]
    bubble: dict[str, float]
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
    ranks: dict[int, RankStats] = {}
    mbs: dict[int, set] = defaultdict(set)
    for e in evs:
        st = ranks.setdefault(e.rank, RankStats(e.rank, e.stage))
        if e.kind == "F":
            st.forward_s += e.dur
            mbs[e.rank].add(e.microbatch)
        elif e.kind == "B":
            st.backward_s += e.dur
            st.recompute_s += e.recompute_s
        elif e.kind.startswith("recv"):
            st.recv_wait_s += e.dur
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
    p = max(s.stage for s in ranks.values()) + 1
    m = max((s.microbatches for s in ranks.values()), default=0) or 1
    fwd, bwd, rec = [0.0] * p, [0.0] * p, [0.0] * p
    for s in ranks.values():
        k = max(s.microbatches, 1)
        if (s.forward_s + s.backward_s) / k > fwd[s.stage] + bwd[s.stage]:
            fwd[s.stage], bwd[s.stage], rec[s.stage] = s.forward_s / k, s.backward_s / k, s.recompute_s / k
    c = [f + b for f, b in zip(fwd, bwd)]
    cbar, cmax, rbar = sum(c) / p, max(c), sum(rec) / p
    bubble = {"real": T - m * (cbar - rbar), "ideal": (p - 1) * cbar, "imbalance": (m - 1) * (cmax - cbar),
              "communication": T - (sum(c) + (m - 1) * cmax), "recompute": m * rbar}
    bubble["compute_bound_s"] = sum(c) + (m - 1) * cmax
    return StepAnalysis(step_time_s=T, num_stages=p, num_microbatches=m, ranks=ranks, stage_forward_s=fwd,
                        stage_backward_s=bwd, bubble=bubble, critical_path=critical_path(evs))


def critical_path(evs: list[Event]) -> dict[str, float]:
    """Seconds per kind along the chain of events that ends last.

    Walk back from the last event: a receive that waited is explained by the matching send
    on its peer (continue there, before the send); anything else by the previous event on
    its own rank.
    """
    by_rank: dict[int, list[Event]] = defaultdict(list)
    for e in evs:
        if not e.kind.startswith("send"):
            by_rank[e.rank].append(e)
    for lst in by_rank.values():
        lst.sort(key=lambda e: (e.start, e.end))
    sends = {(e.rank, e.peer, e.kind[5:], e.microbatch): e for e in evs if e.kind.startswith("send")}
    path: dict[str, float] = defaultdict(float)
    if not by_rank:
        return {}
    rank = max(by_rank, key=lambda r: by_rank[r][-1].end)
    i = len(by_rank[rank]) - 1
    eps = 1e-9
    while i >= 0:
        cur = by_rank[rank][i]
        snd = sends.get((cur.peer, cur.rank, cur.kind[5:], cur.microbatch)) if cur.kind.startswith("recv") else None
        if snd is not None and cur.dur > eps:
            path["wait_" + cur.kind[5:]] += cur.end - max(cur.start, snd.start)
            rank = snd.rank
            lst = by_rank[rank]
            i = max((k for k in range(len(lst)) if lst[k].end <= snd.start + eps), default=-1)
            continue
        path[cur.kind] += cur.dur
        i -= 1
    return dict(path)
