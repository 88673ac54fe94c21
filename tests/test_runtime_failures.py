"""Failure behaviour of `torchpp.train`: bad plans fail fast on every rank, a dead or stalled
peer is an error naming the action and the peer, and a rank killed under
`torchrun --max-restarts=1` is recovered with the same final weights."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dist_harness import run_cases
from torchpp.models.presets import load_config, model_info
from torchpp.models.stages import read_tensors, safetensors_index
from torchpp.planner.simple import make_plan
from torchpp.runtime.launch import popen_ranks, wait_ranks

ROOT = Path(__file__).resolve().parents[1]


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.update(extra)
    return env


def launch(args: list[str], world: int) -> list[subprocess.Popen]:
    """`torchpp.train` once per rank, as torchrun starts it on one node (env://, a free port)."""
    return popen_ranks([sys.executable, "-m", "torchpp.train", *args], world, env=_env(), cwd=ROOT,
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def write_plan(path: Path, model: str = "qwen3-tiny", layers=((0, 2), (2, 4)), groups=(1, 1), mbs: int = 2,
               m: int = 2) -> Path:
    info = model_info(load_config(model), model)
    make_plan(info, seq_len=16, global_batch=mbs * m, num_microbatches=m, layer_ranges=list(layers),
              group_sizes=list(groups)).save(path)
    return path


@pytest.mark.parametrize("problem", ["world_size", "malformed", "wrong_type", "model"])
def test_bad_plan_fails_on_every_rank_before_any_collective(tmp_path, problem):
    plan = write_plan(tmp_path / "plan.json", groups=(2, 1) if problem == "world_size" else (1, 1))
    expect = {"world_size": "field 'stages[*].devices'", "malformed": "field 'stages[1].layers'",
              "wrong_type": "field 'micro_batch_size'", "model": "--model llama-tiny: expected the plan's model qwen3-tiny"}[problem]
    # A rank that reached a collective would wait --timeout-s (far beyond the test's limit) for the other.
    args = ["--plan", str(plan), "--steps", "1", "--threads", "1", "--timeout-s", "900"]
    data = json.loads(plan.read_text())
    if problem == "malformed":
        data["stages"][1]["layers"] = [3, 4]  # layer 2 belongs to no stage
    if problem == "wrong_type":
        data["micro_batch_size"] = "two"
    plan.write_text(json.dumps(data))
    if problem == "model":
        args += ["--model", "llama-tiny"]  # not the plan's model: refused by name
    procs = launch(args, world=2)
    results = wait_ranks(procs, timeout_s=400)  # imports of 2 ranks on a loaded 2-core machine: minutes
    for rank, (code, _, err) in enumerate(results):
        lines = [ln for ln in err.splitlines() if "torchpp.train" in ln]
        assert code == 2, err[-2000:]
        assert len(lines) == 1 and f"rank {rank}: error:" in lines[0] and expect in lines[0], err[-2000:]
        assert str(plan) in lines[0] or problem == "model", lines[0]


def _wait_for_line(proc: subprocess.Popen, text: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if text in line:
            return
        if not line and proc.poll() is not None:
            raise AssertionError(f"rank exited ({proc.returncode}) before printing {text!r}: {proc.stderr.read()[-2000:]}")
    raise TimeoutError(f"no {text!r} within {timeout} s")


@pytest.mark.parametrize("fault", ["stall", "die"])
def test_peer_failure_is_named_within_timeout(tmp_path, fault):
    plan = write_plan(tmp_path / "plan.json")
    timeout_s = 4
    procs = launch(["--plan", str(plan), "--steps", "100000", "--threads", "1", "--timeout-s", str(timeout_s)], 2)
    try:
        _wait_for_line(procs[0], "step     2/", timeout=120)
        t0 = time.monotonic()
        procs[1].send_signal(signal.SIGSTOP if fault == "stall" else signal.SIGKILL)
        _, err = procs[0].communicate(timeout=timeout_s + 60)
        elapsed = time.monotonic() - t0
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.kill()
            p.wait()
    lines = [ln for ln in err.splitlines() if "torchpp.train: error:" in ln]
    assert procs[0].returncode == 1 and len(lines) == 1, err[-2000:]
    msg = lines[0]
    # rank 0 runs stage 0: it is waiting either for a gradient from rank 1 or in a step-end collective
    assert "rank 0:" in msg and ("from rank 1" in msg or "to rank 1" in msg or "all ranks" in msg), msg
    if fault == "stall":
        assert "no progress within --timeout-s 4" in msg, msg
        assert timeout_s - 1 <= elapsed < timeout_s + 30
    else:
        assert "closed the connection" in msg or "no progress" in msg, msg
        assert elapsed < timeout_s + 30


@pytest.mark.slow
def test_killed_rank_recovers_under_torchrun_with_same_weights(tmp_path):
    import psutil

    plan = write_plan(tmp_path / "plan.json", m=2)
    steps = 30
    common = ["--plan", str(plan), "--steps", str(steps), "--threads", "1", "--timeout-s", "30", "--seed", "3",
              "--checkpoint-every", "1"]
    # the uninterrupted run
    straight = tmp_path / "straight"
    straight.mkdir()
    run_cases([{"world_size": 2, "result": str(straight / "result.json"), "config": dict(
        plan=plan, steps=steps, threads=1, timeout_s=30.0, seed=3, checkpoint_dir=straight / "ckpt")}],
        nprocs=2, workdir=straight, timeout_s=240)
    # the same run under torchrun, with rank 1 killed after the third checkpoint
    ck, logs = tmp_path / "ckpt", tmp_path / "logs"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--max-restarts", "1", "--monitor-interval", "0.2", "-m", "torchpp.train", *common,
           "--checkpoint-dir", str(ck), "--log-dir", str(logs)]
    agent = subprocess.Popen(cmd, env=_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    killed = None
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and killed is None:
            if (ck / "step_00000003" / "manifest.json").is_file():
                for child in psutil.Process(agent.pid).children(recursive=True):
                    try:
                        if child.environ().get("RANK") == "1":
                            child.kill()
                            killed = child.pid
                    except psutil.Error:
                        pass
            time.sleep(0.02)
        out, _ = agent.communicate(timeout=240)
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
    assert killed is not None, "rank 1 was never seen running"
    assert agent.returncode == 0, out[-3000:]
    events = [json.loads(x) for x in (logs / "metrics.jsonl").read_text().splitlines()]
    resumes = [e for e in events if e.get("event") == "resume"]
    assert len(resumes) == 1 and 3 <= resumes[0]["from_step"] < steps and resumes[0]["restart_count"] == 1, events
    # every step after the resume point ran again, and the final weights are the uninterrupted run's, bit for bit
    final, ref = ck / f"step_{steps:08d}", straight / "ckpt" / f"step_{steps:08d}"
    names = sorted(safetensors_index(ref))
    assert sorted(safetensors_index(final)) == names
    a, b = read_tensors(final, names), read_tensors(ref, names)
    for n in names:
        assert torch.equal(a[n], b[n]), n
