"""`replan` reads a run's timelines in time linear in their events (`analyze` and `replan`
grew superlinearly, 890 events 3 s, 8,900 23 s, 26,700 261 s; `test_analyze_scaling.py` covers
analyze). The runtime's time between compute calls (`call_gaps`) scanned every receive of a rank
for every gap between two of its calls: quadratic in a long timeline.

CPU time is compared in one process, best of three each: linear work grows about 8x with 8x the
events, quadratic work 64x; the bounds sit far from both."""
from __future__ import annotations

import contextlib
import io
import json
import random
import time

import pytest

from test_planner_replan import CLAIMED_RATE, TRUE_RATE, files, replan_args, write_traces

from torchpp.cli import main
from torchpp.cost import Links, MemoryEstimator, Profiles
from torchpp.formats import GB, Bandwidth, LayersFile
from torchpp.planner.replan import call_gaps
from torchpp.planner.report import predict
from torchpp.planner.simple import make_plan
from torchpp.trace.analyze import COMPUTE_KINDS, Event


def _cpu(fn, *args, reps: int = 3) -> float:
    best = float("inf")
    for _ in range(reps):
        t0 = time.process_time()
        fn(*args)
        best = min(best, time.process_time() - t0)
    return best


def _plain_call_gaps(events):
    """The definition, read literally: per rank, each gap between consecutive compute calls less
    the waits of the receives that ended inside it (every receive looked at for every gap)."""
    out = {}
    for r in sorted({e.rank for e in events}):
        evs = [e for e in events if e.rank == r]
        comp = sorted((e for e in evs if e.kind in COMPUTE_KINDS), key=lambda e: e.start)
        waits = [(e.end, e.dur if e.blocked_s is None else e.blocked_s) for e in evs if e.kind.startswith("recv")]
        out[r] = [max(0.0, (b.start - a.end) - sum(w for end, w in waits if a.end - 1e-6 <= end <= b.start + 1e-6))
                  for a, b in zip(comp, comp[1:])]
    return out


def _timeline(n: int, seed: int = 0) -> list[Event]:
    """Two ranks, ``n`` compute calls each, receives between and across them (some ending exactly
    at a call's edge, some with a blocked time), sends and an all-reduce."""
    rng = random.Random(seed)
    out = []
    for r in (0, 1):
        t = 0.0
        for i in range(n):
            d = rng.uniform(0.5, 2.0)
            out.append(Event(r, 0, rng.choice(COMPUTE_KINDS), i, t, t + d))
            end = t + d
            t = end + rng.choice([0.0, rng.uniform(0.0, 0.5)])
            for _ in range(rng.randrange(3)):
                e_end = rng.choice([end, t, rng.uniform(end - 0.3, t + 0.3)])
                out.append(Event(r, 0, rng.choice(["recv_act", "recv_grad"]), i, e_end - rng.uniform(0.0, 0.4), e_end,
                                 64, 1 - r, blocked_s=rng.choice([None, rng.uniform(0.0, 0.2)])))
            if rng.random() < 0.3:
                out.append(Event(r, 0, "send_act", i, end, end + 0.1, 64, 1 - r))
        out.append(Event(r, 0, "allreduce", None, t, t + 1.0))
    rng.shuffle(out)  # the order a merged trace lists them in is not the clock's
    return out


def test_call_gaps_equal_the_plain_definition():
    for seed in range(20):
        evs = _timeline(60, seed)
        got, want = call_gaps(evs), _plain_call_gaps(evs)
        assert set(got) == set(want)
        for r in want:
            assert got[r] == pytest.approx(want[r], rel=1e-12, abs=1e-12), (seed, r)


def test_call_gaps_time_grows_linearly_with_events():
    small, large = _timeline(500), _timeline(4000)
    ratio = _cpu(call_gaps, large) / max(_cpu(call_gaps, small), 1e-6)
    assert ratio < 24, f"call_gaps: 8x the events took {ratio:.1f}x the CPU"


def _run_dir(d, microbatches: int, steps: int):
    """A fixed plan (three hosts, a 2x slower one; the claimed profiles say equal) and its
    timelines of ``steps`` traced steps, as test_planner_replan writes them."""
    claimed = {"a": 1.0, "b": 1.0, "c": 1.0}
    paths, bw = files(d / "claimed", claimed, CLAIMED_RATE)
    files(d / "true", {"a": 1.0, "b": 0.5, "c": 1.0}, TRUE_RATE)
    (d / "devices.json").write_text(json.dumps({h: 1 for h in claimed}))
    lfs = [LayersFile.load(p) for p in paths]
    plan = make_plan(lfs[0].model, seq_len=16, global_batch=2 * microbatches, num_microbatches=microbatches,
                     layer_ranges=[(0, 2), (2, 4), (4, 6)], group_sizes=[1, 1, 1], hosts=list(claimed))
    plan.predicted, _ = predict(plan, Profiles.from_layers(lfs), Links(Bandwidth.load(bw)),
                                MemoryEstimator.analytic(), {h: GB for h in claimed})
    plan.save(d / "plan.json")
    write_traces(plan, d / "true", {"a": 1, "b": 1, "c": 1}, d / "traces", steps=range(2, 2 + steps))
    return d


def _replan(d) -> None:
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(replan_args(d)) == 0


def test_replan_time_grows_linearly_with_events(tmp_path):
    """One plan, its timelines of 2 and of 16 traced steps (776 and 6,208 events): reading and
    fitting them (what of `torchpp replan` depends on the events) grows about linearly, and so does
    the whole command (the new plan's search, which the events do not enlarge, plus that reading)."""
    from torchpp.planner.replan import fit_hosts, fit_links, read_old_costs, read_run
    from torchpp.formats import Plan

    runs = {n: _run_dir(tmp_path / f"steps{n}", 16, n) for n in (2, 16)}
    events = {n: sum(len(json.loads(p.read_text())["traceEvents"]) for p in (d / "traces").glob("*.json"))
              for n, d in runs.items()}
    assert 7.5 < events[16] / events[2] < 8.5

    def read_and_fit(d):
        plan = Plan.load(d / "plan.json")
        old = read_old_costs(plan, str(d / "plan.json"), [d / "claimed" / f"layers_{h}.json" for h in "abc"], None,
                             d / "devices.json", d / "claimed" / "bandwidth.json", None)
        meas = read_run(d / "traces", plan, old.profiles)
        fit_hosts(plan, old, meas)
        fit_links(plan, meas, old.bandwidth)

    ratio = _cpu(read_and_fit, runs[16]) / max(_cpu(read_and_fit, runs[2]), 1e-6)
    assert ratio < 24, f"replan's reading: 8x the events took {ratio:.1f}x the CPU"
    # the new plan's search, which the events do not enlarge, is now about 9x the reading of 2 steps
    # (it was most of the command): linear reading puts the whole near 1.7x, quadratic near 7x
    whole = _cpu(_replan, runs[16], reps=1) / _cpu(_replan, runs[2], reps=1)
    assert whole < 3, f"replan: 8x the events took {whole:.1f}x the CPU"
