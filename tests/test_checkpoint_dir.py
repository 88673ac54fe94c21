"""Checkpoint directories are checked before the first step, a killed write's leftovers are
removed and never loaded, and only the newest --keep-checkpoints complete checkpoints stay."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from dist_harness import run_cases
from test_runtime_failures import launch, write_plan
from torchpp.runtime.launch import wait_ranks
from torchpp.runtime import checkpoint as ckpt


def _fake_step(root: Path, step: int, complete: bool = True, missing_file: bool = False) -> Path:
    d = ckpt.step_dir(root, step)
    d.mkdir(parents=True)
    (d / "model-stage0.safetensors").write_bytes(b"x")
    if complete:
        files = ["model-stage0.safetensors"] + (["optim-stage0.safetensors"] if missing_file else [])
        (d / ckpt.MANIFEST).write_text(json.dumps({"format": ckpt.CKPT_FORMAT, "step": step, "files": files}))
    return d


def test_check_dir_creates_a_writable_directory(tmp_path):
    ckpt.check_dir(tmp_path / "a" / "b", need_bytes=1)
    assert (tmp_path / "a" / "b").is_dir() and not list((tmp_path / "a" / "b").iterdir())


def test_check_dir_refuses_a_file_and_a_path_under_a_file(tmp_path):
    f = tmp_path / "f"
    f.write_text("")
    with pytest.raises(ckpt.CheckpointDirError, match=f"--checkpoint-dir {f}: is a file, not a directory"):
        ckpt.check_dir(f, need_bytes=1)
    with pytest.raises(ckpt.CheckpointDirError, match=f"lies under {f}, which is a file"):
        ckpt.check_dir(f / "x" / "y", need_bytes=1)


def test_check_dir_refuses_a_full_disk(tmp_path):
    with pytest.raises(ckpt.CheckpointDirError, match=r"MB free, one checkpoint needs about [\d,.]+ MB"):
        ckpt.check_dir(tmp_path, need_bytes=1 << 62)


def test_check_dir_refuses_a_directory_it_cannot_write(tmp_path):
    if os.geteuid() != 0:
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o555)
        target = ro / "ckpt"
    else:  # root writes through permissions; /sys refuses new entries even to root
        target = Path("/sys/torchpp-checkpoint-test")
        try:
            target.mkdir()
        except OSError:
            pass
        else:
            target.rmdir()
            pytest.skip("no directory here refuses writes to this user")
    with pytest.raises(ckpt.CheckpointDirError, match="not writable"):
        ckpt.check_dir(target, need_bytes=1)


def test_leftovers_are_removed_and_complete_checkpoints_kept(tmp_path):
    good = _fake_step(tmp_path, 2)
    (good / ".model-stage0.safetensors.abc.tmp").write_bytes(b"partial")
    partial = _fake_step(tmp_path, 3, complete=False)
    missing = _fake_step(tmp_path, 4, missing_file=True)
    (tmp_path / ".stray.xyz.tmp").write_bytes(b"")
    (tmp_path / "notes.txt").write_text("kept")
    removed = ckpt.clean_leftovers(tmp_path)
    assert set(removed) == {good / ".model-stage0.safetensors.abc.tmp", partial, missing, tmp_path / ".stray.xyz.tmp"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt", "step_00000002"]
    assert ckpt.latest_local(tmp_path) == 2


def test_a_step_set_aside_by_another_rank_while_it_is_read_is_no_checkpoint(tmp_path, monkeypatch):
    """Two ranks of one host share the directory: the manifest writer renames a damaged step
    (``.damaged``) while the other rank lists the steps to agree on the next one."""
    _fake_step(tmp_path, 1)
    _fake_step(tmp_path, 2)
    real = ckpt.read_json

    def renamed_first(path):
        if Path(path).parent == ckpt.step_dir(tmp_path, 2):  # after read_json's is_file, before its read
            ckpt.set_aside(Path(path).parent)
            return json.loads(Path(path).read_text())
        return real(path)

    monkeypatch.setattr(ckpt, "read_json", renamed_first)
    assert ckpt.complete_steps(tmp_path) == [1]


def test_prune_keeps_the_newest_complete_checkpoints(tmp_path):
    for s in (1, 2, 3, 4):
        _fake_step(tmp_path, s)
    _fake_step(tmp_path, 5, complete=False)  # being written: neither counted nor deleted
    assert [p.name for p in ckpt.prune(tmp_path, 2)] == ["step_00000001", "step_00000002"]
    assert ckpt.complete_steps(tmp_path) == [3, 4] and ckpt.step_dir(tmp_path, 5).is_dir()
    assert ckpt.prune(tmp_path, 0) == []


def _case(plan: Path, out: Path, ck: Path, **kw) -> dict:
    return {"world_size": 2, "result": str(out), "config": dict(plan=plan, threads=1, timeout_s=60.0,
                                                               checkpoint_dir=ck, checkpoint_every=1,
                                                               full_checkpoint_every=1, **kw)}


def test_retention_and_resume_over_a_killed_write(tmp_path):
    plan = write_plan(tmp_path / "plan.json")
    kept, resumed = tmp_path / "kept", tmp_path / "resumed"
    run_cases([_case(plan, tmp_path / "kept.json", kept, steps=4, keep_checkpoints=2),
               _case(plan, tmp_path / "first.json", resumed, steps=2, keep_checkpoints=0)],
              nprocs=2, workdir=tmp_path, timeout_s=300)
    # retention keeps the newest step checkpoints; the final HF model directory is not one of them
    assert sorted(p.name for p in kept.iterdir() if p.name != "final") == ["step_00000003", "step_00000004"]
    assert ckpt.complete_steps(resumed) == [1, 2]
    # what a write killed during step 3 leaves, and a manifest whose files never all arrived
    (ckpt.step_dir(resumed, 2) / ".optim-stage1.safetensors.k1ll.tmp").write_bytes(b"partial")
    _fake_step(resumed, 3, complete=False)
    (ckpt.step_dir(resumed, 3) / ".model-stage1.safetensors.k1ll.tmp").write_bytes(b"partial")
    _fake_step(resumed, 9, missing_file=True)
    second = tmp_path / "second"
    second.mkdir()
    run_cases([_case(plan, second / "resumed.json", resumed, steps=3, resume=True, keep_checkpoints=2)],
              nprocs=2, workdir=second, timeout_s=300)
    assert json.loads((second / "resumed.json").read_text())["start"] == 2
    assert sorted(p.name for p in resumed.iterdir() if p.name != "final") == ["step_00000002", "step_00000003"]
    assert not list(resumed.rglob("*.tmp")) and ckpt.complete_steps(resumed) == [2, 3]


def test_unusable_checkpoint_dir_is_one_error_on_every_rank_before_the_first_step(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    plan = write_plan(tmp_path / "plan.json")
    logs = tmp_path / "logs"
    procs = launch(["--plan", str(plan), "--steps", "2", "--threads", "1", "--timeout-s", "900",
                    "--checkpoint-dir", str(blocker / "ckpt"), "--log-dir", str(logs)], world=2)
    for rank, (code, out, err) in enumerate(wait_ranks(procs, timeout_s=150)):
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert code == 2, err[-2000:]
        assert lines == [f"torchpp.train: rank {rank}: error: ranks 0, 1: --checkpoint-dir {blocker / 'ckpt'}: "
                         f"lies under {blocker}, which is a file, not a directory"], err[-2000:]
        assert "step" not in out, out
    assert not logs.exists()
