"""The one form of a pipeline's send and receive slices in a Chrome trace, measured or predicted.

The runtime's recorder (:mod:`torchpp.runtime.tracing`) and the simulator's predicted traces
(:mod:`torchpp.sim.trace`) both lay out their p2p rows through :func:`p2p_event`, so one analysis
reads both. Nothing here runs a process group or imports torch.
"""
from __future__ import annotations

import hashlib

from ..schedules import Action, Kind
from .chrome import TraceWriter

P2P_NAMES = {Kind.SEND_ACT: ("send", "send_act"), Kind.SEND_GRAD: ("send", "send_grad"),
             Kind.RECV_ACT: ("recv", "recv_act"), Kind.RECV_GRAD: ("recv", "recv_grad")}
"""Per p2p kind: its row (send or recv) and its slice name."""


def flow_id(step: int, action: Action, src: int, dst: int) -> int:
    """The same id on the sending and the receiving rank."""
    grad = action.kind in (Kind.SEND_GRAD, Kind.RECV_GRAD)
    key = f"{step}:{action.microbatch}:{int(grad)}:{src}:{dst}:{action.samples}"
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:6], "little")


def p2p_event(w: TraceWriter, rank: int, step: int, row: str, a: Action, start_s: float, dur_s: float, nbytes: int,
              blocked_s: float, extra: dict | None = None) -> None:
    """One send or receive slice on its row, and its half of the send→receive flow arrow: the
    one form measured (runtime) and predicted (simulator) timelines share."""
    ev = w.complete(rank, row, P2P_NAMES[a.kind][1], start_s, dur_s,
                    {"stage": a.stage, "microbatch": a.microbatch, "peer": a.peer, "bytes": nbytes,
                     "samples": list(a.samples or ()), "blocked_s": blocked_s if w.precise else round(blocked_s, 6),
                     **(extra or {})})
    src, dst = (rank, a.peer) if row == "send" else (a.peer, rank)
    fid = flow_id(step, a, src, dst)
    if row == "send":
        w.events.append({"ph": "s", "id": fid, "cat": "p2p", "name": ev["name"], "pid": ev["pid"],
                         "tid": ev["tid"], "ts": ev["ts"]})
    else:
        w.events.append({"ph": "f", "bp": "e", "id": fid, "cat": "p2p",
                         "name": "send_act" if a.kind == Kind.RECV_ACT else "send_grad",
                         "pid": ev["pid"], "tid": ev["tid"], "ts": ev["ts"] + ev["dur"]})
