"""Nothing lost by default: outputs go to runs/<plan stem>/ unless told otherwise, SIGTERM
checkpoints at the next step boundary (resuming then equals a run never stopped), and a resume
refuses other settings, a step beyond --steps, and a fresh start over another run's checkpoints."""
from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from test_runtime_failures import launch, write_plan
from torchpp.models.stages import read_tensors, safetensors_index
from torchpp.runtime import checkpoint as ckpt
from torchpp.runtime.launch import wait_ranks
from torchpp.runtime.safekeeping import (ResumeError, StopRequest, check_fresh_start, check_resume,
                                         default_output_dir)


def test_default_output_dir_is_runs_plan_stem_beside_the_plan():
    assert default_output_dir(Path("plan.json")) == Path("runs/plan")
    assert default_output_dir(Path("/x/cfg/big.json")) == Path("/x/cfg/runs/big")


def test_resume_names_each_changed_setting_and_refuses_a_step_beyond_steps(tmp_path):
    then = {"settings": {"lr": "0.001", "data": "a.txt 10 bytes sha256:1", "seed": "0"}}
    now = {"lr": "0.002", "data": "b.txt 12 bytes sha256:2", "seed": "0"}
    with pytest.raises(ResumeError, match=r"step 3 was trained with other settings: data a.txt 10 bytes sha256:1 -> "
                                          r"b.txt 12 bytes sha256:2; lr 0.001 -> 0.002: .* --accept-changes"):
        check_resume(tmp_path, 3, then, now, steps=10, accept_changes=False)
    assert check_resume(tmp_path, 3, then, now, steps=10, accept_changes=True) == [
        "data a.txt 10 bytes sha256:1 -> b.txt 12 bytes sha256:2", "lr 0.001 -> 0.002"]
    with pytest.raises(ResumeError, match="step 33 is beyond --steps 32"):
        check_resume(tmp_path, 33, then, then["settings"], steps=32, accept_changes=True)


def test_a_fresh_start_refuses_another_runs_checkpoints(tmp_path):
    d = ckpt.step_dir(tmp_path, 4)
    d.mkdir()
    (d / ckpt.MANIFEST).write_text(json.dumps({"format": ckpt.CKPT_FORMAT, "step": 4, "files": []}))
    check_fresh_start(tmp_path, resume=True)
    with pytest.raises(ResumeError, match=r"holds another run's checkpoints \(up to step 4\): pass --resume"):
        check_fresh_start(tmp_path, resume=False)


def test_a_signal_is_noted_once_and_a_second_one_acts_at_once():
    stop = StopRequest().install()
    try:
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.requested and stop.exit_code == 130
        with pytest.raises(KeyboardInterrupt):  # the handler was restored: the second one interrupts
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
    finally:
        stop.restore()


def _steps_logged(log_dir: Path) -> int:
    try:
        lines = (log_dir / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return 0
    return sum(1 for x in lines if x.endswith("}") and '"step"' in x)


def _weights(root: Path, step: int) -> dict[str, torch.Tensor]:
    d = ckpt.step_dir(root, step)
    return read_tensors(d, sorted(safetensors_index(d)))


def test_sigterm_checkpoints_at_the_step_boundary_and_resuming_equals_an_unstopped_run(tmp_path):
    plan = write_plan(tmp_path / "plan.json")
    common = ["--plan", str(plan), "--threads", "1", "--timeout-s", "120"]
    logs = tmp_path / "logs"
    procs = launch([*common, "--steps", "500", "--log-dir", str(logs)], world=2)
    deadline = time.monotonic() + 240
    while _steps_logged(logs) < 2 and time.monotonic() < deadline and all(p.poll() is None for p in procs):
        time.sleep(0.2)
    for p in procs:  # as torchrun forwards a SIGTERM to its workers
        p.send_signal(signal.SIGTERM)
    results = wait_ranks(procs, timeout_s=240)
    out = default_output_dir(plan)
    assert out == tmp_path / "runs" / "plan"
    k = ckpt.latest_local(out)
    for code, stdout, err in results:
        assert code == 128 + signal.SIGTERM, err[-3000:]
        assert "SIGTERM: stopping after this step" in err, err[-3000:]
    assert 2 <= k < 500 and ckpt.complete_steps(out) == [k], results[0][1][-2000:]
    assert f"stopped at step {k} of 500 by a signal; resume with --resume" in results[0][1]
    assert not (out / "final" / "config.json").exists()  # not trained to the end: no final model
    resumed = wait_ranks(launch([*common, "--steps", str(k + 2), "--resume"], world=2), timeout_s=300)
    assert all(code == 0 for code, _, _ in resumed), resumed[0][2][-3000:]
    assert f"resumed from {ckpt.step_dir(out, k)}" in resumed[0][1]
    ref = tmp_path / "ref"
    plain = wait_ranks(launch([*common, "--steps", str(k + 2), "--output-dir", str(ref)], world=2), timeout_s=300)
    assert all(code == 0 for code, _, _ in plain), plain[0][2][-3000:]
    want, got = _weights(ref, k + 2), _weights(out, k + 2)
    assert set(want) == set(got) and all(torch.equal(want[n], got[n]) for n in want)
    assert (out / "final" / "config.json").is_file()


def test_output_problem_names_the_flag_and_creates_usable_directories(tmp_path):
    from torchpp.runtime.safekeeping import output_problem

    blocker = tmp_path / "a_file"
    blocker.write_text("")
    assert output_problem({"--export-dir": tmp_path / "e" / "f", "--log-dir": None}) is None
    assert (tmp_path / "e" / "f").is_dir()
    assert "--trace-dir" in output_problem({"--trace-dir": blocker / "t"})


def test_an_unwritable_export_dir_is_one_line_on_every_rank_before_any_step(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    plan = write_plan(tmp_path / "plan.json")
    procs = launch(["--plan", str(plan), "--steps", "2", "--threads", "1", "--timeout-s", "900",
                    "--export-dir", str(blocker / "model")], world=2)
    for rank, (code, out, err) in enumerate(wait_ranks(procs, timeout_s=200)):
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert code == 2 and len(lines) == 1 and lines[0].startswith(f"torchpp.train: rank {rank}: error: "), err
        assert "--export-dir" in lines[0] and str(blocker) in lines[0], err
        assert "step " not in out, out


def test_resuming_another_models_checkpoint_is_one_line_on_every_rank(tmp_path):
    from test_checkpoint_integrity import _train
    from torchpp.runtime.launch import RankPool

    ck = tmp_path / "ck"
    tiny = write_plan(tmp_path / "tiny.json")
    llama = write_plan(tmp_path / "llama.json", model="llama-tiny")
    with RankPool(2, threads=1) as pool:
        pool.run(_train, dict(plan=tiny, steps=1, threads=1, timeout_s=60.0, output_dir=ck), timeout_s=300,
                 pg_timeout_s=60)
        out = pool.run(_train, dict(plan=llama, model="llama-tiny", steps=2, threads=1, timeout_s=60.0, output_dir=ck,
                                    resume=True, accept_changes=True), timeout_s=300, pg_timeout_s=60)
    assert out[0] == out[1] and out[0]["error"].startswith(f"--checkpoint-dir {ck}: step 1 holds another model ("), out
    assert ckpt.complete_steps(ck) == [1]  # refused, not set aside as damaged
