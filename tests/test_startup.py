"""Start-up: `--help` and the verbs that only read and write torchpp's files import neither
torch nor transformers (each run in a fresh interpreter, so nothing else has imported them)."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from torchpp.planner.synthetic import layers_file, uniform_links

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers")
PROBE = """
import json, sys
import torchpp.cli as c
try:
    rc = c.main(json.loads(sys.argv[1]))
except SystemExit as e:
    rc = e.code
print(json.dumps({"rc": rc, "heavy": [m for m in %r if m in sys.modules]}))
""" % (HEAVY,)


def run_fresh(argv: list[str], cwd: Path) -> dict:
    """`torchpp ARGV` in a new interpreter: its exit code and which heavy modules it imported."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", MPLBACKEND="Agg")
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-c", PROBE, json.dumps(argv)], cwd=cwd, env=env, capture_output=True,
                       text=True, timeout=120)
    wall = time.perf_counter() - t0
    assert p.returncode == 0, p.stderr
    got = json.loads(p.stdout.strip().splitlines()[-1])
    print(f"torchpp {' '.join(argv)[:60]}: rc {got['rc']}, {wall:.2f} s, heavy {got['heavy']}")
    return got


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    """Two measured hosts, a third priced by capacity, links, devices, a plan and a links CSV."""
    d = tmp_path_factory.mktemp("startup")
    for h, s in (("cpu1", 1.0), ("cpu2", 2.0)):
        layers_file(h, num_layers=4, speed=s, batch=2).save(d / f"layers_{h}.json")
    uniform_links(["cpu1", "cpu2", "cpu3"], 1e6).save(d / "bandwidth.json")
    (d / "capacities.json").write_text(json.dumps({"ref_host": "cpu1", "capacity": {"cpu1": 1, "cpu3": 0.5}}))
    (d / "devices.json").write_text(json.dumps({"cpu1": 1, "cpu2": 1, "cpu3": 1}))
    (d / "links.csv").write_text("cpu1,cpu2,8\ncpu2,cpu1,4\n")
    (d / "exp.json").write_text(json.dumps({"n": [4], "stages": [2], "sync_freq": [1], "priority_step": 0.5}))
    return d


def layers(d: Path) -> list[str]:
    return [str(d / "layers_cpu1.json"), str(d / "layers_cpu2.json")]


HELP = [["--help"], ["bandwidth", "--help"], ["simulate", "--help"]] + [
    [*verb.split(), "--help"] for verb in
    ("profile", "plan", "capacities", "bandwidth parse", "bandwidth probe", "calibrate-memory", "replan",
     "simulate", "analyze", "throttle", "cluster", "demo")]


@pytest.mark.parametrize("argv", HELP, ids=[" ".join(a) for a in HELP])
def test_help_imports_neither_torch_nor_transformers(argv, tmp_path):
    got = run_fresh(argv, tmp_path)
    assert got["rc"] == 0 and got["heavy"] == []


def test_top_level_help_is_fast(tmp_path):
    """Measured, not asserted on: the figure goes to the test's output (`pytest -s`)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "torchpp", "--help"], cwd=tmp_path, env=env, check=True,
                   capture_output=True, timeout=60)
    print(f"torchpp --help: {time.perf_counter() - t0:.3f} s wall (interpreter start included)")


def test_file_verbs_import_neither_torch_nor_transformers(files, tmp_path):
    d = files
    runs = [
        ["capacities", "--inputs", *layers(d), "--ref-host", "cpu1", "--out", str(tmp_path / "cap.json")],
        ["bandwidth", "parse", "--csv", str(d / "links.csv"), "--out", str(tmp_path / "bw.json")],
        ["plan", "--layers", *layers(d), "--capacities", str(d / "capacities.json"), "--bandwidth",
         str(d / "bandwidth.json"), "--devices", str(d / "devices.json"), "--global-batch", "8",
         "--compare", "even,dp,pp", "--out-dir", str(tmp_path / "plan")],
        ["simulate", "plan", str(tmp_path / "plan" / "plan.json"), "--bandwidth", str(d / "bandwidth.json"),
         "--layers", *layers(d), "--capacities", str(d / "capacities.json"), "--trace", str(tmp_path / "pred.json"),
         "--gantt", str(tmp_path / "pred.png")],
        ["analyze", str(tmp_path / "pred.json"), "--plan", str(tmp_path / "plan" / "plan.json"), "--predicted",
         str(tmp_path / "pred.json"), "--out", str(tmp_path / "report")],
        ["simulate", "run", "-n", "4", "--stages", "2", "--gantt", str(tmp_path / "run.png"), "--trace",
         str(tmp_path / "run.json")],
        ["simulate", "all", "-c", str(d / "exp.json"), "--out-dir", str(tmp_path / "sweep"), "--workers", "1",
         "--no-progress"],
        ["simulate", "check-reference", str(ROOT / "tests" / "data" / "sim002_cases.csv")],
        # a fixed strategy on a preset: its model fields read off the preset's table, no model built
        ["plan", "--strategy", "pp", "--stages", "2", "--model", "qwen3-tiny", "--global-batch", "8", "--microbatches",
         "2", "--seq-len", "32", "--hosts", "cpu1,cpu2", "--out", str(tmp_path / "pp_plan.json")],
    ]
    for argv in runs:
        got = run_fresh(argv, tmp_path)
        assert got["rc"] in (0, 1), argv  # check-reference exits 1 on the one known-different case
        assert got["heavy"] == [], argv
    csv = next((tmp_path / "sweep" / "data").glob("*.csv"))
    for argv in (["simulate", "sweep", "-c", str(d / "exp.json"), "--output", str(csv), "--workers", "1",
                  "--no-progress"], ["simulate", "heatmap", str(csv), "-o", str(tmp_path / "heat")]):
        got = run_fresh(argv, tmp_path)
        assert got["rc"] == 0 and got["heavy"] == [], argv
    assert (tmp_path / "plan" / "plan.json").exists() and (tmp_path / "report" / "report.json").exists()
    assert (tmp_path / "pp_plan.json").exists()
