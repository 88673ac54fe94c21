"""Per-span overhead of the span timer backends (C++ extension vs pure Python).

Times N begin/end pairs (and N mark() calls) in a tight Python loop, subtracts the cost of
the empty loop, and prints nanoseconds per span; the median of several repetitions.

    python benchmarks/bench_timer.py [--spans 200000] [--reps 7]
    python benchmarks/bench_timer.py --quick      # 2,000 spans, 2 reps: checks that it runs, no measurement
"""
from __future__ import annotations

import argparse
import statistics
import time

from torchpp.profiling import timer as tm


def _loop_ns(n: int) -> int:
    t0 = time.perf_counter_ns()
    for i in range(n):
        pass
    return time.perf_counter_ns() - t0


def _spans_ns(t, n: int) -> int:
    begin, end = t.begin, t.end
    t0 = time.perf_counter_ns()
    for i in range(n):
        end(begin(i))
    return time.perf_counter_ns() - t0


def _marks_ns(t, n: int) -> int:
    mark = t.mark
    t0 = time.perf_counter_ns()
    for i in range(n):
        mark(i)
    return time.perf_counter_ns() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spans", type=int, default=200_000)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--quick", action="store_true", help="2,000 spans, 2 reps: checks that it runs, no measurement")
    a = ap.parse_args()
    if a.quick:
        a.spans, a.reps = 2_000, 2
    backends = ["cpp", "python"] if tm._ext is not None else ["python"]
    if tm._ext is None:
        print("C++ timer not built: only the Python backend is measured")
    res: dict[str, dict[str, list[float]]] = {b: {"span": [], "mark": []} for b in backends}
    for _ in range(a.reps):  # interleave backends so machine load hits both alike
        for b in backends:
            t = tm.SpanTimer(a.spans, prefer=b)
            base = _loop_ns(a.spans)
            res[b]["span"].append((_spans_ns(t, a.spans) - base) / a.spans)
            t.reset()
            res[b]["mark"].append((_marks_ns(t, a.spans) - base) / a.spans)
            assert t.dropped() == 0
    print(f"{'backend':<8} {'begin+end ns/span':>18} {'mark ns/event':>14}   (median of {a.reps}, {a.spans} spans each)")
    for b in backends:
        print(f"{b:<8} {statistics.median(res[b]['span']):>18.1f} {statistics.median(res[b]['mark']):>14.1f}")
    if len(backends) == 2:
        r = statistics.median(res["python"]["span"]) / statistics.median(res["cpp"]["span"])
        print(f"python/cpp per-span cost ratio: {r:.2f}")


if __name__ == "__main__":
    main()
