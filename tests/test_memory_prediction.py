"""Peak memory per rank of a real 2-rank run against the planner's prediction (within 10%).

qwen3-small's 4096-token vocabulary makes its tail (logits, lm_head) and embedding the largest
terms of each rank, which the memory model must price: the calibration probes fit the model
(as ``torchpp calibrate-memory`` does), the plan is priced with it, two fresh processes train it
and the measured peak is the one ``torchpp analyze`` (and bench_prove) reads from the traces."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]
MODEL, SEQ, GLOBAL, MICRO = "qwen3-small", 32, 16, 4


def _layers_file():
    """The model's block bytes (parameters, activations per sample) in a layers file."""
    from torchpp.planner.estimate import block_params
    from torchpp.planner.synthetic import layers_file

    cfg, params = block_params(MODEL)
    h, v = int(cfg.hidden_size), int(cfg.vocab_size)
    lf = layers_file("local", num_layers=len(params) - 2, seq_len=SEQ, layer_param_bytes=[4 * p for p in params[1:-1]],
                     embed_param_bytes=4 * params[0], tail_param_bytes=4 * params[-1], act_bytes_per_sample=4 * SEQ * h,
                     tied=bool(cfg.tie_word_embeddings), model_name=MODEL, hidden_size=h, vocab_size=v)
    lf.tail = replace(lf.tail, activation_bytes_per_sample=4 * SEQ * v)
    return lf


def two_stage_plan(schedule: str = "1f1b"):
    """The layers file, its profiles on hosts a and b, and an even 2-stage plan over them."""
    from torchpp.cost import Profiles
    from torchpp.planner.simple import even_plan

    lf = _layers_file()
    profiles = Profiles.from_layers([replace(lf, host="a"), replace(lf, host="b")])
    plan = even_plan(lf.model, stages=2, hosts=["a", "b"], seq_len=SEQ, global_batch=GLOBAL,
                     num_microbatches=GLOBAL // MICRO, schedule=schedule)
    return lf, profiles, plan


def assert_priced_once(coef: str, term) -> None:
    """A coefficient held once per device (``coef`` of ``MemoryEstimator``, times ``term`` of a
    stage's activations per sample) adds ``s · coef · term`` to every stage's peak, whatever the
    micro-batches it holds and those past their I, in ``peak``, ``chunks_peak`` (one chunk) and
    ``terms`` (what re-planning refits by) alike."""
    from torchpp.cost import MemoryEstimator, StageMemory

    _, profiles, plan = two_stage_plan()
    est = MemoryEstimator(1e8, 4.0, 20.0, "test", kt=2.0, ke=1.0)
    mem, with_c = StageMemory(profiles, est), StageMemory(profiles, replace(est, **{coef: 15.0}))
    for st in plan.stages:
        s = st.device(st.devices[0].rank).samples
        x = float(term(mem.activations(st)))
        assert x > 0
        for n in (1, 2, 5):
            for split in (0, 1):
                assert with_c.peak(st, s, n, split) - mem.peak(st, s, n, split) == pytest.approx(s * 15.0 * x)
            assert with_c.chunks_peak([(st, s)], [[(st.index, n)]]) == pytest.approx(with_c.peak(st, s, n))
            assert with_c.terms(st, s, n).fixed_bytes - mem.terms(st, s, n).fixed_bytes == pytest.approx(s * 15.0 * x)


def test_the_embeddings_output_is_priced_by_no_term():
    """The embedding's output is the first layer's input, which that layer keeps (its bytes), and
    the embedding's backward needs only the token ids: a stage's price, in every consumer, does
    not move with the embedding's output bytes (with Kp it over-priced [0, 2) + embedding holding
    4 micro-batches of 8 by 16%: 302 MiB against 259 measured)."""
    import numpy as np

    from torchpp.cost import MemoryEstimator, StageMemory

    _, profiles, plan = two_stage_plan("zb-h1")
    wide = replace(profiles, act_bytes=np.array(profiles.act_bytes, dtype=float))
    wide.act_bytes[0] *= 50
    est = MemoryEstimator(1e8, 4.0, 20.0, "test", kt=2.0, ke=0.0, kw=-5.0, kb=6.0, kz=9.0, kl=7.0)
    first = plan.stages[0]
    assert first.has_embed
    s = first.device(first.devices[0].rank).samples
    mem, mem_wide = StageMemory(profiles, est), StageMemory(wide, est)
    assert mem.activations(first) == mem_wide.activations(first)
    for n in (1, 4):
        for split in (0, 2):
            assert mem_wide.peak(first, s, n, split) == pytest.approx(mem.peak(first, s, n, split))
            assert mem_wide.terms(first, s, n, split) == mem.terms(first, s, n, split)
        assert mem_wide.chunks_peak([(first, s)], [[(first.index, n)]]) == pytest.approx(mem.peak(first, s, n))
    # the layers' bytes still count: doubling the first layer's moves the price
    deep = replace(profiles, act_bytes=np.array(profiles.act_bytes, dtype=float))
    deep.act_bytes[1] *= 2
    assert StageMemory(deep, est).peak(first, s, 4) > mem.peak(first, s, 4)


def _run(cmd: list[str], timeout: float) -> str:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return r.stdout


def measured_memory(tmp_path: Path, plan, profiles, mm, runs: int = 3) -> dict:
    """``plan`` priced with ``mm``, trained ``runs`` times by two fresh processes, and ``torchpp
    analyze``'s predicted peak per rank against the median of the runs' measured peaks. One run's
    peak moves with the heap's layout (126 against 118 MiB for the same rank and plan, seconds
    apart), which on a 120 MiB rank is several percent; the median is what the benchmarks compare."""
    import statistics

    reports = [_measured_once(tmp_path / f"run{i}", plan, profiles, mm) for i in range(runs)]
    out = {}
    for r, v in reports[0].items():
        peak = statistics.median(x[r]["measured_peak_bytes"] for x in reports)
        out[r] = {**v, "measured_peak_bytes": peak, "measured_runs": [x[r]["measured_peak_bytes"] for x in reports],
                  "error": (v["predicted_peak_bytes"] - peak) / peak}
    return out


def _measured_once(tmp_path: Path, plan, profiles, mm) -> dict:
    from torchpp.cost import Links, MemoryEstimator
    from torchpp.planner import api
    from torchpp.planner.synthetic import uniform_links

    pb = SimpleNamespace(profiles=profiles, links=Links(uniform_links(["a", "b"])), memory=MemoryEstimator.fitted(mm),
                         optimizer_s_per_byte=0.0)
    api.price(plan, pb, {"a": 1e12, "b": 1e12})
    tmp_path.mkdir(parents=True, exist_ok=True)
    plan.save(tmp_path / "plan.json")
    traces = tmp_path / "traces"
    _run([str(Path(sys.executable).with_name("torchrun")), "--standalone", "--nproc-per-node", "2", "-m",
          "torchpp.train", "--plan", str(tmp_path / "plan.json"), "--model", MODEL, "--data", "synthetic", "--steps",
          "3", "--threads", "1", "--seed", "0", "--trace-dir", str(traces), "--trace-steps", "2,3", "--timeout-s",
          "120"], 240)
    _run([sys.executable, "-m", "torchpp.cli", "analyze", str(traces), "--plan", str(tmp_path / "plan.json"),
          "--out", str(tmp_path / "report")], 120)
    return json.loads((tmp_path / "report" / "report.json").read_text())["memory"]


@pytest.mark.timeout(420)
def test_peak_memory_per_rank_within_ten_percent(tmp_path):
    from torchpp.profiling.calibrate import calibrate

    lf, profiles, plan = two_stage_plan()
    mm = calibrate(lf, MODEL, samples=7, split_samples=0, held_samples=2, batch=[2, 8], seq_len=SEQ, timeout_s=120,
                   progress=lambda *_: None)
    assert mm.Ke is not None and mm.Kt is not None and mm.Kb is not None
    mem = measured_memory(tmp_path, plan, profiles, mm)
    errors = {r: v["error"] for r, v in mem.items()}
    assert set(errors) == {"0", "1"} and all(abs(e) <= 0.10 for e in errors.values()), mem
