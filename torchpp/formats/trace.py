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
    for i, ev in enumerate(events):
        if not isinstance(ev, Mapping):
            raise FormatError(source, f"traceEvents[{i}]", "an event object", ev)
        if ev.get("ph") != "X":
            continue
        e = Reader(ev, source, f"traceEvents[{i}]")
        e.float("ts", min_value=-V.MAX_SECONDS * 1e6, max_value=V.MAX_SECONDS * 1e6)
        e.float("dur", 0.0, min_value=0.0, max_value=V.MAX_SECONDS * 1e6)
        e.int("pid", min_value=0, max_value=V.MAX_STAGES)
        a = e.obj("args", {})
        for key in ("stage", "microbatch"):
            if a.has(key):
                a.int(key, min_value=0, max_value=V.MAX_STAGES if key == "stage" else V.MAX_MICROBATCHES)
        if a.has("bytes"):
            a.int("bytes", min_value=0, max_value=V.MAX_BYTES)
        for key in ("recompute_s", "blocked_s"):
            if a.has(key):
                a.float(key, min_value=0.0)
    meta = r.obj("metadata", {})
    for rank, m in (meta.obj("ranks", {}).data or {}).items():
        mr = meta.obj("ranks").obj(rank)
        if not str(rank).isdigit():
            raise mr.fail("", "ranks keyed by rank number", rank)
        for key in ("peak_rss_bytes", "base_rss_bytes"):
            if mr.has(key):
                mr.int(key, min_value=0, max_value=V.MAX_BYTES)
    return data


def trace_plan_hashes(data: Mapping[str, Any]) -> set[str]:
    """The ``plan_hash`` values a trace names (merged timelines carry each rank's metadata)."""
    meta = data.get("metadata") or {}
    found = {meta.get("plan_hash")}
    ranks = meta.get("ranks") if isinstance(meta.get("ranks"), Mapping) else {}
    found |= {m.get("plan_hash") for m in ranks.values() if isinstance(m, Mapping)}
    return {h for h in found if isinstance(h, str)}
