"""Cheap per-step checkpoints keep their guarantees: files written from tensor memory are
safetensors that the HF loaders read, a retired checkpoint's files are overwritten only under
a temporary name, the update waits until the background writer has read the tensors, and a
write killed half-way leaves no complete-looking step."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from torchpp.models.presets import load_config
from torchpp.models.stages import StageSpec, build_stage
from torchpp.runtime import checkpoint as ckpt
from torchpp.runtime import tensor_files

ROOT = Path(__file__).resolve().parents[1]


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(5, 3, generator=g), "b16": torch.randn(7, generator=g).to(torch.bfloat16),
            "step": torch.tensor(3.0), "n": torch.tensor([1, 2, 3], dtype=torch.int64),
            "empty": torch.zeros(0, 4), "view": torch.arange(12.0).reshape(3, 4).t()}


def test_tensor_files_are_safetensors(tmp_path):
    ts = _tensors()
    written = tensor_files.write(tmp_path / "a.safetensors", ts, {"format": "pt", "k": "v"})
    assert written.size == (tmp_path / "a.safetensors").stat().st_size
    assert written == tensor_files.digest_of(tmp_path / "a.safetensors")  # hashed from memory = the file's bytes
    back = load_file(tmp_path / "a.safetensors")
    assert set(back) == set(ts)
    for k, t in ts.items():
        assert back[k].dtype == t.dtype and torch.equal(back[k], t), k
    with safe_open(str(tmp_path / "a.safetensors"), framework="pt") as f:
        assert f.metadata() == {"format": "pt", "k": "v"}


def test_a_recycled_longer_file_is_overwritten_and_cut_to_size(tmp_path):
    old = tmp_path / "old.safetensors"
    tensor_files.write(old, {"big": torch.randn(1000)})
    ino = old.stat().st_ino
    ts = _tensors()
    tensor_files.write(tmp_path / "new.safetensors", ts, reuse=old)
    assert not old.exists() and (tmp_path / "new.safetensors").stat().st_ino == ino
    back = load_file(tmp_path / "new.safetensors")
    assert all(torch.equal(back[k], t) for k, t in ts.items())
    tensor_files.write(tmp_path / "again.safetensors", ts, reuse=old)  # taken already: a new file
    assert set(load_file(tmp_path / "again.safetensors")) == set(ts)


def _stage_and_optimizer():
    cfg = load_config("qwen3-tiny")
    stage = build_stage("qwen3-tiny", cfg, StageSpec.whole(cfg.num_hidden_layers))
    opt = torch.optim.AdamW(stage.parameters(), lr=1e-2)
    return stage, opt


def _update(stage, opt) -> None:
    for p in stage.parameters():
        p.grad = torch.ones_like(p)
    opt.step()


def _saved(root: Path, step: int) -> dict[str, torch.Tensor]:
    d = ckpt.step_dir(root, step)
    return {**load_file(d / "model-stage0.safetensors"), **load_file(d / "optim-stage0.safetensors")}


def _live(stage, opt) -> dict[str, torch.Tensor]:
    out = {n: p.detach().clone() for n, p in stage.named_parameters()}
    return {**out, **{k: v.clone() for k, v in ckpt.optimizer_tensors(stage, opt).items()}}


ROLES = ckpt.Roles(stage=0, writes_stage=True, writes_manifest=True)


def test_pruned_checkpoints_lend_their_files_and_resume_loads_equal_weights(tmp_path):
    stage, opt = _stage_and_optimizer()
    inodes = {}
    for step in range(1, 6):
        _update(stage, opt)
        ckpt.save(tmp_path, step, rank=0, roles=ROLES, stage=stage, optimizer=opt, info={}, timeout_s=10, keep=2)
        inodes[step] = (ckpt.step_dir(tmp_path, step) / "optim-stage0.safetensors").stat().st_ino
    assert ckpt.complete_steps(tmp_path) == [4, 5]
    # step N is written before step N-2 is retired: step N+1 overwrites step N-2's pages
    assert inodes[4] == inodes[1] and inodes[5] == inodes[2] and len(set(inodes.values())) == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == [ckpt.RECYCLE, "step_00000004", "step_00000005"]
    want = _live(stage, opt)
    assert all(torch.equal(_saved(tmp_path, 5)[k], v) for k, v in want.items())
    fresh, fresh_opt = _stage_and_optimizer()
    _update(fresh, fresh_opt)  # optimizer state to overwrite
    ckpt.load(tmp_path, 5, rank=0, stage=fresh, optimizer=fresh_opt)
    got = _live(fresh, fresh_opt)
    assert all(torch.equal(got[k], v) for k, v in want.items())
    ckpt.release_recycled(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000004", "step_00000005"]


def test_the_update_waits_until_the_background_writer_has_read_the_tensors(tmp_path, monkeypatch):
    stage, opt = _stage_and_optimizer()
    _update(stage, opt)
    before = _live(stage, opt)
    slow, nice = tensor_files.write, []

    def slow_write(*a, **kw):
        nice.append(os.getpriority(os.PRIO_PROCESS, 0))  # this thread's (Linux)
        time.sleep(0.5)
        nice.append(os.getpriority(os.PRIO_PROCESS, 0))
        return slow(*a, **kw)

    monkeypatch.setattr(tensor_files, "write", slow_write)
    saver = ckpt.BackgroundSaver(tmp_path, rank=0, roles=ROLES, stage=stage, keep=0, timeout_s=10)
    saver.start(1, opt, info={})
    time.sleep(0.2)  # the writer is in its first file
    _update(stage, opt)  # the tensors change only after the files hold step 1's values
    assert saver.waited_s > 0.2
    base = os.getpriority(os.PRIO_PROCESS, 0)
    if ckpt._can_renice():  # written at the lowest priority until the update waits for it
        assert nice[0] == 19 and nice[1] == base
    else:
        assert set(nice) == {base}
    assert [p.name for p in saver.close() if p] == ["step_00000001"]
    saved = _saved(tmp_path, 1)
    assert all(torch.equal(saved[k], v) for k, v in before.items())
    assert not all(torch.equal(p, before[n]) for n, p in stage.named_parameters())
    _update(stage, opt)  # the hook is gone: nothing to wait for
    assert ckpt.complete_steps(tmp_path) == [1]


_KILLED = textwrap.dedent("""
    import sys, time, torch
    from pathlib import Path
    from torchpp.runtime import checkpoint as ckpt, tensor_files
    sys.path.insert(0, {tests!r})
    from test_checkpoint_fast import ROLES, _stage_and_optimizer, _update
    root = Path({root!r})
    stage, opt = _stage_and_optimizer()
    _update(stage, opt)
    ckpt.save(root, 1, rank=0, roles=ROLES, stage=stage, optimizer=opt, info={{}}, timeout_s=10, keep=1)
    real = tensor_files.write
    def stuck(path, *a, **kw):
        n = real(path, *a, **kw)
        Path(root, "writing").write_text(str(path))
        time.sleep(60)
    tensor_files.write = stuck
    _update(stage, opt)
    ckpt.BackgroundSaver(root, rank=0, roles=ROLES, stage=stage, keep=1, timeout_s=10).start(2, opt, info={{}})
    time.sleep(60)
""")


def test_a_write_killed_half_way_leaves_no_complete_step(tmp_path):
    root = tmp_path / "ck"
    code = _KILLED.format(tests=str(ROOT / "tests"), root=str(root))
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    p = subprocess.Popen([sys.executable, "-c", code], env=env, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while not (root / "writing").exists():
            assert p.poll() is None, p.stderr.read().decode()
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    # a whole file of step 2 was written under its temporary name, then the process died
    assert ".tmp" in (root / "writing").read_text() and ckpt.step_dir(root, 2).is_dir()
    assert ckpt.complete_steps(root) == [1]
    removed = ckpt.clean_leftovers(root)
    assert ckpt.step_dir(root, 2) in removed and ckpt.complete_steps(root) == [1]
    assert not list(root.rglob("*.tmp"))


def _update_seeded(stage, opt, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    for p in stage.parameters():
        p.grad = torch.randn(p.shape, generator=g)
    opt.step()


def test_a_resumed_run_writing_over_the_loaded_checkpoints_files_trains_on_unchanged(tmp_path):
    """The resumed optimizer state must not live in the loaded checkpoint's files (``safe_open``
    maps them): a later checkpoint overwrites them in place, and cuts them shorter (SIGBUS) when
    the new split's files are smaller. Overwritten at once, then recycled by per-step
    background checkpoints, the run still equals an uninterrupted one."""
    steps, resume_at = 7, 2
    ref, ref_opt = _stage_and_optimizer()
    for step in range(1, steps + 1):
        _update_seeded(ref, ref_opt, step)
    want = _live(ref, ref_opt)

    stage, opt = _stage_and_optimizer()
    for step in range(1, resume_at + 1):
        _update_seeded(stage, opt, step)
        ckpt.save(tmp_path, step, rank=0, roles=ROLES, stage=stage, optimizer=opt, info={}, timeout_s=10, keep=1)
    fresh, fresh_opt = _stage_and_optimizer()
    ckpt.load(tmp_path, resume_at, rank=0, stage=fresh, optimizer=fresh_opt)
    loaded = ckpt.step_dir(tmp_path, resume_at) / "optim-stage0.safetensors"
    loaded_ino = loaded.stat().st_ino
    # what recycling does to those pages, at once rather than steps later: same layout, other bytes
    tensor_files.write(tmp_path / "other.safetensors", {k: torch.zeros_like(v) for k, v in load_file(loaded).items()},
                       reuse=loaded)
    (tmp_path / "other.safetensors").rename(loaded)
    saver = ckpt.BackgroundSaver(tmp_path, rank=0, roles=ROLES, stage=fresh, keep=1, timeout_s=10)
    inodes = []
    for step in range(resume_at + 1, steps + 1):
        _update_seeded(fresh, fresh_opt, step)
        saver.start(step, fresh_opt, info={})
        saver.wait()
        inodes.append((ckpt.step_dir(tmp_path, step) / "optim-stage0.safetensors").stat().st_ino)
    saver.close()
    assert loaded_ino in inodes  # the loaded checkpoint's file was overwritten by a later one
    got = _live(fresh, fresh_opt)
    assert all(torch.equal(got[k], v) for k, v in want.items())
    saved = _saved(tmp_path, steps)
    assert all(torch.equal(saved[k], v) for k, v in want.items())


def test_every_file_is_on_the_disk_before_the_manifest_names_it(tmp_path, monkeypatch):
    """A power cut after the manifest must not find its files' data or names still in memory."""
    events: list[tuple[str, str]] = []
    real_fdatasync, real_fsync, real_write_json = os.fdatasync, os.fsync, ckpt.write_json

    def fdatasync(fd):
        events.append(("data", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fdatasync(fd)

    def fsync(fd):
        events.append(("sync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def write_json(path, data):
        events.append(("json", str(path)))
        return real_write_json(path, data)

    monkeypatch.setattr(os, "fdatasync", fdatasync)
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(ckpt, "write_json", write_json)
    stage, opt = _stage_and_optimizer()
    _update(stage, opt)
    d = ckpt.save(tmp_path, 1, rank=0, roles=ROLES, stage=stage, optimizer=opt, info={}, timeout_s=10, keep=1)
    manifest = next(i for i, (k, p) in enumerate(events) if k == "json" and p.endswith(ckpt.MANIFEST))
    before = events[:manifest]
    synced = {Path(p).name.split(".")[1] for k, p in before if k == "data"}  # ".<name>.<random>.tmp"
    assert {"model-stage0", "optim-stage0"} <= synced
    assert ("sync", str(d)) in before  # the renames
    assert events[manifest + 1:] == [("sync", str(d / ckpt.MANIFEST)), ("sync", str(d))]
