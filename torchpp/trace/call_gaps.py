"""The runtime's own time per compute call, read off a timeline.

Block timings say what a forward or backward of a stage costs; between two such calls the
runtime also spends time of its own (dispatching actions, posting sends and receives, waiter
threads, copies). ``torchpp replan`` reads it off a run's traces and ``torchpp profile`` off a
short pipeline run on the host (its call probe); both read it here, so both mean the same thing.
"""
from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections import defaultdict
from typing import Sequence

from .analyze import COMPUTE_KINDS, Event


def call_gaps(events: Sequence[Event]) -> dict[int, list[float]]:
    """Per rank, the time between consecutive compute calls (F/B/I/W) not spent waiting for a
    receive: what the runtime itself costs per call (dispatching actions, posting messages,
    copying), which block timings do not contain. The end of the step (all-reduce, optimizer) is
    left out: waiting for a collective's peers is not always inside its event."""
    by: dict[int, list[Event]] = defaultdict(list)
    for e in events:
        by[e.rank].append(e)
    out: dict[int, list[float]] = {}
    for r, evs in by.items():
        comp = sorted((e for e in evs if e.kind in COMPUTE_KINDS), key=lambda e: e.start)
        # how long compute waited: a receive's slice may start late on a busy row, its wait did not.
        # Sorted by end, each gap's receives are one slice, found by bisection: linear in the events
        # (a scan of every receive per gap made a long timeline quadratic)
        waits = sorted(((e.end, e.dur if e.blocked_s is None else e.blocked_s) for e in evs
                        if e.kind.startswith("recv")), key=lambda x: x[0])
        ends = [end for end, _ in waits]
        gaps = []
        for a, b in zip(comp, comp[1:]):
            lo, hi = bisect_left(ends, a.end - 1e-6), bisect_right(ends, b.start + 1e-6)
            waited = sum(w for _, w in waits[lo:hi])
            gaps.append(max(0.0, (b.start - a.end) - waited))
        out[r] = gaps
    return out
