"""Chrome Trace Event JSON, as torch.profiler writes it (open in Perfetto or chrome://tracing).

One process per rank, one thread row per channel (compute, send, recv, collective, blocks),
``X`` events in microseconds, ``M`` metadata naming processes and threads, and ``s``/``f`` flow
events from each send to its receive. Runtime, profiler and simulator all write through
this class, so one analyser reads measured and predicted timelines alike.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..formats import TRACE_KIND, TRACE_VERSION, check_trace, read_json, write_json

THREADS = {"compute": 0, "send": 1, "recv": 2, "collective": 3, "blocks": 4}


@dataclass
class TraceWriter:
    """Collects events of one or more ranks; times are given in seconds."""

    world_size: int = 1
    rank: int | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    events: list[dict[str, Any]] = field(default_factory=list)
    precise: bool = False
    """Keep times as computed (predicted traces, so analysing them equals analysing the
    timeline); measured ones are rounded to the nanosecond."""
    base_time_ns: int | None = None
    """Wall-clock time (ns since the epoch) of ``ts`` 0, written as Kineto's ``baseTimeNanoseconds``
    so a torch.profiler trace of the same run merges onto the same clock."""
    _named: set[tuple[int, int | None]] = field(default_factory=set)

    def name_process(self, pid: int, name: str, sort_index: int | None = None) -> None:
        if (pid, None) in self._named:
            return
        self._named.add((pid, None))
        self.events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "ts": 0, "args": {"name": name}})
        self.events.append({"ph": "M", "name": "process_labels", "pid": pid, "tid": 0, "ts": 0,
                            "args": {"labels": "CPU"}})
        self.events.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "ts": 0,
                            "args": {"sort_index": pid if sort_index is None else sort_index}})

    def _thread(self, pid: int, thread: str) -> int:
        tid = THREADS.get(thread)
        if tid is None:
            tid = THREADS[thread] = len(THREADS)
        if (pid, tid) not in self._named:
            self._named.add((pid, tid))
            self.events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "ts": 0,
                                "args": {"name": thread}})
            self.events.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid, "ts": 0,
                                "args": {"sort_index": tid}})
        return tid

    def complete(self, pid: int, thread: str, name: str, start_s: float, dur_s: float,
                 args: dict[str, Any] | None = None, cat: str = "torchpp") -> dict[str, Any]:
        ts, dur = start_s * 1e6, max(dur_s, 0.0) * 1e6
        if not self.precise:
            ts, dur = round(ts, 3), round(dur, 3)
        ev = {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": self._thread(pid, thread),
              "ts": ts, "dur": dur, "args": args or {}}
        self.events.append(ev)
        return ev

    def flow(self, flow_id: int, src: dict[str, Any], dst: dict[str, Any], name: str = "p2p") -> None:
        """Arrow from the end of event ``src`` to event ``dst`` (both returned by :meth:`complete`)."""
        self.events.append({"ph": "s", "id": flow_id, "cat": "p2p", "name": name, "pid": src["pid"],
                            "tid": src["tid"], "ts": src["ts"] + src["dur"]})
        self.events.append({"ph": "f", "bp": "e", "id": flow_id, "cat": "p2p", "name": name, "pid": dst["pid"],
                            "tid": dst["tid"], "ts": dst["ts"] + dst["dur"]})

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"format": f"torchpp.{TRACE_KIND}/{TRACE_VERSION}", "schemaVersion": 1,
                               "traceEvents": self.events, "displayTimeUnit": "ms", "metadata": self.metadata}
        if self.base_time_ns is not None:
            out["baseTimeNanoseconds"] = self.base_time_ns
        if self.rank is not None:
            out["distributedInfo"] = {"rank": self.rank, "world_size": self.world_size}
        return out

    def save(self, path: str | Path) -> Path:
        return write_json(path, self.to_json())


def load_trace(path: str | Path) -> dict[str, Any]:
    return check_trace(read_json(path), str(path))


def merge(traces: list[dict[str, Any]], offsets_s: list[float] | None = None,
          metadata: dict[str, Any] | None = None) -> dict[str, Any]:
    """One timeline from per-rank traces; ``offsets_s[i]`` is added to trace i's clock."""
    events: list[dict[str, Any]] = []
    for i, t in enumerate(traces):
        off_us = (offsets_s[i] if offsets_s else 0.0) * 1e6
        for ev in t["traceEvents"]:
            ev = dict(ev)
            if "ts" in ev and off_us:
                ev["ts"] = round(ev["ts"] + off_us, 3)
            events.append(ev)
    world = max((t.get("distributedInfo", {}).get("world_size", 1) for t in traces), default=1)
    ranks = {str(t.get("distributedInfo", {}).get("rank", i)): t.get("metadata", {}) for i, t in enumerate(traces)}
    out = {"format": f"torchpp.{TRACE_KIND}/{TRACE_VERSION}", "schemaVersion": 1, "traceEvents": events,
           "displayTimeUnit": "ms",
           "metadata": {**(metadata or {}), "merged_ranks": len(traces), "world_size": world,
                        "clock_offsets_s": list(offsets_s or [0.0] * len(traces)), "ranks": ranks}}
    if traces and "baseTimeNanoseconds" in traces[0]:  # every clock is the first trace's after the offsets
        out["baseTimeNanoseconds"] = traces[0]["baseTimeNanoseconds"]
    return out
