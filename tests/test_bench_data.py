"""``benchmarks/bench_data.py --quick`` runs end to end and prints its figures: the prepare
ratio against a plain ``datasets.map`` and each rank's data memory (big corpus minus 1 MB)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(1800)
def test_quick_bench_prints_the_ratio_and_the_memory_difference(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_data.py"), "--quick", "--work",
                          str(tmp_path / "w"), "--out", str(tmp_path / "r.json")], env=env, capture_output=True,
                         text=True, timeout=1500)
    assert res.returncode == 0, res.stderr[-3000:]
    assert re.search(r"torchpp / plain datasets.map tokens/s = [0-9.]+ \(wall\), [0-9.]+ \(per CPU second\)",
                     res.stdout)
    assert re.search(r"data memory: .* per rank: [-+0-9.]+, [-+0-9.]+ MiB", res.stdout), res.stdout
    r = json.loads((tmp_path / "r.json").read_text())
    plain, ours = ([x for x in r["prepare_rounds"] if x["name"] == n][0] for n in ("plain", "torchpp"))
    assert ours["tokens"] == plain["tokens"]  # the same ids (EOS counted once per document in both)
    assert max(r["rss_diff_mib"]) < 48  # a 4 MB corpus adds next to nothing to a rank
