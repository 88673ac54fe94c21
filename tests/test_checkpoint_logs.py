"""Gradient-log checkpoints: a step's checkpoint may be the gradients its update used, on top of
the step before. Resuming from one replays the logged updates on the chain's full checkpoint and
must give exactly the parameters and optimizer state the uninterrupted run had, under the same
split and under another one; a chain with a missing link is never resumed from, and pruning
never retires a link a kept checkpoint needs."""
from __future__ import annotations

import json
import shutil
import weakref
from pathlib import Path

import pytest
import torch

from dist_harness import run_cases
from test_runtime_failures import write_plan
from torchpp.models.stages import read_tensors
from torchpp.runtime import checkpoint as ckpt
from torchpp.runtime.trainer import TrainConfig


def _fake(root: Path, step: int, kind: str = ckpt.FULL, complete: bool = True) -> Path:
    d = ckpt.step_dir(root, step)
    d.mkdir(parents=True)
    name = "grads-stage0.safetensors" if kind == ckpt.GRADIENTS else "model-stage0.safetensors"
    (d / name).write_bytes(b"x")
    if complete:
        fmt = ckpt.LOG_FORMAT if kind == ckpt.GRADIENTS else ckpt.CKPT_FORMAT
        (d / ckpt.MANIFEST).write_text(json.dumps({"format": fmt, "kind": kind, "step": step, "files": [name]}))
    return d


def test_a_gradient_log_is_resumable_only_with_its_whole_chain(tmp_path):
    _fake(tmp_path, 1)
    for s in (2, 3):
        _fake(tmp_path, s, ckpt.GRADIENTS)
    _fake(tmp_path, 5, ckpt.GRADIENTS)  # step 4 is missing: 5 cannot be loaded
    _fake(tmp_path, 6, ckpt.GRADIENTS, complete=False)
    assert ckpt.complete_steps(tmp_path) == [1, 2, 3] and ckpt.latest_local(tmp_path) == 3
    shutil.rmtree(ckpt.step_dir(tmp_path, 2))
    assert ckpt.complete_steps(tmp_path) == [1]
    with pytest.raises(ckpt.CheckpointDamaged, match="no complete checkpoint chain ends at step 3"):
        ckpt.load(tmp_path, 3, rank=0, stage=None, optimizer=None)


def test_prune_keeps_every_link_the_kept_checkpoints_need(tmp_path):
    _fake(tmp_path, 1)
    _fake(tmp_path, 2, ckpt.GRADIENTS)
    _fake(tmp_path, 3)
    for s in (4, 5, 6):
        _fake(tmp_path, s, ckpt.GRADIENTS)
    # the newest two (5, 6) load from 3 through 4: only 1 and 2 go
    assert [p.name for p in ckpt.prune(tmp_path, 2)] == ["step_00000001", "step_00000002"]
    assert ckpt.complete_steps(tmp_path) == [3, 4, 5, 6]
    # retired files wait to be overwritten: up to recycle_keep copies of each name
    _fake(tmp_path, 7)
    _fake(tmp_path, 8, ckpt.GRADIENTS)
    assert [p.name for p in ckpt.prune(tmp_path, 2, recycle_keep=3)] == [f"step_0000000{s}" for s in (3, 4, 5, 6)]
    bin_ = sorted(p.name for p in (tmp_path / ckpt.RECYCLE).iterdir())
    # grads: 6, 5, 4 kept (3 copies), 2 dropped; model: 3 and 1 kept
    assert bin_ == ["step_00000001", "step_00000003", "step_00000004", "step_00000005", "step_00000006"]


def test_a_log_needs_a_checkpoint_every_step():
    with pytest.raises(ValueError, match="--full-checkpoint-every: gradient logs need a checkpoint every step"):
        TrainConfig(plan=Path("p.json"), steps=2, checkpoint_dir=Path("c"), checkpoint_every=2,
                    full_checkpoint_every=5)
    cfg = TrainConfig(plan=Path("p.json"), steps=2, checkpoint_dir=Path("c"), checkpoint_every=1)
    assert cfg.full_every == 10
    assert TrainConfig(plan=Path("p.json"), steps=2, checkpoint_dir=Path("c"), checkpoint_every=3).full_every == 1


def test_the_writer_frees_a_logs_gradients_before_the_next_backward(tmp_path):
    """The old gradients must not overlap the new ones: the step's peak memory stays the planner's."""
    from torchpp.runtime.optim import OptimSettings, SteppedOptimizer

    class Tiny(torch.nn.Linear):
        cfg = None

        def source_name(self, n: str) -> str:
            return n

    stage = Tiny(64, 64)
    opt = torch.optim.AdamW(stage.parameters(), lr=1e-3)
    stepper = SteppedOptimizer(opt, list(stage.parameters()), OptimSettings(), counts_stage=True, skip=None,
                               keep_grads=True)
    stage(torch.randn(2, 64)).sum().backward()
    stepper.step()
    stepper.zero_grad()
    kept = stepper.take_grads()
    refs = [weakref.ref(g) for g in kept.values()]
    roles = ckpt.Roles(stage=0, writes_stage=True, writes_manifest=True)
    saver = ckpt.BackgroundSaver(tmp_path, rank=0, roles=roles, stage=stage, keep=0, timeout_s=30)
    saver.start(2, opt, {}, grads=ckpt.gradient_snapshot(2, roles=roles, stage=stage, grads=kept, lrs=stepper.last_lrs))
    del kept
    saver.before_backward()
    assert all(r() is None for r in refs)
    saver.close()
    index = json.loads((ckpt.step_dir(tmp_path, 2) / ckpt.GRADS_INDEX).read_text())["weight_map"]
    assert set(index) == {"weight", "bias"}


# -- real runs: 2-stage qwen3-tiny, 5 steps, a full checkpoint every 4 (1 full, 2-3 logs, 4 full, 5 last)

STEPS, FULL = 5, 4


def _case(plan: Path, out: Path, ck: Path, world: int = 2, **kw) -> dict:
    return {"world_size": world, "result": str(out), "config": dict(
        plan=plan, threads=1, timeout_s=60.0, steps=STEPS, lr=1e-3, adam_eps=1e-6, seed=3, checkpoint_dir=ck,
        checkpoint_every=1, full_checkpoint_every=FULL, keep_checkpoints=0, **kw)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("logs")
    plan = write_plan(root / "plan.json")
    other = write_plan(root / "other.json", layers=((0, 1), (1, 3), (3, 4)), groups=(1, 1, 1))
    run_cases([_case(plan, root / "straight.json", root / "straight", checkpoint_background=True)],
              nprocs=3, workdir=root, timeout_s=300)
    for name in ("same", "other"):  # a run killed during step 4: the newest checkpoint is log 3
        shutil.copytree(root / "straight", root / name, ignore=shutil.ignore_patterns("final"))
        for s in (4, 5):
            shutil.rmtree(ckpt.step_dir(root / name, s))
    run_cases([_case(plan, root / "same.json", root / "same", resume=True),
               _case(other, root / "other.json", root / "other", world=3, resume=True, checkpoint_background=True)],
              nprocs=3, workdir=root, timeout_s=300)
    return root


def _state(d: Path) -> dict[str, torch.Tensor]:
    names = sorted(json.loads((d / "model.safetensors.index.json").read_text())["weight_map"])
    optim = json.loads((d / "optim.safetensors.index.json").read_text())["weight_map"]
    out = read_tensors(d, names)
    from safetensors.torch import load_file

    for f in set(optim.values()):
        out.update({f"optim:{k}": v for k, v in load_file(str(d / f)).items()})
    return out


def test_the_run_wrote_logs_between_full_checkpoints(runs):
    kinds = {s: json.loads((ckpt.step_dir(runs / "straight", s) / ckpt.MANIFEST).read_text())["kind"]
             for s in range(1, STEPS + 1)}
    assert kinds == {1: "full", 2: "gradients", 3: "gradients", 4: "full", 5: "full"}
    size = lambda s: sum(f.stat().st_size for f in ckpt.step_dir(runs / "straight", s).glob("*.safetensors"))  # noqa: E731
    assert size(2) < 0.4 * size(1)  # parameters and both AdamW moments against the gradients
    log = json.loads((ckpt.step_dir(runs / "straight", 3) / ckpt.MANIFEST).read_text())
    assert log["after"] == 2 and log["lrs"] == [1e-3] and log["format"] == ckpt.LOG_FORMAT


def test_resuming_from_a_log_replays_the_updates_exactly(runs):
    assert json.loads((runs / "same.json").read_text())["start"] == 3
    a, b = _state(ckpt.step_dir(runs / "same", STEPS)), _state(ckpt.step_dir(runs / "straight", STEPS))
    assert a.keys() == b.keys() and len(a) > 10
    assert [k for k in a if not torch.equal(a[k], b[k])] == []
    assert json.loads((runs / "same.json").read_text())["losses"] == json.loads(
        (runs / "straight.json").read_text())["losses"][3:]


def test_resuming_from_a_log_under_another_split_gives_the_same_training(runs):
    assert json.loads((runs / "other.json").read_text())["start"] == 3
    a, b = _state(ckpt.step_dir(runs / "other", STEPS)), _state(ckpt.step_dir(runs / "straight", STEPS))
    params = [k for k in b if not k.startswith("optim:")]
    worst = max((float((a[k] - b[k]).abs().max()), k) for k in params)
    assert worst[0] < 1e-5, worst
    assert json.loads((runs / "other.json").read_text())["losses"] == pytest.approx(
        json.loads((runs / "straight.json").read_text())["losses"][3:], abs=1e-5)
