"""Lose a host, keep training: `torchpp run --elastic` re-plans over the hosts left and resumes
from the newest complete checkpoint; the result equals an uninterrupted run of the new plan
from that checkpoint, on the uninterrupted data order. Also: background checkpoints are never
loaded half-written, and survivors that cannot hold the model get one message with the memory."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from torchpp.formats import Plan
from torchpp.models.presets import load_config, model_info
from torchpp.models.stages import read_tensors, safetensors_index
from torchpp.planner.simple import make_plan
from torchpp.planner.synthetic import layers_file, uniform_links
from torchpp.runtime import checkpoint as ckpt
from torchpp.elastic.driver import Driver, ElasticConfig, ElasticError, LocalLauncher
from torchpp.elastic.survivors import plan_survivors
from torchpp.runtime.launch import kill_rank_after_checkpoint, popen_ranks, wait_ranks

ROOT = Path(__file__).resolve().parents[1]
HOSTS = ("h0", "h1", "h2")


def _env() -> dict[str, str]:
    return dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
                PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))


def measurements(d: Path, memory_gb: float = 4.0) -> dict:
    """Layers files of qwen3-tiny on three hosts (synthetic times), links and devices."""
    cfg = load_config("qwen3-tiny")
    files = []
    for h, speed in zip(HOSTS, (1.0, 1.0, 0.8)):
        f = d / f"layers_{h}.json"
        layers_file(h, num_layers=4, speed=speed, batch=2, seq_len=16, model_name="qwen3-tiny",
                    hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size, tied=True,
                    layer_param_bytes=200_000, embed_param_bytes=130_000, tail_param_bytes=130_000).save(f)
        files.append(f)
    uniform_links(HOSTS, 1e8).save(d / "bandwidth.json")
    (d / "devices.json").write_text(json.dumps({h: memory_gb for h in HOSTS}))
    return dict(layers=files, devices=d / "devices.json", bandwidth=d / "bandwidth.json")


def first_plan(path: Path) -> Path:
    """Three one-device stages, one per host."""
    info = model_info(load_config("qwen3-tiny"), "qwen3-tiny")
    make_plan(info, seq_len=16, global_batch=4, num_microbatches=2, layer_ranges=[(0, 2), (2, 3), (3, 4)],
              group_sizes=[1, 1, 1], hosts=list(HOSTS)).save(path)
    return path


def _kill_rank_after(driver_dir: Path, ck: Path, step: int, rank: int, box: dict) -> None:
    """SIGKILL ``rank`` of the first attempt once checkpoint ``step`` is complete."""
    kill_rank_after_checkpoint(ck, step, rank, box, timeout_s=150)


def _final(ck: Path, step: int) -> dict[str, torch.Tensor]:
    d = ckpt.step_dir(ck, step)
    return read_tensors(d, sorted(safetensors_index(d)))


def _losses(log_dir: Path) -> dict[int, float]:
    events = [json.loads(x) for x in (log_dir / "metrics.jsonl").read_text().splitlines()]
    return {e["step"]: e["loss"] for e in events if "step" in e and "loss" in e}


def test_killed_host_is_planned_out_and_training_continues(tmp_path):
    kill_and_compare(tmp_path, LocalLauncher(_env()))


def kill_and_compare(tmp_path: Path, launcher, background: bool = True) -> None:
    """Kill host h2's rank after checkpoint 3 under ``launcher``; check the recovery against the
    new plan's uninterrupted run from the same checkpoint (weights 1e-5, losses step by step)."""
    steps, kill_after = 7, 3
    meas = measurements(tmp_path)
    ck, logs, work = tmp_path / "ckpt", tmp_path / "tb", tmp_path / "work"
    base = ["--steps", str(steps), "--seed", "3", "--threads", "1", "--checkpoint-every", "1",
            "--keep-checkpoints", "0"] + (["--checkpoint-background"] if background else [])
    train = [*base, "--log-dir", str(logs)]
    cfg = ElasticConfig(plan=first_plan(tmp_path / "plan.json"), train_args=train, checkpoint_dir=ck, work_dir=work,
                        timeout_s=20, startup_s=150, max_restarts=1, **meas)
    box: dict = {}
    killer = threading.Thread(target=_kill_rank_after, args=(work, ck, kill_after, 2, box), daemon=True)
    killer.start()
    result = Driver(cfg, launcher).run()
    killer.join(1)
    assert "killed_at" in box, "rank 2 was never seen running"
    assert result.exit_code == 0 and len(result.attempts) == 2, result
    first, second = result.attempts
    assert first.outcome == "failure" and first.failed == ["h2"]
    assert "h2" not in second.hosts and second.world_size < 3
    resumed = second.resume_step
    assert kill_after <= resumed < steps  # at most the step in flight was lost
    decisions = [json.loads(x) for x in result.decisions.read_text().splitlines()]
    assert [d["kind"] for d in decisions] == ["failure", "plan", "resume"]
    assert decisions[0]["how"] == {"h2": "killed by signal 9"} and decisions[2]["step"] == resumed
    # the decisions are in the run's metrics and TensorBoard
    events = [json.loads(x) for x in (logs / "metrics.jsonl").read_text().splitlines()]
    assert [e["kind"] for e in events if e.get("event", "").startswith("elastic_")] == ["failure", "plan", "resume"]
    steps_seen = [e for e in events if "step" in e and "loss" in e]
    # what the background writer cost each stage inside the step is recorded (only then)
    assert all(("checkpoint_wait_s" in e) == background for e in steps_seen)
    assert all(len(e[k]) == len(e["compute_s"]) and min(e[k]) >= 0
               for e in steps_seen if background for k in ("checkpoint_wait_s", "checkpoint_cpu_s"))
    if background:  # the writer of checkpoint N finishes during step N + 1: its CPU shows there
        assert any(sum(e["checkpoint_cpu_s"]) > 0 for e in steps_seen)
    assert any(p.name.startswith("events.out.tfevents") for p in logs.iterdir())
    elastic_losses = _losses(logs)

    # reference: the new plan, uninterrupted, from the same checkpoint
    ref_ck, ref_logs = tmp_path / "ref_ckpt", tmp_path / "ref_tb"
    for s in ckpt.complete_steps(ck):  # the checkpoint and, for a gradient log, the chain it loads from
        if s <= resumed:
            shutil.copytree(ckpt.step_dir(ck, s), ckpt.step_dir(ref_ck, s))
    plan = Plan.load(second.plan)
    procs = popen_ranks([sys.executable, "-m", "torchpp.train", "--plan", second.plan, *base,
                         "--checkpoint-dir", str(ref_ck), "--resume", "--log-dir", str(ref_logs), "--timeout-s", "60"],
                        plan.world_size, env=_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for code, _, err in wait_ranks(procs, timeout_s=180):
        assert code == 0, err[-2000:]
    a, b = _final(ck, steps), _final(ref_ck, steps)
    assert sorted(a) == sorted(b)
    for n in a:
        torch.testing.assert_close(a[n], b[n], rtol=0, atol=1e-5, msg=n)
    # the data order is the uninterrupted one: the same batch (same loss) at every step after the resume
    ref_losses = _losses(ref_logs)
    assert sorted(ref_losses) == list(range(resumed + 1, steps + 1))
    for s in ref_losses:
        assert elastic_losses[s] == pytest.approx(ref_losses[s], abs=1e-6), s


def test_survivors_that_cannot_hold_the_model_get_one_message(tmp_path):
    meas = measurements(tmp_path, memory_gb=0.0001)
    cfg = ElasticConfig(plan=first_plan(tmp_path / "plan.json"), train_args=[], checkpoint_dir=tmp_path / "ck",
                        work_dir=tmp_path / "w", **meas)
    with pytest.raises(ElasticError) as e:
        plan_survivors(cfg, Plan.load(cfg.plan), ["h0", "h1"], tmp_path / "out")
    msg = str(e.value)
    assert "h0, h1" in msg and "cannot hold the model" in msg and "needs" in msg and "devices have" in msg, msg
    with pytest.raises(ElasticError, match="no host is left"):
        plan_survivors(cfg, Plan.load(cfg.plan), [], tmp_path / "out")


def test_replan_keeps_the_batch_and_uses_only_survivors(tmp_path):
    meas = measurements(tmp_path)
    cfg = ElasticConfig(plan=first_plan(tmp_path / "plan.json"), train_args=[], checkpoint_dir=tmp_path / "ck",
                        work_dir=tmp_path / "w", **meas)
    old = Plan.load(cfg.plan)
    new = plan_survivors(cfg, old, ["h0", "h2"], tmp_path / "out")
    assert set(new.hosts) <= {"h0", "h2"} and new.plan.global_batch == old.global_batch
    assert new.plan.seq_len == old.seq_len and new.plan.model.name == "qwen3-tiny"
    assert json.loads((tmp_path / "out" / "devices.json").read_text()) == {"h0": 4.0, "h2": 4.0}


def test_ranks_setting_up_have_startup_s_before_they_count_as_stalled(tmp_path):
    """Imports and setup on a loaded machine may take longer than --timeout-s: until every rank
    has written its first heartbeat, only --startup-s applies."""
    from types import SimpleNamespace

    from torchpp.elastic.driver import Watch, Worker
    from torchpp.runtime.elastic_hooks import heartbeat

    running = SimpleNamespace(poll=lambda: None, pid=-1)
    workers = [Worker(r, f"h{r}", running, tmp_path / f"r{r}.log") for r in range(2)]
    cfg = ElasticConfig(plan=tmp_path / "plan.json", train_args=[], checkpoint_dir=tmp_path / "ck",
                        work_dir=tmp_path / "w", timeout_s=0.05, startup_s=60, elastic=False)
    hb = tmp_path / "hb"
    watch = Watch(cfg, workers, hb, ["h0", "h1"], lambda: None)
    heartbeat(hb, 0, 0)  # rank 0 is ready, rank 1 still importing
    for _ in range(5):
        time.sleep(0.05)
        assert watch.poll() is None
    heartbeat(hb, 1, 0)  # every rank set up: from here a step is due within --timeout-s
    watch.poll()
    time.sleep(0.2)
    out = watch.poll()
    assert out is not None and out.kind == "failure" and sorted(out.failed) == ["h0", "h1"], out
