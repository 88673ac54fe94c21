"""Every benchmark behind a README claim keeps running: each one's quick mode (seconds, not a
measurement) runs here, so a refactor that breaks one fails the suite."""
from __future__ import annotations

import json
import os
import re
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


def _run_out(script: str, out: Path, *args: str, timeout_s: float = 1800) -> str:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--quick", "--out", str(out), *args],
                          capture_output=True, text=True, timeout=timeout_s, env=env, cwd=ROOT)
    assert proc.returncode == 0, f"{script} --quick failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc.stdout


@pytest.mark.slow
@pytest.mark.timeout(1900)  # several multi-process runs: room for a loaded machine
def test_bench_chunked_quick(tmp_path):
    text = _run_out("bench_chunked.py", tmp_path)
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert [r["schedule"] for r in rows] == ["interleaved", "interleaved-zb", "zbv"]
    for r in rows:
        assert r["step_ratio"] > 0 and r["max_loss_diff"] < 1e-4, r  # same weights, same data: same losses
    for sched, peer in (("interleaved", "ScheduleInterleaved1F1B"), ("interleaved-zb", "ScheduleInterleavedZeroBubble"),
                        ("zbv", "ScheduleZBVZeroBubble")):  # the peer ratio line of each pair
        assert re.search(rf"^{sched} +vs {peer} +p=2: step torchpp/peer \d+\.\d{{3}} ", text, re.M), text


@pytest.mark.slow
@pytest.mark.timeout(1900)  # several multi-process runs: room for a loaded machine
def test_bench_pipelining_quick(tmp_path):
    # --timeout-s 300: the alternating run (4 systems x 3 steps) has its deadline from it; 270 s was not enough on
    # a machine loaded by other work
    text = _run_out("bench_pipelining.py", tmp_path, "--timeout-s", "300")
    got = json.loads((tmp_path / "results.json").read_text())
    systems = [(r["system"], r["ranks"]) for r in got["rows"]]
    assert systems == [("single", 1), ("torchpp", 2), ("peer", 2)]
    assert all(r["max_loss_diff_vs_single"] < 1e-4 for r in got["rows"])
    assert got["rows"][1]["vs_peer"] > 0 and got["rows"][2]["vs_peer"] == 1.0  # torchpp / peer, the peer / itself
    assert re.search(r"^torchpp +2 +\d+\.\d{3} +\d+\.\d{3} ", text, re.M), text  # the table's torchpp row and its vs-peer ratio


@pytest.mark.slow
@pytest.mark.timeout(1900)  # several multi-process runs: room for a loaded machine
def test_bench_call_cost_quick(tmp_path):
    text = _run_out("bench_call_cost.py", tmp_path)
    assert "runtime CPU per call" in text


# ----------------------------------------------------------------------------- every other script's quick mode
def _cluster_why_not() -> str | None:
    from torchpp.demo import cluster_available

    return "needs root (cgroups, network namespaces, tc)" if os.geteuid() != 0 else cluster_available()


def _root() -> list:
    why = _cluster_why_not()
    return [pytest.mark.root, pytest.mark.slow,
            pytest.mark.skipif(why is not None, reason=f"emulated cluster unavailable: {why}")]


NUM = r"-?[0-9]+(?:\.[0-9]+)?"
QUICK = [
    # script, arguments ({out}: a fresh folder), lines that must appear (regular expressions, each matched on a line)
    pytest.param("bench_timer.py", ["--quick"],
                 [r"^backend\s+begin\+end ns/span\s+mark ns/event\s+\(median of 2, 2000 spans each\)$",
                  rf"^python\s+{NUM}\s+{NUM}$"], id="bench_timer"),
    pytest.param("bench_hooks.py", ["--quick"],
                 [r"^seq 16, batch 2, ", rf"^qwen3-tiny\s+4\s+{NUM}\s+{NUM}\s+{NUM}\s+{NUM}$"], id="bench_hooks"),
    pytest.param("schedule_gantts.py", ["--quick", "--out", "{out}"],
                 [rf"^seed 000's own plan \(1F1B, .*\): {NUM} s$",
                  *(rf"^  {k}\s+{NUM} s  \({NUM}x seed 000's\)  \[0,.* -> .*{k}\.png$" for k in ("1f1b", "zbv"))],
                 id="schedule_gantts"),
    pytest.param("bench_docsplit.py", ["--quick"],
                 [r"^one document of [\d,]+ characters, [\d,]+ tokens \(\d+ pieces\); ids equal$",
                  *(rf"^  {m}\s*: \+{NUM} MiB while encoding, {NUM} CPU s$" for m in ("whole", "pieces")),
                  rf"^memory {NUM}x, CPU {NUM}x of encoding it whole$"], id="bench_docsplit"),
    pytest.param("bench_tied_rows.py", ["--quick", "--out", "{out}"],
                 [*(rf"^\| {r} \| (baseline|bit-identical|last {NUM} vs {NUM}) \| {NUM} kB \| {NUM} kB \| {NUM} ms \|$"
                    for r in ("pp_fp32", "pp_rows", "pp_int8", "pp_int8_rows")),
                  r"^\| pp_rows \| bit-identical \|"],
                 marks=pytest.mark.slow, id="bench_tied_rows"),
    pytest.param("bench_planner.py", ["--quick"],
                 [*(rf"^   8 devices x 28 layers \(G=32, --schedule {k}\): {NUM} s wall, {NUM} s CPU .*planner / "
                    rf"proven lower bound {NUM}$" for k in ("1f1b", "auto")),
                  rf"^  instance  1: 2 hosts x\s+\d+ layers, G=\s*\d+: {NUM} s CPU, plan_meta {NUM} kB",
                  rf"^  seed 000's plan \(1f1b\): {NUM} s; ratio {NUM} \(target <= 0\.5\)$",
                  rf"^  planner / lower bound {NUM} ",
                  rf"^  instance 1: 6 devices x\s+\d+ layers, G=\s*\d+: planner / every order {NUM} \({NUM} s CPU; "
                  rf"three orders alone {NUM}\)",
                  rf"^  worst {NUM}, mean {NUM}, instances at 1\.0000: \d/1 \(target worst <= 1\.02\)$"],
                 id="bench_planner"),
    pytest.param("bench_planner.py", ["--certify-small", "1"],
                 [rf"^  cluster 1: 5 hosts x\s+8 layers, G=\s*8: zbv, step {NUM} s, bound {NUM} s, within {NUM}% "
                  rf"\({NUM} s CPU\)$", r"^  worst [0-9.]+%, within 5%: 1/1, within 15%: 1/1$"],
                 id="bench_planner_certify_small"),
    pytest.param("bench_planner.py", ["--exact", "2"],
                 [rf"^  cluster 1: \d hosts x\s+\d+ layers, G=\s*\d+: without \S+ {NUM} s \({NUM} s CPU\), with \S+ "
                  rf"{NUM} s \({NUM} s CPU\), ratio {NUM} \[(one-chunk|chunked) kinds (exact|enumerated in part) ",
                  rf"^  \d clusters: \d plans faster \(least ratio {NUM}\), 0 slower; CPU added: mean -?{NUM} s, "
                  rf"most -?{NUM} s$"],
                 id="bench_planner_exact"),
    pytest.param("bench_planner.py", ["--quick", "--gantts", "{out}"],
                 [rf"^  {k}: {NUM} s -> .*{k}\.png$" for k in ("1f1b", "zbv")], id="bench_planner_gantts"),
    pytest.param("bench_loop.py", ["--quick", "--local", "--out", "{out}"],
                 [*(rf"^\| {r}.* \| {NUM} \| {NUM} \| [+-]{NUM}% \| " for r in ("plan", "even", "dp", "unbalanced",
                                                                                 "replan")),
                  rf"^- step time MAPE over 5 plans: {NUM}%",
                  rf"^- measured plan / even split: {NUM}; plan / DP: {NUM}",
                  rf"^- re-plan from the unbalanced run / best of plan and re-plan: {NUM} .*unbalanced / plan: {NUM}$"],
                 marks=pytest.mark.slow, id="bench_loop"),
    pytest.param("bench_prove.py", ["--quick", "--local", "--out", "{out}", "--work", "{out}/work"],
                 [*(rf"^\| {r} \| .* \| {NUM} \| " for r in ("even", "peer_1F1B_m2", "fsdp_m1", "plan", "unbalanced",
                                                              "replan")),
                  rf"^- plan faster than the even 1F1B split: {NUM}x", rf"^- plan faster than the peer's best .*: {NUM}x",
                  rf"^- plan / lower bound: {NUM} ", rf"^- step-time MAPE over 4 plans: {NUM}%",
                  rf"^- step-time MAPE after one calibration run .*: {NUM}%",
                  rf"^- re-plan / best of plan and re-plan: {NUM} "],
                 marks=pytest.mark.slow, id="bench_prove"),
    pytest.param("bench_elastic.py", ["--quick", "--out", "{out}"],
                 [rf"^checkpoint every step \(qwen3-small, 2 ranks on \d+ cores, {NUM} s/step without",
                  *(rf"^  {k}\s+\+\s*{NUM} ms/step  ratio\s+{NUM}% of a step" for k in ("sync", "background",
                                                                                         "background_full")),
                  r"^recovery after SIGKILL of rank 1 \(desktop\) at step 2: new plan 3 ranks on .*, resumed from "
                  r"step \d, \d+ step\(s\) of work lost$",
                  rf"^  total\s+{NUM} s$", rf"^  by hand \(torchpp plan {NUM} s .*: {NUM} s  -> elastic/hand {NUM}$"],
                 marks=pytest.mark.slow, id="bench_elastic"),
    pytest.param("cluster_accuracy.py", ["--quick", "--out", "{out}"],
                 [rf"^cpu  0\.50 cores: runs at {NUM} of a full core \({NUM} of the quota\)$",
                  rf"^link\s+50mbit: probe\s+{NUM} /\s+{NUM} Mbit/s \({NUM} / {NUM} of configured\)$",
                  r"^profiles of hetero4 \(qwen3-tiny, 1 layers, ", r"^wrote .*accuracy\.csv and accuracy\.png$"],
                 marks=_root(), id="cluster_accuracy"),
    pytest.param("seed003_experiments.py", ["--quick", "--out", "{out}"],
                 [rf"^   probe: median link {NUM} Mbit/s$", rf"^   pp: step {NUM}s \(median of 2\)",
                  rf"^   dp: step {NUM}s \(median of 2\)", rf"^\| 1000 Mbit/s \| {NUM} \| {NUM} \| {NUM} \| {NUM} \| ",
                  r"^seed 003 done in \d+s$"], marks=_root(), id="seed003_experiments"),
    pytest.param("bench_powersgd.py", ["--quick", "--out", "{out}"],
                 [rf"^adamw_fp32: last-1 mean loss {NUM}$", rf"^adamw_r4_s2: last-1 mean loss {NUM}$",
                  r"'run': 'adamw_r4_s2', 'optimizer': 'adamw'.*'vs_fp32_mean': '[+-]"],
                 marks=pytest.mark.slow, id="bench_powersgd"),
    pytest.param("bench_wire_homelab.py", ["--quick", "--out", "{out}", "--work", "{out}/work"],
                 [rf"^\| {r} \| 3 \| {NUM} \| [+-]{NUM}% \| {NUM} kB \| " for r in ("pp_fp32", "pp_lossy", "pp_bf16", "pp_split_fp32")],
                 marks=_root(), id="bench_wire_homelab"),
    pytest.param("bench_wire_homelab.py", ["--quick", "--local-seeds", "0,1", "--runs", "pp_fp32,pp_lossy,pp_fp32_mb",
                                           "--out", "{out}", "--work", "{out}/work"],
                 [rf"^\| {r} \| [+-]{NUM}% \| [+-]{NUM}% \| [+-]{NUM}% \| {NUM}% \| [+-]{NUM}% \.\. [+-]{NUM}% \|$"
                  for r in ("pp_lossy", "pp_fp32_mb")],
                 marks=pytest.mark.slow, id="bench_wire_homelab_seeds"),
    pytest.param("topology_accuracy.py", ["--quick", "--out", "{out}", "--work", "{out}/work"],
                 [rf"^\| topology \(star template, shared links\) \| {NUM} \| {NUM} \| [+-]{NUM}% \|$",
                  rf"^\| per-pair links \(no sharing\) \| {NUM} \| {NUM} \| [+-]{NUM}% \|$",
                  rf"^- verdict: \|error\| {NUM}% "], marks=_root(), id="topology_accuracy"),
]


@pytest.mark.timeout(1900)
@pytest.mark.parametrize("script, args, lines", QUICK)
def test_quick_mode(script, args, lines, tmp_path):
    """The script's quick mode exits 0 and prints its figures' lines (the numbers are not judged:
    a quick mode measures nothing)."""
    out = tmp_path / "out"
    text = _run(script, *(a.format(out=out) for a in args), timeout=1800)  # the demo-based ones, on a loaded machine
    got = text.splitlines()
    missing = [p for p in lines if not any(re.search(p, ln) for ln in got)]
    assert not missing, f"{script}: no line matches {missing}\n{text[-4000:]}"


ELSEWHERE = {"bench_data.py": "test_bench_data.py", "bench_wire.py": "test_bench_wire.py",
             "bench_fidelity.py": "test_bench_fidelity.py", "bench_corpus_cluster.py": "test_demo.py"}
"""Scripts whose quick mode a test file of their own runs (it also checks their figures)."""
MODULES = {"peer_part.py": "the peer's stage, imported by bench_pipelining.py and bench_chunked.py (run above)",
           "bench_wire_cluster.py": "bench_wire.py --cluster's runs on the emulated cluster, imported by bench_wire.py"}


def test_every_benchmark_has_its_quick_run():
    """A new script in benchmarks/ needs a quick run here (or in its own test file)."""
    here = Path(__file__).read_text()
    covered = {p.values[0] for p in QUICK} | set(re.findall(r'_run(?:_out)?\("(\w+\.py)"', here))
    for script, test in ELSEWHERE.items():
        assert re.search(rf'"{script}"\), "--quick"', (ROOT / "tests" / test).read_text()), (script, test)
    scripts = {p.name for p in (ROOT / "benchmarks").glob("*.py")}
    assert scripts - covered - set(ELSEWHERE) - set(MODULES) == set()
    for script in scripts - set(MODULES):
        assert "--quick" in (ROOT / "benchmarks" / script).read_text(), f"{script} has no --quick mode"
