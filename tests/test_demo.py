"""`torchpp demo` end to end at a reduced size: every artefact exists and reads back valid."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from torchpp.demo import cluster_available
from torchpp.formats import Bandwidth, Capacities, LayersFile, Plan, read_json

ROOT = Path(__file__).resolve().parents[1]


def run_demo(out: Path, *extra: str, timeout: float = 900) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "torchpp", "demo", "--quick", "--out", str(out), *extra], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=timeout)


def check_artefacts(out: Path, hosts: list[str]) -> dict:
    for h in hosts:
        lf = LayersFile.load(out / "hosts" / f"layers_{h}.json")
        assert lf.host == h and lf.run.batches == [1, 2, 8]
    cap = Capacities.load(out / "capacities.json")
    assert set(cap.capacity) == set(hosts)
    bw = Bandwidth.load(out / "bandwidth" / "bandwidth.json")
    assert all(bw.has(a, b) for a in hosts for b in hosts if a != b)
    mm = read_json(out / "memory_model.json")
    assert mm["format"].startswith("torchpp.memory_model/")
    summary = json.loads((out / "summary.json").read_text())
    assert [r["name"] for r in summary["runs"]] == ["even", "plan", "replan"]
    for r in summary["runs"]:
        plan = Plan.load(r["plan"])
        assert {d.host for s in plan.stages for d in s.devices} <= set(hosts)
        assert r["measured_step_s"] > 0 and r["predicted_step_s"] > 0 and len(r["steps_s"]) >= 1
        traces = Path(r["trace_dir"])
        merged = sorted(traces.glob("timeline_step*_all.json"))
        assert merged, traces
        assert json.loads(merged[0].read_text())["traceEvents"]
        report = Path(r["report"]).parent
        rep = json.loads((report / "report.json").read_text())
        assert rep["step_time_error"] == pytest.approx(
            (rep["predicted_step_time_s"] - rep["step_time_s"]) / rep["step_time_s"])
        for png in ("gantt.png", "stages.png"):
            assert (report / png).read_bytes()[:4] == b"\x89PNG"
        assert (traces.parent / "predicted.json").exists()
        # every run, the even baseline too, is priced for memory and compared rank by rank
        assert sorted(x["rank"] for x in r["memory_mib"]) == list(range(plan.world_size)), r["memory_mib"]
        assert r["memory_error"] == max((x["error"] for x in r["memory_mib"]), key=abs)
    for f in ("plan.json", "summary.txt", "gantt.png", "stages.csv"):
        assert (out / "plan" / f).exists(), f
    assert (out / "replan" / "plan.json").exists() and (out / "replan" / "replan_summary.txt").exists()
    table = (out / "summary.md").read_text()
    assert "| even |" in table and "| plan |" in table and "| replan |" in table
    return summary


@pytest.mark.slow
def test_demo_on_local_processes(tmp_path):
    out = tmp_path / "demo"
    res = run_demo(out, "--local")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "not using the emulated cluster (--local was given)" in res.stdout
    assert "[16/16]" in res.stdout  # numbered progress through every step
    summary = check_artefacts(out, ["local0", "local1"])
    assert summary["mode"] == "local processes"


@pytest.mark.slow
@pytest.mark.root
@pytest.mark.skipif(cluster_available() is not None, reason=f"emulated cluster unavailable: {cluster_available()}")
def test_demo_on_the_emulated_cluster(tmp_path):
    from torchpp.cluster import cluster

    if cluster.load_state("hetero4") is not None or cluster.leftovers("hetero4")["namespaces"]:
        pytest.skip("cluster hetero4 is up on this machine; not touching it")
    out = tmp_path / "demo"
    try:
        res = run_demo(out, timeout=1500)  # noqa: the demo brings hetero4 up and down itself
    finally:
        left = cluster.leftovers("hetero4")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert not left["namespaces"], left  # the demo took its cluster down
    summary = check_artefacts(out, ["laptop", "desktop", "pi4", "pi3"])
    assert summary["mode"] == "emulated cluster hetero4"
