"""The peer-comparison benchmarks run: each one's ``--quick`` mode (no measurement, every code
path of a real run but the long ones), so a change to the runtime or the trainer that breaks a
benchmark fails here instead of in the next measurement."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(script: str, out: Path, *args: str, timeout_s: float = 900) -> str:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--quick", "--out", str(out), *args],
                          capture_output=True, text=True, timeout=timeout_s, env=env, cwd=ROOT)
    assert proc.returncode == 0, f"{script} --quick failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc.stdout


@pytest.mark.slow
def test_bench_chunked_quick(tmp_path):
    text = _run("bench_chunked.py", tmp_path)
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert [r["schedule"] for r in rows] == ["interleaved", "interleaved-zb", "zbv"]
    for r in rows:
        assert r["step_ratio"] > 0 and r["max_loss_diff"] < 1e-4, r  # same weights, same data: same losses
    assert "ScheduleZBVZeroBubble" in text


@pytest.mark.slow
def test_bench_pipelining_quick(tmp_path):
    text = _run("bench_pipelining.py", tmp_path)
    got = json.loads((tmp_path / "results.json").read_text())
    systems = [(r["system"], r["ranks"]) for r in got["rows"]]
    assert systems == [("single", 1), ("torchpp", 2), ("peer", 2)]
    assert all(r["max_loss_diff_vs_single"] < 1e-4 for r in got["rows"])
    assert "torchpp" in text


@pytest.mark.slow
def test_bench_call_cost_quick(tmp_path):
    text = _run("bench_call_cost.py", tmp_path)
    assert "runtime CPU per call" in text
