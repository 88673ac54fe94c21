"""benchmarks/bench_wire.py --quick: every run trains, its bytes on the wire are what the formats promise,
and the table and plots are written next to the numbers."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_bench_wire_quick(tmp_path):
    out = tmp_path / "bw"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_wire.py"), "--quick", "--steps", "3",
                    "--out", str(out)], check=True, cwd=ROOT, timeout=540)
    got = json.loads((out / "results.json").read_text())
    runs, summary = got["runs"], got["summary"]
    assert set(runs) == {"pp_fp32", "pp_bf16", "pp_int8", "dp_fp32", "dp_diloco2"}
    assert all(len(r["losses"]) == 3 and all(x == x for x in r["losses"]) for r in runs.values())
    fp32 = runs["pp_fp32"]["bytes_per_step"]
    assert runs["pp_bf16"]["bytes_per_step"] * 2 == fp32
    assert 3.5 < fp32 / runs["pp_int8"]["bytes_per_step"] < 4
    assert summary["dp_diloco2"]["bytes_reduction"] > 7
    for f in ("summary.md", "loss_vs_time_10mbit.png", "loss_vs_time_100mbit.png", "loss_vs_tokens.png",
              "bytes_per_step.png"):
        assert (out / f).stat().st_size > 0
