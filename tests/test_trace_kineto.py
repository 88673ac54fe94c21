"""Traces that Kineto-reading tools accept: process/thread metadata, ``ProfilerStep#N``,
categories, ``baseTimeNanoseconds`` from the wall clock, block slices that nest, sends that
start before their receives end, and a torch.profiler trace of the same step merged onto
the same clock with its operators inside torchpp's slices. (HTA itself is not installed here.)
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from dist_harness import traced_tiny_run
from torchpp.trace.analyze import analyze, events_from_trace
from torchpp.trace.kineto import merge_kineto


@pytest.fixture(scope="module")
def traces(tmp_path_factory) -> Path:
    return traced_tiny_run(tmp_path_factory.mktemp("kineto"), profile_blocks=True)


def _load(p: Path) -> dict:
    return json.loads(p.read_text())


def test_kineto_fields(traces):
    now = time.time_ns()
    for r in range(2):
        t = _load(traces / f"timeline_step2_rank{r}.json")
        assert t["schemaVersion"] == 1 and t["distributedInfo"] == {"rank": r, "world_size": 2}
        assert abs(t["baseTimeNanoseconds"] - now) < 600e9  # the wall clock, not perf_counter's
        meta = {(e["name"], e["tid"]) for e in t["traceEvents"] if e["ph"] == "M"}
        assert {("process_name", 0), ("process_labels", 0), ("thread_name", 0)} <= meta
        xs = [e for e in t["traceEvents"] if e["ph"] == "X"]
        assert all(e.get("cat") for e in xs)
        step = [e for e in xs if e["name"] == "ProfilerStep#2"]
        assert len(step) == 1 and step[0]["cat"] == "user_annotation"
        lo, hi = step[0]["ts"], step[0]["ts"] + step[0]["dur"]
        assert all(lo <= e["ts"] and e["ts"] + e["dur"] <= hi for e in xs)
        blocks = sorted((e for e in xs if e.get("cat") == "block"), key=lambda e: e["ts"])
        assert blocks
        for a, b in zip(blocks, blocks[1:]):  # one row: slices must not overlap (ts and dur are each
            assert a["ts"] + a["dur"] <= b["ts"] + 0.002, (a, b)  # rounded to the ns: 2 ns of slack)
    merged = _load(traces / "timeline_step2_all.json")
    assert merged["baseTimeNanoseconds"] == _load(traces / "timeline_step2_rank0.json")["baseTimeNanoseconds"]
    a = analyze(events_from_trace(merged))  # the step annotation is no pipeline event
    assert a.step_time_s > 0


def test_torch_profiler_trace_merges_in_order(traces):
    ours = _load(traces / "timeline_step2_rank0.json")
    kin = _load(traces / "torch_step2_rank0.json")
    both = merge_kineto(ours, kin)
    fwd = [e for e in both["traceEvents"] if e.get("ph") == "X" and e.get("pid") == 0 and e["name"] in ("F0", "F1")]
    embeds = [e for e in both["traceEvents"] if e.get("name") == "aten::embedding" and e.get("ph") == "X"]
    assert len(fwd) == 2 and len(embeds) >= 2
    tol = 200.0  # µs: pairing perf_counter with the wall clock, and Kineto's own clock
    for e in embeds:
        assert any(f["ts"] - tol <= e["ts"] and e["ts"] + e["dur"] <= f["ts"] + f["dur"] + tol for f in fwd), e
    opt = next(e for e in both["traceEvents"] if e.get("name") == "optimizer" and e.get("pid") == 0)
    steps = [e for e in both["traceEvents"] if str(e.get("name", "")).startswith("Optimizer.step#")]
    assert steps and all(opt["ts"] - tol <= e["ts"] <= opt["ts"] + opt["dur"] + tol for e in steps)
