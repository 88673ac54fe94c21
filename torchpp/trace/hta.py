"""A step's timeline as Holistic Trace Analysis (HTA) reads it: one Kineto-shaped file per rank.

HTA's temporal breakdown, idle-time breakdown and comm/compute overlap are GPU-centric: they
read *kernels* (events with ``args.stream`` ≥ 0 and a ``correlation`` id linking each to the
host call that launched it), classify them by name (``^nccl.*Kernel`` is communication) and
sweep their intervals. A CPU pipeline has no kernels, so this module gives each rank's
**compute thread** the role of the GPU's stream, through the one analysis
(:func:`torchpp.trace.analyze.occupancy`, clipped exactly as ``split_rank`` clips it):

- stream 7 (``COMPUTE_STREAM``) carries what the compute thread did, in order and without
  overlap: ``F<mb>``/``B<mb>``/``I<mb>``/``W<mb>`` and ``optimizer`` as compute kernels, and the
  communication it waited for as NCCL-named kernels: ``ncclKernel_recv_act``/``_recv_grad`` for
  the blocked part of a receive after the peer's send started (torchpp's *transfer*) and
  ``ncclKernel_allreduce``. The part of a receive before the peer's send started is no kernel:
  the stream is idle, as torchpp counts it (pipeline wait).
- stream 8 (``HIDDEN_STREAM``) carries the p2p transfers hidden under compute: each received
  message's window (from its send's start, or the receive's posting if later, to the
  receive's end) intersected with the compute kernels, named ``ncclKernel_<kind>``. It lies
  only under compute, so it adds nothing to HTA's busy time, and it is what HTA's
  comm/compute overlap measures.
- two zero-length kernels (``step_begin``/``step_end``) at the step's first and last instant
  across all ranks, so HTA's ``kernel_time`` of every rank is torchpp's step time T (a rank
  that starts late or ends early is idle there, as torchpp counts it).
- each kernel has a ``cuda_runtime`` launch event on the rank's compute thread with the same
  ``correlation``, stamped when the host issued the work: a compute kernel when it started
  (a gap before it is the host's own time — HTA's *host wait*), a transfer when its receive
  was posted and the step markers at the step's start (a gap before them is the pipeline's,
  HTA's *other*).

Times are integer microseconds (HTA rounds fractional ones inward, which would shorten each
kernel by up to 2 µs); rounding both ends keeps adjacent kernels adjacent. The rank's own
torchpp events are kept as CPU events (stream −1: HTA's kernel analyses skip them) and a
``ProfilerStep#N`` annotation is added where the timeline has none (predicted traces).

With this mapping HTA's per-rank numbers are torchpp's (:func:`expected_hta`): idle = the
pipeline wait, compute = useful + recompute + optimizer, non-compute = communication −
optimizer (torchpp counts the optimizer as synchronisation, HTA as the compute it is),
kernel time = T, and the overlap = hidden / (hidden + non-compute).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..formats import read_json, write_json
from .analyze import COMPUTE_KINDS, Event, StepAnalysis, analyze, events_from_trace, message_key, occupancy, \
    send_starts
from .chrome import load_trace
from .kineto import merge_kineto

COMPUTE_STREAM = 7
"""The compute thread as a stream (7 is the default CUDA stream's number in Kineto traces)."""
HIDDEN_STREAM = 8
"""Transfers hidden under compute, as if on a separate NCCL stream."""
DEVICE_PID_BASE = 1000
"""The pseudo-device of rank R is process ``DEVICE_PID_BASE + R`` (a row apart in Perfetto)."""


@dataclass(frozen=True, slots=True)
class Kernel:
    """One kernel-like interval of a rank, in seconds on the timeline's clock."""

    name: str
    start: float
    end: float
    launch: float
    """When the host issued it (the ``cuda_runtime`` event's time)."""
    stream: int
    comm: bool


def _comm_name(kind: str) -> str:
    return f"ncclKernel_{kind}"


def stream_kernels(evs: list[Event], sends: dict[tuple, float], t0: float, t1: float) -> list[Kernel]:
    """The compute thread's occupancy as stream-7 kernels, clipped as ``split_rank`` clips it
    (a waiting interval is no kernel), between the two step markers."""
    by_span = {(e.start, e.end): e for e in evs if e.kind in COMPUTE_KINDS + ("allreduce", "optimizer")}
    recv_by_end = {e.end: e for e in evs if e.kind.startswith("recv")}
    out = [Kernel("step_begin", t0, t0, t0, COMPUTE_STREAM, False)]
    cursor = t0
    for start, end, what, _ in occupancy(evs, sends):
        if end <= cursor:
            continue
        s, cursor = max(start, cursor), end
        if what == "wait":
            continue
        if what == "transfer":
            r = recv_by_end[end]
            out.append(Kernel(_comm_name(r.kind), s, end, r.start, COMPUTE_STREAM, True))
            continue
        e = by_span[(start, end)]
        name = e.kind if e.microbatch is None or e.kind not in COMPUTE_KINDS else f"{e.kind}{e.microbatch}"
        comm = e.kind == "allreduce"
        out.append(Kernel(_comm_name(name) if comm else name, s, end, s, COMPUTE_STREAM, comm))
    out.append(Kernel("step_end", t1, t1, t0, COMPUTE_STREAM, False))
    return out


def hidden_transfers(evs: list[Event], sends: dict[tuple, float], compute: list[Kernel]) -> list[Kernel]:
    """Each received message's transfer window intersected with the rank's compute kernels."""
    spans = sorted((k.start, k.end) for k in compute if not k.comm and k.end > k.start)
    out = []
    for r in evs:
        if not r.kind.startswith("recv"):
            continue
        w0 = max(sends.get(message_key(r), r.start), r.start)
        for s, e in spans:
            lo, hi = max(s, w0), min(e, r.end)
            if hi > lo:
                out.append(Kernel(_comm_name(r.kind), lo, hi, r.start, HIDDEN_STREAM, True))
    return out


def rank_kernels(events: list[Event]) -> dict[int, list[Kernel]]:
    """Per rank, its stream-7 and stream-8 kernels (see the module docstring)."""
    evs = sorted(events, key=lambda e: (e.start, e.end))
    if not evs:
        raise ValueError("timeline has no pipeline events to export for HTA")
    t0, t1 = evs[0].start, max(e.end for e in evs)
    sends = send_starts(evs)
    by_rank: dict[int, list[Event]] = defaultdict(list)
    for e in evs:
        by_rank[e.rank].append(e)
    out = {}
    for r, mine in sorted(by_rank.items()):
        ks = stream_kernels(mine, sends, t0, t1)
        out[r] = ks + hidden_transfers(mine, sends, ks)
    return out


def _us(t_s: float) -> int:
    return int(round(t_s * 1e6))


CORRELATION_BASE = 1 << 20
"""First correlation id. Kineto's ids are large; HTA 0.5 narrows a column of small ones to int8
and then fails to store event indices in it."""


def kernel_events(rank: int, kernels: list[Kernel], corr0: int = CORRELATION_BASE) -> list[dict[str, Any]]:
    """Kineto's pair per kernel: the ``kernel`` on the pseudo-device and its ``cuda_runtime`` launch."""
    out: list[dict[str, Any]] = []
    dev = DEVICE_PID_BASE + rank
    for i, k in enumerate(kernels, start=corr0):
        ts = _us(k.start)
        out.append({"ph": "X", "cat": "kernel", "name": k.name, "pid": dev, "tid": k.stream, "ts": ts,
                    "dur": _us(k.end) - ts,
                    "args": {"device": rank, "stream": k.stream, "correlation": i, "External id": i}})
        out.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": rank, "tid": 0,
                    "ts": _us(k.launch), "dur": 0, "args": {"correlation": i, "External id": i}})
    return out


def _metadata(rank: int) -> list[dict[str, Any]]:
    dev = DEVICE_PID_BASE + rank
    rows = [("process_name", dev, 0, {"name": f"rank {rank} · compute thread as a device (HTA)"}),
            ("process_labels", dev, 0, {"labels": "GPU-like"}),
            ("thread_name", dev, COMPUTE_STREAM, {"name": f"stream {COMPUTE_STREAM} · compute thread"}),
            ("thread_name", dev, HIDDEN_STREAM, {"name": f"stream {HIDDEN_STREAM} · transfers under compute"})]
    return [{"ph": "M", "name": n, "pid": p, "tid": t, "ts": 0, "args": a} for n, p, t, a in rows]


def rank_trace(trace: dict[str, Any], rank: int, kernels: list[Kernel], step: int,
               kineto: dict[str, Any] | None = None) -> dict[str, Any]:
    """Rank ``rank``'s HTA file: its torchpp events (CPU side), its torch.profiler trace of the
    same step when given (merged onto the same clock), and the kernels, Kineto-shaped."""
    own = [e for e in trace["traceEvents"] if e.get("pid") == rank]
    if kineto is not None:
        base = {k: trace[k] for k in ("baseTimeNanoseconds",) if k in trace}
        own = merge_kineto({**base, "traceEvents": own}, kineto)["traceEvents"]
    events = own + _metadata(rank) + kernel_events(rank, kernels)
    if not any(str(e.get("name", "")).startswith("ProfilerStep#") for e in own):
        t0, t1 = _us(kernels[0].start), _us(max(k.end for k in kernels))
        events.append({"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{step}", "pid": rank, "tid": 0,
                       "ts": t0, "dur": t1 - t0, "args": {}})
    world = int((trace.get("metadata") or {}).get("world_size") or len({e.get("pid") for e in own}) or 1)
    out: dict[str, Any] = {"distributedInfo": {"rank": rank, "world_size": world}, "schemaVersion": 1,
                           "displayTimeUnit": "ms", "traceEvents": sorted(events, key=_order)}
    if "baseTimeNanoseconds" in trace:
        out["baseTimeNanoseconds"] = trace["baseTimeNanoseconds"]
    return out


def _order(ev: dict[str, Any]) -> tuple:
    """Metadata first, then by time, the longer (enclosing) slice first: the order Perfetto nests by."""
    return (ev.get("ph") != "M", ev.get("ts", 0), -float(ev.get("dur", 0) or 0))


def export_hta(trace: dict[str, Any], out_dir: str | Path, step: int = 0,
               kineto: dict[int, dict[str, Any]] | None = None) -> list[Path]:
    """Write ``out_dir/rank<R>.json`` for every rank of a merged timeline; give the files.

    ``kineto`` maps a rank to its torch.profiler trace of the same step (merged in). ``out_dir``
    then holds one step, ready for ``hta.trace_analysis.TraceAnalysis(trace_dir=out_dir)``.
    """
    out = Path(out_dir)
    kernels = rank_kernels(events_from_trace(trace))
    return [write_json(out / f"rank{r}.json", rank_trace(trace, r, ks, step, (kineto or {}).get(r)))
            for r, ks in kernels.items()]


def export_step(trace_dir: str | Path, step: int, out_dir: str | Path) -> list[Path]:
    """Export step ``step`` of a run's trace folder: ``timeline_step<N>_all.json`` and, where the run
    captured them (``--torch-profiler``), ``torch_step<N>_rank<R>.json``."""
    d = Path(trace_dir)
    trace = load_trace(d / f"timeline_step{step}_all.json")
    kineto = {int(p.stem.rpartition("rank")[2]): read_json(p) for p in d.glob(f"torch_step{step}_rank*.json")
              if p.stem.rpartition("rank")[2].isdigit()}
    return export_hta(trace, out_dir, step, kineto)


def _union_s(spans: list[tuple[float, float]]) -> float:
    """Seconds covered by ``spans`` (two receives' windows may cover the same compute)."""
    total, cursor = 0.0, float("-inf")
    for s, e in sorted(spans):
        if e > cursor:
            total += e - max(s, cursor)
            cursor = e
    return total


def expected_hta(trace: dict[str, Any]) -> dict[int, dict[str, float]]:
    """Per rank, what HTA reports for the export of ``trace``, in µs, from torchpp's own analysis.

    ``idle``/``compute``/``non_compute``/``kernel`` are the temporal breakdown's columns (the
    idle-time breakdown's total on stream 7 is ``idle`` too); ``overlap_pct`` is
    ``get_comm_comp_overlap``'s percentage.
    """
    a: StepAnalysis = analyze(events_from_trace(trace))
    hidden = {r: _union_s([(k.start, k.end) for k in ks if k.stream == HIDDEN_STREAM])
              for r, ks in rank_kernels(events_from_trace(trace)).items()}
    out = {}
    for r, st in a.ranks.items():
        comm = st.communication_s - st.optimizer_s
        out[r] = {"idle": st.wait_s * 1e6, "compute": (st.useful_s + st.recompute_s + st.optimizer_s) * 1e6,
                  "non_compute": comm * 1e6, "kernel": a.step_time_s * 1e6,
                  "overlap_pct": 100.0 * hidden[r] / (hidden[r] + comm) if hidden[r] + comm > 0 else 0.0}
    return out
