"""Measured per-rank timelines of chosen training steps, and the merged view of all ranks.

The runtime's side of tracing (clock ping-pong, the per-step recorder, gathering the ranks'
files on rank 0); the file format, the p2p slices' form and the analysis are ``torchpp.trace``'s.
Each rank records its step as Chrome trace events (through :class:`~torchpp.trace.chrome.TraceWriter`):
``F<mb>``/``B<mb>``/``optimizer`` on the compute row, ``send_act``/``send_grad`` and
``recv_act``/``recv_grad`` (with bytes) on the send and recv rows, ``allreduce`` on the
collective row, per-block slices (``embed``, ``layer<i>``, ``tail``; forward and backward)
on the blocks row when asked, and flow arrows from each send to its receive.

A p2p slice runs from when the message became this row's next outstanding one (not before
it was posted, not before the previous message on the row finished) to when it completed,
as stamped by its waiter thread; ``blocked_s`` says how long compute waited for it.

Clocks: each rank's times are relative to its own base; the offset to rank 0's base is
measured by ping-pong (the sample with the smallest round trip wins, its uncertainty is half
that round trip) and recorded, and the merged ``timeline_step<N>_all.json`` applies it.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..schedules import Action, Kind
from ..formats import write_json
from ..trace import cpu_steal
from ..trace.cpu_steal import CpuClock
from ..trace.chrome import TraceWriter, merge
from ..trace.timeline import P2P_NAMES, p2p_event
from .exchange import gather_json

if TYPE_CHECKING:
    import torch

_CLOCK_TAG = 1 << 30
_COMPUTE_NAMES = {Kind.FORWARD: "F", Kind.BACKWARD: "B", Kind.BACKWARD_INPUT: "I", Kind.BACKWARD_WEIGHT: "W"}


@dataclass
class ClockSync:
    base_s: float
    """This rank's perf_counter at its time zero."""
    offset_s: float
    """Add to this rank's relative times to get rank 0's relative times."""
    rtt_s: float
    """Round trip of the kept sample (the offset is exact to within half of it)."""
    wall_ns: int | None = None
    """This host's wall clock (ns since the epoch) at ``base_s``: Kineto's ``baseTimeNanoseconds``."""


def _base_now() -> tuple[float, int]:
    """(perf_counter, wall-clock ns) of one instant: the wall clock read between two perf_counter
    reads, paired with their midpoint."""
    a = time.perf_counter()
    wall = time.time_ns()
    b = time.perf_counter()
    return (a + b) / 2, wall


def sync_clocks(rank: int, world_size: int, rounds: int = 16) -> ClockSync:
    """Ping-pong with rank 0; every rank calls this together."""
    base, wall = _base_now()
    if world_size == 1:
        return ClockSync(base, 0.0, 0.0, wall)
    import torch
    import torch.distributed as dist

    buf = torch.zeros(1, dtype=torch.float64)
    if rank == 0:
        for r in range(1, world_size):
            for _ in range(rounds):
                dist.recv(buf, src=r, tag=_CLOCK_TAG)
                buf[0] = time.perf_counter() - base
                dist.send(buf, dst=r, tag=_CLOCK_TAG)
        return ClockSync(base, 0.0, 0.0, wall)
    best = (float("inf"), 0.0)
    for _ in range(rounds):
        t1 = time.perf_counter()
        dist.send(buf, dst=0, tag=_CLOCK_TAG)
        dist.recv(buf, src=0, tag=_CLOCK_TAG)
        t2 = time.perf_counter()
        rtt = t2 - t1
        if rtt < best[0]:
            best = (rtt, float(buf[0]) - ((t1 + t2) / 2 - base))
    return ClockSync(base, best[1], best[0], wall)


@dataclass
class _P2P:
    action: Action
    posted_s: float
    done_s: float
    nbytes: int
    blocked_s: float
    codec_s: float = 0.0


@dataclass
class StepRecorder:
    """Observer of one step on one rank (executor and block events); :meth:`finish` writes it."""

    rank: int
    world_size: int
    stage: int
    host: str
    step: int
    clock: ClockSync
    layers: tuple[int, int] = (0, 0)
    chunks: dict[int, tuple[int, int]] = field(default_factory=dict)
    """Every chunk the rank holds -> its layer range (several under interleaved and V placements)."""
    writer: TraceWriter = field(init=False)
    _p2p: list[_P2P] = field(default_factory=list)
    _mb: int | None = None
    _open: dict[str, float] = field(default_factory=dict)
    _bwd: dict[int, dict[str, list[float | None]]] = field(default_factory=dict)
    _bwd_begin: float = 0.0
    _log: list[tuple] = field(default_factory=list)
    """The step's compute, collective and block slices as recorded, formatted into events by :meth:`finish`."""
    _begin: float = field(default_factory=time.perf_counter)
    _cpu: CpuClock | None = field(default_factory=cpu_steal.read)

    def __post_init__(self) -> None:
        self.writer = TraceWriter(world_size=self.world_size, rank=self.rank, metadata={
            "step": self.step, "rank": self.rank, "stage": self.stage, "stages": sorted(self.chunks or [self.stage]),
            "host": self.host, "clock_offset_s": self.clock.offset_s, "clock_rtt_s": self.clock.rtt_s,
            "clock": "perf_counter"})
        self.writer.base_time_ns = self.clock.wall_ns
        held = sorted(self.chunks or [self.stage])  # named as the simulator's predicted traces name it
        where = f"stage {held[0]}" if len(held) == 1 else "stages " + ",".join(map(str, held))
        self.writer.name_process(self.rank, f"rank {self.rank} · {where} · host {self.host}")

    def _t(self, t: float) -> float:
        return t - self.clock.base_s

    # -- executor (called in the loop: each records a tuple; the events are formatted by :meth:`finish`)
    def compute(self, action: Action, start_s: float, end_s: float, args: dict) -> None:
        if action.kind == Kind.FORWARD:
            self._mb = action.microbatch
        self._log.append((self._compute_event, action, start_s, end_s, args))

    def _compute_event(self, action: Action, start_s: float, end_s: float, args: dict) -> None:
        name = _COMPUTE_NAMES.get(action.kind)
        name = f"{name}{action.microbatch}" if name else "optimizer"
        self.writer.complete(self.rank, "compute", name, self._t(start_s), end_s - start_s,
                             {"stage": action.stage, "microbatch": action.microbatch,
                              "layers": list(self.chunks.get(action.stage, self.layers)), **args})

    def p2p(self, pending, waited_from_s: float | None) -> None:
        blocked = 0.0 if waited_from_s is None else max(0.0, pending.done_s - waited_from_s)
        self._p2p.append(_P2P(pending.action, pending.posted_s, pending.done_s, pending.nbytes, blocked,
                              getattr(pending, "codec_s", 0.0)))

    def collective(self, action: Action, start_s: float, end_s: float, nbytes: int) -> None:
        self._log.append((self._collective_event, action, start_s, end_s, nbytes))

    def _collective_event(self, action: Action, start_s: float, end_s: float, nbytes: int) -> None:
        self.writer.complete(self.rank, "collective", "allreduce", self._t(start_s), end_s - start_s,
                             {"stage": action.stage, "group": list(action.group or ()), "tied": action.tied,
                              "bytes": nbytes})

    def backward_begin(self, microbatch: int, t: float) -> None:
        self._bwd.setdefault(microbatch, {})
        self._bwd_begin = t

    def backward_end(self, microbatch: int, t: float) -> None:
        """Record the backward block slices of ``microbatch`` (written by :meth:`_backward_blocks`)."""
        spans = self._bwd.pop(microbatch, None)
        if spans:
            # the hook stamps as they are now (a later pass's hooks write into the same slots)
            self._log.append((self._backward_blocks, microbatch, t, self._bwd_begin,
                              {name: tuple(v) for name, v in spans.items()}))

    def _backward_blocks(self, microbatch: int, t: float, begin: float,
                         blocks: dict[str, tuple[float | None, float | None]]) -> None:
        """The backward block slices of ``microbatch``, laid out so they nest: a block's end (its
        input's gradient hook) and the previous block's start (the hook on the same tensor,
        registered earlier, so called first) are one instant seen twice, a few microseconds
        apart; the end is cut at the next start."""
        spans = sorted((begin if b is None else b, t if e is None else e, name) for name, (b, e) in blocks.items())
        for i, (b, end, name) in enumerate(spans):
            end = min(end, t, spans[i + 1][0] if i + 1 < len(spans) else end)
            self.writer.complete(self.rank, "blocks", name, self._t(b), max(0.0, end - b),
                                 {"stage": self.stage, "microbatch": microbatch, "pass": "backward"}, cat="block")

    # -- blocks (Stage.profiler)
    def begin(self, name: str) -> None:
        self._open[name] = time.perf_counter()

    def end(self, name: str, inp: torch.Tensor | None, out: torch.Tensor) -> None:
        t1 = time.perf_counter()
        import torch

        t0 = self._open.pop(name, t1)
        mb = self._mb
        self._log.append((self._forward_block, name, t0, t1, mb))
        if mb is None or not torch.is_grad_enabled():
            return
        slot = self._bwd.setdefault(mb, {}).setdefault(name, [None, None])
        if out.requires_grad:
            out.register_hook(lambda g, s=slot: s.__setitem__(0, time.perf_counter()))
        if inp is not None and inp.requires_grad:
            inp.register_hook(lambda g, s=slot: s.__setitem__(1, time.perf_counter()))

    def _forward_block(self, name: str, t0: float, t1: float, mb: int | None) -> None:
        self.writer.complete(self.rank, "blocks", name, self._t(t0), t1 - t0,
                             {"stage": self.stage, "microbatch": mb, "pass": "forward"}, cat="block")

    def forward_microbatch(self, microbatch: int) -> None:
        self._mb = microbatch

    # -- output
    def _step_annotation(self, end_s: float) -> None:
        """Kineto's ``ProfilerStep#N`` slice on the compute row, around everything of the step
        (tools such as HTA find steps by it)."""
        xs = [e for e in self.writer.events if e.get("ph") == "X"]
        t0 = min([self._t(self._begin) * 1e6, *(e["ts"] for e in xs)]) - 0.001  # 1 ns: rounding cannot
        t1 = max([self._t(end_s) * 1e6, *(e["ts"] + e["dur"] for e in xs)]) + 0.001  # uncover a child
        ev = self.writer.complete(self.rank, "compute", f"ProfilerStep#{self.step}", t0 * 1e-6, (t1 - t0) * 1e-6,
                                  {"step": self.step}, cat="user_annotation")
        self.writer.events.remove(ev)
        self.writer.events.insert(0, ev)

    def finish(self) -> dict[str, Any]:
        """Lay out the p2p rows without overlap, add flow halves, return the trace JSON."""
        w = self.writer
        end = time.perf_counter()
        for write, *args in self._log:  # in the order they were recorded
            write(*args)
        self._log.clear()
        self._step_annotation(end)
        w.metadata["peak_rss_bytes"] = peak_rss_bytes()
        if _BASE_RSS is not None:
            w.metadata["base_rss_bytes"] = _BASE_RSS
        stolen = cpu_steal.stolen_cores(self._cpu)
        if stolen is not None:  # another guest's time on this machine's CPUs during the step
            w.metadata["cpu_steal_cores"], w.metadata["cpus"] = round(stolen, 4), cpu_steal.cpus()
        for row in ("send", "recv"):
            recs = sorted((p for p in self._p2p if P2P_NAMES[p.action.kind][0] == row), key=lambda p: p.done_s)
            prev_end = float("-inf")
            for p in recs:
                start = max(p.posted_s, prev_end)
                prev_end = p.done_s
                a = p.action
                p2p_event(w, self.rank, self.step, row, a, self._t(start), p.done_s - start, p.nbytes, p.blocked_s,
                          {"codec_s": p.codec_s} if p.codec_s else None)
        return w.to_json()


_BASE_RSS: int | None = None


def mark_base_rss() -> None:
    """Remember this process's RSS before its stage is built (the torch runtime, data, process
    group): traces then carry it, so the stage's own peak is ``peak_rss_bytes - base_rss_bytes``.
    The kernel's high-water mark is reset here, so a transient peak of the start-up (imports,
    config loading) cannot stand in for the stage's own."""
    import psutil

    global _BASE_RSS
    reset_peak_rss()
    _BASE_RSS = int(psutil.Process().memory_info().rss)


def reset_peak_rss() -> bool:
    """Reset the kernel's RSS high-water mark to the current RSS (Linux ``clear_refs`` 5); False
    where that is not possible (then the peak counts from the process's start)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    """This process's peak resident set size since :func:`reset_peak_rss` (or its start): what
    the planner's memory model predicts."""
    import resource
    import sys

    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(kib) if sys.platform == "darwin" else int(kib) * 1024


def write_step(trace_dir: str | Path, step: int, rank: int, world_size: int, trace: dict[str, Any],
               offsets: dict[int, float] | None = None) -> list[Path]:
    """Write this rank's file; rank 0 also writes the merged timeline (all ranks call this)."""
    d = Path(trace_dir)
    out = [write_json(d / f"timeline_step{step}_rank{rank}.json", trace)]
    gathered = gather_json(trace, dst=0) if world_size > 1 else [trace]
    if rank == 0:
        offs = [float(t.get("metadata", {}).get("clock_offset_s", 0.0)) for t in gathered]
        rtts = [float(t.get("metadata", {}).get("clock_rtt_s", 0.0)) for t in gathered]
        merged = merge(gathered, offs, metadata={"step": step, "clock_rtt_s": rtts,
                                                 "clock_reference": "rank 0"})
        out.append(write_json(d / f"timeline_step{step}_all.json", merged))
    return out
