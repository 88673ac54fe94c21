"""`analyze` and `replan` read a timeline in time linear in its events (890 events took
3 s, 8,900 took 23 s and 26,700 took 261 s, the critical-path walk rebuilding a rank's list of
end times at every step).

CPU time of N and 8N events is compared in one process, best of three each: linear work grows
about 8× (the sort adds a little), quadratic work 64×; the bound sits far from both."""
from __future__ import annotations

import time

from test_analyze import events

from torchpp.trace.analyze import analyze, critical_path


def _cpu(fn, *args) -> float:
    best = float("inf")
    for _ in range(3):
        t0 = time.process_time()
        fn(*args)
        best = min(best, time.process_time() - t0)
    return best


def test_analysis_time_grows_linearly_with_events():
    small, large = events([1.0, 1.5], [2.0, 3.0], 256, comm=0.1), events([1.0, 1.5], [2.0, 3.0], 2048, comm=0.1)
    assert 7.5 < len(large) / len(small) < 8.5
    for fn in (critical_path, analyze):
        sorted_large = sorted(large, key=lambda e: (e.start, e.end))
        sorted_small = sorted(small, key=lambda e: (e.start, e.end))
        ratio = _cpu(fn, sorted_large) / max(_cpu(fn, sorted_small), 1e-6)
        assert ratio < 24, f"{fn.__name__}: {len(large)} events took {ratio:.1f}x the CPU of {len(small)} (8x the events)"
