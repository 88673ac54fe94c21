"""torch.profiler (Kineto) traces next to torchpp's: capture the same steps, merge the two.

Both kinds of trace give ``ts`` in microseconds after ``baseTimeNanoseconds`` (the wall clock,
ns since the epoch), so shifting one by the difference of the bases puts both on one clock:
the aten operators torch.profiler records land inside torchpp's ``F<mb>``/``B<mb>`` slices.
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Iterator


@contextlib.contextmanager
def capture(path: str | Path) -> Iterator[None]:
    """Record CPU operators with torch.profiler around the block; write its Chrome trace to ``path``."""
    from torch.profiler import ProfilerActivity, profile

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        yield
    prof.export_chrome_trace(str(path))


def merge_kineto(ours: dict[str, Any], kineto: dict[str, Any]) -> dict[str, Any]:
    """``ours`` with ``kineto``'s events added on ``ours``' clock (both need ``baseTimeNanoseconds``)."""
    for name, t in (("torchpp", ours), ("torch.profiler", kineto)):
        if "baseTimeNanoseconds" not in t:
            raise ValueError(f"the {name} trace has no baseTimeNanoseconds: its clock cannot be aligned")
    shift_us = (int(kineto["baseTimeNanoseconds"]) - int(ours["baseTimeNanoseconds"])) / 1e3
    events = list(ours["traceEvents"])
    for ev in kineto["traceEvents"]:
        ev = dict(ev)
        if "ts" in ev:
            ev["ts"] = round(float(ev["ts"]) + shift_us, 3)
        events.append(ev)
    return {**ours, "traceEvents": events}
