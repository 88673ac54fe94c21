"""Sweeps (parallel = serial, resumable), heatmaps, the CLI, predicted traces and plan mode."""
import csv
import json
from pathlib import Path

import pytest

from torchpp.cli import main
from torchpp.formats import ExperimentConfig, FormatError, SimSettings
from torchpp.cost import Profiles
from torchpp.sim.measured import price
from torchpp.planner.simple import make_plan
from torchpp.planner.synthetic import layers_file, uniform_links
from torchpp.sim.sweep import COLUMNS, run_sweep, scenarios

ROOT = Path(__file__).resolve().parents[1]
SMALL = {"n": [4], "stages": [3], "sync_freq": [1, 2], "fwd_len": [1.0],
         "bwd_len": {"start": 1.5, "stop": 2.0, "step": 0.5}, "prop_len": [0.5], "sync_base_len": [1.0],
         "fwd_impact": [0.2], "bwd_impact": [0.2], "priority_step": 0.5}


def rows(path):
    with open(path, newline="") as f:
        return list(csv.reader(f))


def test_scenarios_match_the_seed():
    sc = scenarios(0.1)
    assert len(sc) == 88
    assert sum(s.exclusive is None for s in sc) == 66
    assert all(abs(sum(s.shared) - 1) < 1e-9 for s in sc)
    with pytest.raises(ValueError, match="priority-step"):
        scenarios(0.3)


def test_experiment_config_expands_ranges_and_checks_fields(tmp_path):
    cfg = ExperimentConfig.parse({"n": [8, 16], "sync_freq": [1, 2, 12], "bwd_len": {"start": 2.0, "stop": 3.0,
                                                                                   "step": 0.5}}, "exp.json")
    assert cfg.grid["bwd_len"] == [2.0, 2.5, 3.0]
    pts = cfg.points()
    assert len(pts) == 2 * 2 * 3 + 1 * 3  # sync_freq 12 > n=8 dropped
    with pytest.raises(FormatError, match=r"exp.json: field 'fwd_impact\[1\]'.*\[0, 1\)"):
        ExperimentConfig.parse({"fwd_impact": [0.1, 1.0]}, "exp.json")
    with pytest.raises(FormatError, match="'nn'"):
        ExperimentConfig.parse({"nn": [1]}, "exp.json")
    with pytest.raises(FormatError, match="settings.policy"):
        ExperimentConfig.parse({"settings": {"policy": "greedy"}}, "exp.json")
    ExperimentConfig.load(ROOT / "configs" / "sim_experiment.json").points()


@pytest.mark.timeout(120)
def test_parallel_sweep_equals_serial_and_resumes(tmp_path):
    cfg = ExperimentConfig.parse(SMALL, "small.json")
    settings = SimSettings(congestion=True)
    one, two = tmp_path / "one.csv", tmp_path / "two.csv"
    s1 = run_sweep(cfg, one, workers=1, settings=settings, progress=False, chunk_size=3)
    s2 = run_sweep(cfg, two, workers=2, settings=settings, progress=False, chunk_size=3)
    assert s1["computed"] == s2["computed"] == 2 * 2 * len(scenarios(0.5))
    assert one.read_text() == two.read_text()
    assert tuple(rows(one)[0]) == COLUMNS
    # interrupted run: keep the header and a few rows, resume, get the same file
    lines = one.read_text().splitlines(keepends=True)
    one.write_text("".join(lines[:5]))
    s3 = run_sweep(cfg, one, workers=2, settings=settings, progress=False, chunk_size=3)
    assert s3["skipped"] == 4 and s3["computed"] == s1["computed"] - 4
    assert sorted(rows(one)) == sorted(rows(two))
    assert run_sweep(cfg, one, workers=1, settings=settings, progress=False)["computed"] == 0


def test_cli_all_writes_csv_and_one_heatmap_per_environment(tmp_path):
    cfgp = tmp_path / "exp.json"
    cfgp.write_text(json.dumps(SMALL))
    assert main(["simulate", "all", "-c", str(cfgp), "--out-dir", str(tmp_path / "out"), "--workers", "1",
                 "--no-progress"]) == 0
    csvs = list((tmp_path / "out" / "data").glob("exp_*.csv"))
    assert len(csvs) == 1
    pngs = sorted((tmp_path / "out" / "heatmaps").glob("heatmap_*.png"))
    assert len(pngs) == 4  # 2 sync_freq × 2 bwd_len environments
    assert all(p.stat().st_size > 10_000 for p in pngs)
    assert main(["simulate", "heatmap", str(csvs[0]), "-o", str(tmp_path / "again")]) == 0
    assert len(list((tmp_path / "again").glob("*.png"))) == 4


def test_cli_run_reports_and_draws(tmp_path, capsys):
    g = tmp_path / "g.png"
    assert main(["simulate", "run", "-n", "4", "--stages", "3", "--congestion", "--show-throttling",
                 "--show-completion-time", "--style", "single", "--gantt", str(g), "--trace", str(tmp_path / "t.json"),
                 "--priorities", "fwd_prop=0.5,grad_prop=0.3,grad_sync=0.2", "--exclusive", "grad_prop=a"]) == 0
    out = capsys.readouterr().out
    assert "completion time:" in out and "device 2: compute" in out
    assert g.stat().st_size > 10_000
    assert main(["simulate", "run", "--policy", "seed002", "--no-gantt"]) == 0
    assert main(["simulate", "run", "--fwd-impact", "1.2", "--no-gantt"]) == 2
    assert "fwd-impact" in capsys.readouterr().err
    assert main(["simulate", "run", "--priorities", "sync=1", "--no-gantt"]) == 2


def test_check_reference_command(capsys):
    rc = main(["simulate", "check-reference", str(ROOT / "tests" / "data" / "sim002_cases.csv")])
    out = capsys.readouterr().out
    assert "21/22 cases within 1e-06" in out and rc == 1


# ------------------------------------------------------------------ predicted trace and plan mode
def _plan(tmp_path, groups=(2, 1, 1)):
    hosts = [f"h{i}" for i in range(sum(groups))]
    files = []
    for i, h in enumerate(hosts):
        lf = layers_file(h, num_layers=4, speed=1.0 + 0.25 * i)
        files.append(lf.save(tmp_path / f"layers_{h}.json"))
    bw = uniform_links(hosts, bytes_per_sec=2e3, latency_s=0.001)
    bw.save(tmp_path / "bandwidth.json")
    plan = make_plan(layers_file("x", num_layers=4).model, seq_len=16, global_batch=16, num_microbatches=4, layer_ranges=[(0, 2), (2, 3), (3, 4)],
                     group_sizes=list(groups), hosts=hosts)
    plan.save(tmp_path / "plan.json")
    return plan, files, tmp_path / "bandwidth.json"


def test_plan_mode_writes_runtime_form_trace_and_matches_planner_pricing(tmp_path, capsys):
    plan, files, bw = _plan(tmp_path)
    trace = tmp_path / "pred.json"
    args = ["simulate", "plan", str(tmp_path / "plan.json"), "--bandwidth", str(bw), "--layers", *map(str, files),
            "--trace", str(trace)]
    assert main(args + ["--comm", "links"]) == 0
    out = capsys.readouterr().out
    from torchpp.formats import Bandwidth, LayersFile

    step, _ = price(plan, Profiles.from_layers([LayersFile.load(f) for f in files]), Bandwidth.load(bw))
    assert f"predicted step time: {step:.6f}" in out
    data = json.loads(trace.read_text())
    ev = data["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in ev if e["ph"] == "M" and e["name"] == "process_name"}
    assert names[0] == "rank 0 · stage 0 · host h0" and names[3] == "rank 3 · stage 2 · host h3"
    threads = {e["args"]["name"] for e in ev if e["ph"] == "M" and e["name"] == "thread_name"}
    assert threads == {"compute", "send", "recv", "collective"}
    xs = [e for e in ev if e["ph"] == "X"]
    assert {e["name"] for e in xs} >= {"F0", "B3", "send_act", "recv_act", "send_grad", "recv_grad", "allreduce",
                                       "optimizer"}
    # the runtime recorder's args on each row (torchpp.runtime.tracing.StepRecorder)
    for e in xs:
        need = {"compute": {"stage", "microbatch", "layers"}, "send": {"stage", "microbatch", "peer", "bytes",
                "samples", "blocked_s"}, "collective": {"stage", "group", "tied", "bytes"}}
        need["recv"] = need["send"]
        tname = {0: "compute", 1: "send", 2: "recv", 3: "collective"}[e["tid"]]
        assert need[tname] <= set(e["args"]), (tname, e)
    assert all(e["args"]["bytes"] > 0 for e in xs if e["name"] in ("send_act", "recv_grad", "allreduce"))
    # rows never overlap (Perfetto drops overlapping slices on one row)
    for pid in names:
        for tid in range(4):
            row = sorted((e["ts"], e["ts"] + e["dur"]) for e in xs if e["pid"] == pid and e["tid"] == tid)
            assert all(a[1] <= b[0] + 1e-3 for a, b in zip(row, row[1:]))
    # one flow per message, ids as the runtime makes them
    starts = {e["id"] for e in ev if e["ph"] == "s"}
    ends = {e["id"] for e in ev if e["ph"] == "f"}
    assert starts == ends and len(starts) == sum(1 for e in xs if e["name"].startswith("send"))
    assert data["metadata"]["merged_ranks"] == plan.world_size and data["metadata"]["predicted"] is True
    assert max(e["ts"] + e["dur"] for e in xs) == pytest.approx(step * 1e6, rel=1e-9)
    # the shared-channel model is priced too, and reads back through the analyser's reader
    assert main(args + ["--comm", "shared", "--priorities", "fwd_prop=0.7,grad_prop=0.3,grad_sync=0"]) == 0
    from torchpp.trace.analyze import analyze, events_from_trace

    a = analyze(events_from_trace(json.loads(trace.read_text())))
    assert a.num_stages == 3 and a.num_microbatches == 4


def test_plan_mode_bad_input_names_file(tmp_path, capsys):
    plan, files, bw = _plan(tmp_path)
    bad = tmp_path / "bw_bad.json"
    bad.write_text(json.dumps({"format": "torchpp.bandwidth/1", "bytes_per_sec": {"h0|h1": -1}}))
    rc = main(["simulate", "plan", str(tmp_path / "plan.json"), "--bandwidth", str(bad), "--layers",
               *map(str, files)])
    assert rc == 2 and "bw_bad.json" in capsys.readouterr().err
