"""Steal (CPU other guests of a virtual machine took): read from /proc/stat, recorded per traced
step, summed up by `analyze`, named by the demo and bench_fidelity."""
import importlib.util
import json
import sys
import time
from pathlib import Path

import pytest

from torchpp.formats import FormatError
from torchpp.formats.trace import check_trace
from torchpp.trace import cpu_steal
from torchpp.trace.report import cpu_steal as report_steal, steal_line

ROOT = Path(__file__).resolve().parents[1]


def _stat(tmp_path, steal_ticks):
    p = tmp_path / "stat"
    p.write_text(f"cpu  2095832 109 153689 2704221 3686 0 15591 {steal_ticks} 0 0\ncpu0 1 2 3 4 5 6 7 8 9 10\n")
    return str(p)


def test_read_takes_the_eighth_column_in_seconds(tmp_path):
    hz = __import__("os").sysconf("SC_CLK_TCK")
    c = cpu_steal.read(_stat(tmp_path, 3 * hz))
    assert c.steal_s == pytest.approx(3.0)
    assert cpu_steal.read(str(tmp_path / "missing")) is None
    (tmp_path / "short").write_text("cpu 1 2 3 4\n")
    assert cpu_steal.read(str(tmp_path / "short")) is None


def test_stolen_cores_is_steal_over_wall_time():
    a, b = cpu_steal.CpuClock(10.0, 100.0), cpu_steal.CpuClock(10.6, 102.0)
    assert cpu_steal.stolen_cores(a, b) == pytest.approx(0.3)
    assert cpu_steal.stolen_cores(b, b) is None and cpu_steal.stolen_cores(None, b) is None
    assert cpu_steal.slowed(0.1, 2) and not cpu_steal.slowed(0.09, 2) and not cpu_steal.slowed(None, 2)
    assert cpu_steal.describe(0.24, 2) == "0.24 of 2 cores (12%)"
    now = cpu_steal.read()  # this machine: a reading, and a rate that cannot be negative
    if now is not None:
        time.sleep(0.01)
        assert cpu_steal.stolen_cores(now) >= 0.0


def test_the_step_recorder_writes_it_and_traces_check_it():
    from torchpp.runtime.tracing import ClockSync, StepRecorder

    rec = StepRecorder(rank=0, world_size=1, stage=0, host="h", step=1, clock=ClockSync(time.perf_counter(), 0.0, 0.0))
    rec._cpu = cpu_steal.CpuClock(rec._cpu.steal_s - 0.5, rec._cpu.monotonic_s - 1.0) if rec._cpu else None
    meta = rec.finish()["metadata"]
    if rec._cpu is None:
        pytest.skip("no /proc/stat steal column here")
    assert meta["cpu_steal_cores"] >= 0.25 and meta["cpus"] >= 1  # 0.5 s stolen over just over 1 s
    trace = {"traceEvents": [], "metadata": {"world_size": 1, "ranks": {"0": {"cpu_steal_cores": 0.2, "cpus": 2}}}}
    check_trace(trace, "t.json")
    trace["metadata"]["ranks"]["0"]["cpu_steal_cores"] = -1
    with pytest.raises(FormatError, match="cpu_steal_cores"):
        check_trace(trace, "t.json")


def _traces(*steals):
    return [{"metadata": {"ranks": {str(r): {"host": h, "cpu_steal_cores": c, "cpus": 2}
                                    for r, (h, c) in enumerate(step)}}} for step in steals]


def test_the_report_averages_per_host_and_names_a_slowed_run():
    rep = report_steal(_traces([("a", 0.3), ("b", 0.3)], [("a", 0.1), ("b", 0.1)]))
    assert rep["hosts"]["a"] == {"cores": pytest.approx(0.2), "worst_step_cores": 0.3, "cpus": 2}
    assert rep["slowed"] == ["a", "b"]
    line = steal_line(rep)
    assert "a, b 0.20 of 2 cores (10%)" in line and "include it" in line  # one machine: said once
    quiet = report_steal(_traces([("a", 0.0), ("b", 0.01)]))
    assert quiet["slowed"] == [] and "include" not in steal_line(quiet)
    assert report_steal([{"metadata": {"ranks": {"0": {"host": "a"}}}}]) is None and steal_line(None) is None


def test_the_demo_and_the_fidelity_bench_say_it(tmp_path):
    from torchpp.demo import RunResult, steal_line as demo_line

    runs = [RunResult(name=n, plan="p", measured_step_s=1.0, predicted_step_s=1.0, steps_s=[1.0], report="r",
                      trace_dir="t", cpu_steal=report_steal(_traces([("a", c)])))
            for n, c in (("plan", 0.24), ("replan", 0.0))]
    assert runs[0].stolen_cores == pytest.approx(0.24)
    assert demo_line(runs) == ("steal (CPU other guests of a virtual machine took during the traced steps, worst "
                               "host): plan 0.24 of 2 cores (12%) (slower for it); replan 0.00 of 2 cores (0%)")
    assert demo_line([RunResult("even", "p", 1.0, 1.0, [1.0], "r", "t")]) is None

    spec = importlib.util.spec_from_file_location("bench_fidelity", ROOT / "benchmarks" / "bench_fidelity.py")
    bf = sys.modules["bench_fidelity"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bf)
    out = tmp_path / "run"
    out.mkdir()
    (out / "summary.json").write_text(json.dumps({"runs": [
        {"name": "plan", "error": -0.15, "memory_error": 0.01, "stolen_cores": 0.24, "measured_step_s": 1.0},
        {"name": "replan", "error": 0.02, "memory_error": 0.01, "stolen_cores": 0.0, "measured_step_s": 1.0}]}))
    slowed = bf.figures(out, "", load=0, run=1, seconds=1.0, ok=True)
    slowed.cpus, slowed.steal_whole = 2, 0.05
    assert slowed.steal == {"plan": 0.24, "replan": 0.0} and slowed.stolen
    assert "| plan 0.24; 0.05 (slowed) |" in bf.table([slowed], cluster=False)[2]
    clean = bf.RunFigures(load=0, run=2, ok=True, seconds=1.0, errors={"plan": 0.03}, mape=0.03, cpus=2,
                          steal={"plan": 0.01})
    line = bf.verdict([slowed, clean], cluster=False)[0]
    assert "1 run(s) lost CPU to steal" in line and "the others' MAPE 3.0%" in line


def test_a_profile_keeps_its_steal_and_an_outlier_round_names_it(tmp_path):
    from torchpp.formats import Capacities, LayersFile
    from torchpp.planner.capacities import compute_capacities
    from torchpp.planner.synthetic import layers_file
    from torchpp.profiling.measure import format_summary

    lf = layers_file("pi", num_layers=2)
    assert "cpu_steal_cores" not in lf.to_json()["run"]  # not recorded: absent, as in older files
    lf.run.cpu_steal_cores = 0.3
    again = LayersFile.load(lf.save(tmp_path / "layers_pi.json"))
    assert again.run.cpu_steal_cores == 0.3 and "steal (CPU other guests" in format_summary(again)
    bad = again.to_json()
    bad["run"]["cpu_steal_cores"] = -0.1
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    with pytest.raises(FormatError, match=r"run\.cpu_steal_cores"):
        LayersFile.load(tmp_path / "bad.json")

    def scaled(host, k, steal=None):
        f = layers_file(host, num_layers=2, speed=1 / k)
        f.run.cpu_steal_cores = steal
        return f

    rounds = [[scaled("ref", 1.0), scaled("pi", 2.0)], [scaled("ref", 1.0), scaled("pi", 3.0, steal=0.4)],
              [scaled("ref", 1.0), scaled("pi", 2.04)]]
    cap = compute_capacities(rounds[0], "ref", again=[(fs, [f"r{i}_{f.host}" for f in fs])
                                                      for i, fs in enumerate(rounds[1:], 1)])
    assert [(o.host, o.round, o.cpu_steal_cores) for o in cap.outliers] == [("pi", 1, 0.4)]
    assert cap.outliers[0].line().endswith("; 0.40 core(s) of the machine went to other guests (steal) while it "
                                           "was profiled")
    assert Capacities.load(cap.save(tmp_path / "cap.json")) == cap
