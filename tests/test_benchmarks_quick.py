"""Every benchmark behind a README claim keeps running: each one's quick mode (seconds, not a
measurement) runs here, so a refactor that breaks one fails the suite."""
from __future__ import annotations

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
