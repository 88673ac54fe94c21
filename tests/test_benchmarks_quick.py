"""Every benchmark behind a README claim keeps running: each one's quick mode (seconds, not a
measurement) runs here, so a refactor that breaks one fails the suite."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(script: str, *args: str, timeout: float = 600) -> str:
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args], env=env, cwd=ROOT,
                       capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-3000:])
    return r.stdout


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_bench_scale_prices_8192_devices():
    out = _run("bench_scale.py", "--quick")
    assert " 8192 devices (pp 8 × dp 128 × tp 8): step " in out, out


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_bench_sim_quick():
    out = _run("bench_sim.py", "--quick", "--workers", "1")
    rows = [ln for ln in out.splitlines() if ln.startswith(("schedule ", "seed002 "))]
    assert len(rows) == 6 and all(ln.endswith("True") for ln in rows), out  # one worker and the pool agree


def _run_out(script: str, out: Path, *args: str, timeout_s: float = 900) -> str:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--quick", "--out", str(out), *args],
                          capture_output=True, text=True, timeout=timeout_s, env=env, cwd=ROOT)
    assert proc.returncode == 0, f"{script} --quick failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc.stdout


@pytest.mark.slow
def test_bench_chunked_quick(tmp_path):
    text = _run_out("bench_chunked.py", tmp_path)
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert [r["schedule"] for r in rows] == ["interleaved", "interleaved-zb", "zbv"]
    for r in rows:
        assert r["step_ratio"] > 0 and r["max_loss_diff"] < 1e-4, r  # same weights, same data: same losses
    assert "ScheduleZBVZeroBubble" in text


@pytest.mark.slow
def test_bench_pipelining_quick(tmp_path):
    text = _run_out("bench_pipelining.py", tmp_path)
    got = json.loads((tmp_path / "results.json").read_text())
    systems = [(r["system"], r["ranks"]) for r in got["rows"]]
    assert systems == [("single", 1), ("torchpp", 2), ("peer", 2)]
    assert all(r["max_loss_diff_vs_single"] < 1e-4 for r in got["rows"])
    assert "torchpp" in text


@pytest.mark.slow
def test_bench_call_cost_quick(tmp_path):
    text = _run_out("bench_call_cost.py", tmp_path)
    assert "runtime CPU per call" in text
