"""Chrome traces: the checks every analysed trace passes."""
from __future__ import annotations

from typing import Any, Mapping

from .. import validate as V
from .base import FormatError, Reader, check_format


TRACE_KIND, TRACE_VERSION = "trace", 1


def check_trace(data: Any, source: str) -> dict[str, Any]:
    """A Chrome trace torchpp can analyse: a known format, and ``X`` events whose times are finite
    numbers with durations >= 0 (a NaN or negative span would silently skew every bubble term)."""
    r = Reader(data, source)
    if "format" in r.data:
        check_format(data, source, TRACE_KIND, [TRACE_VERSION])
    events = r.list("traceEvents")
    meta = r.obj("metadata", {})
    world = meta.int("world_size", None, min_value=1, max_value=V.MAX_STAGES)
    for i, ev in enumerate(events):
        if not isinstance(ev, Mapping):
            raise FormatError(source, f"traceEvents[{i}]", "an event object", ev)
        if ev.get("ph") != "X":
            continue
        e = Reader(ev, source, f"traceEvents[{i}]")
        e.float("ts", min_value=-V.MAX_SECONDS * 1e6, max_value=V.MAX_SECONDS * 1e6)
        e.float("dur", 0.0, min_value=0.0, max_value=V.MAX_SECONDS * 1e6)
        pid = e.int("pid", min_value=0, max_value=V.MAX_STAGES)
        if world is not None and pid >= world:
            raise e.fail("pid", f"a rank of the trace (0..{world - 1}, metadata.world_size)", pid)
        _check_args(e.obj("args", {}), world)
    ranks = meta.obj("ranks", {})
    for rank in ranks.data:
        mr = ranks.obj(rank)
        if not str(rank).isdigit():
            raise mr.fail("", "ranks keyed by rank number", rank)
        if world is not None and int(rank) >= world:
            raise ranks.fail(rank, f"a rank of the trace (0..{world - 1}, metadata.world_size)")
        for key in ("peak_rss_bytes", "base_rss_bytes"):
            if mr.has(key):
                mr.int(key, min_value=0, max_value=V.MAX_BYTES)
        if mr.has("cpu_steal_cores"):
            mr.float("cpu_steal_cores", min_value=0.0, max_value=V.MAX_CPUS)
        if mr.has("cpus"):
            mr.int("cpus", min_value=1, max_value=V.MAX_CPUS)
        if mr.has("stage"):
            mr.int("stage", min_value=0, max_value=V.MAX_STAGES)
        if mr.has("stages"):
            _ints(mr, "stages", V.MAX_STAGES)
        for key in ("clock_offset_s", "clock_rtt_s"):
            if mr.has(key):
                mr.float(key, min_value=-V.MAX_SECONDS if key == "clock_offset_s" else 0.0, max_value=V.MAX_SECONDS)
    return data


def _check_args(a: Reader, world: int | None) -> None:
    """An ``X`` event's ``args``: the fields the analysis reads, typed and bounded."""
    for key in ("stage", "microbatch"):
        if a.has(key):
            a.int(key, min_value=0, max_value=V.MAX_STAGES if key == "stage" else V.MAX_MICROBATCHES)
    if a.has("peer"):
        a.int("peer", min_value=0, max_value=(world - 1) if world else V.MAX_STAGES)
    if a.has("layers"):
        lr = _ints(a, "layers", V.MAX_LAYERS + 2)
        if len(lr) != 2 or lr[0] > lr[1]:
            raise a.fail("layers", "a layer range [start, end]", lr)
    if a.has("bytes"):
        a.int("bytes", min_value=0, max_value=V.MAX_BYTES)
    for key in ("recompute_s", "blocked_s"):
        if a.has(key):
            a.float(key, min_value=0.0)


def _ints(r: Reader, key: str, most: int) -> list[int]:
    """A list of integers in ``0..most``."""
    out = r.ints(key)
    for i, v in enumerate(out):
        if not 0 <= v <= most:
            raise r.fail(f"{key}[{i}]", f"an integer in 0..{most}", v)
    return out


def trace_plan_hashes(data: Mapping[str, Any]) -> set[str]:
    """The ``plan_hash`` values a trace names (merged timelines carry each rank's metadata)."""
    meta = data.get("metadata") or {}
    found = {meta.get("plan_hash")}
    ranks = meta.get("ranks") if isinstance(meta.get("ranks"), Mapping) else {}
    found |= {m.get("plan_hash") for m in ranks.values() if isinstance(m, Mapping)}
    return {h for h in found if isinstance(h, str)}
