"""A damaged checkpoint is found, never trained on: a flipped byte or a cut file is reported in
one line and the newest intact checkpoint is used (the run then equals one never interrupted);
a full disk during a write is one line on every rank with the partial step removed; indexes
that name files outside their folder are refused."""
from __future__ import annotations

import errno
import json
import shutil
from pathlib import Path

import pytest
import torch

from test_runtime_failures import write_plan
from torchpp.models.presets import ModelSpecError
from torchpp.models.stages import read_tensors, safetensors_index
from torchpp.runtime import checkpoint as ckpt
from torchpp.runtime import tensor_files
from torchpp.runtime.launch import RankPool


def test_verify_finds_a_flipped_byte_and_a_cut_file(tmp_path):
    f = tmp_path / "a.safetensors"
    want = tensor_files.write(f, {"w": torch.randn(1000)})
    tensor_files.verify(f, want)
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x01
    f.write_bytes(bytes(data))
    with pytest.raises(tensor_files.DamagedFileError, match="do not match the manifest's digest"):
        tensor_files.verify(f, want)
    f.write_bytes(bytes(data[:100]))
    with pytest.raises(tensor_files.DamagedFileError, match=f"100 bytes, the manifest says {want.size}"):
        tensor_files.verify(f, want)


def test_a_model_index_may_only_name_files_inside_its_folder(tmp_path):
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"w": "../../outside/x.safetensors"}}))
    with pytest.raises(ModelSpecError, match=r"field 'weight_map.w': expected a file inside .*'../../outside"):
        safetensors_index(tmp_path)


def _train(rank: int, world: int, config: dict, fail_write_at: int | None = None) -> dict:
    """Train on this rank; with ``fail_write_at``, rank 1's tensor writes of that step fail as on
    a full disk. Returns the start step, or the error line."""
    from torchpp.runtime.exchange import DisagreementError
    from torchpp.runtime.trainer import TrainConfig, train

    real = tensor_files.write
    if fail_write_at is not None and rank == 1:
        def full(path, tensors, *a, **kw):
            if f"step_{fail_write_at:08d}" in str(path):
                raise OSError(errno.ENOSPC, "No space left on device")
            return real(path, tensors, *a, **kw)
        tensor_files.write = full
    try:
        return {"start": train(TrainConfig(**config)).start_step}
    except DisagreementError as e:
        return {"error": str(e)}
    finally:
        tensor_files.write = real


def _weights(ck: Path, step: int) -> dict[str, torch.Tensor]:
    d = ckpt.step_dir(ck, step)
    return read_tensors(d, sorted(safetensors_index(d)))


def _notes(log_dir: Path) -> list[str]:
    events = [json.loads(x) for x in (log_dir / "metrics.jsonl").read_text().splitlines()]
    return [e["message"] for e in events if e.get("event") == "note"]


def test_damage_is_reported_and_the_newest_intact_checkpoint_resumed(tmp_path):
    plan = write_plan(tmp_path / "plan.json")
    ref, ck = tmp_path / "ref", tmp_path / "ck"

    def cfg(steps: int, root: Path, **kw) -> dict:
        return dict(plan=plan, threads=1, timeout_s=60.0, steps=steps, checkpoint_dir=root, checkpoint_every=1,
                    full_checkpoint_every=1, keep_checkpoints=0, **kw)

    with RankPool(2, threads=1) as pool:
        run = lambda config, **kw: pool.run(_train, config, timeout_s=300, pg_timeout_s=60, **kw)  # noqa: E731
        run(cfg(8, ref))  # never interrupted
        assert run(cfg(4, ck))[0] == {"start": 0}
        # one flipped bit in the last stage's weights of the newest checkpoint
        f = ckpt.step_dir(ck, 4) / "model-stage1.safetensors"
        data = bytearray(f.read_bytes())
        data[-7] ^= 0x10
        f.write_bytes(bytes(data))
        logs = tmp_path / "logs1"
        assert run(cfg(6, ck, resume=True, log_dir=logs)) == [{"start": 3}] * 2
        notes = _notes(logs)
        assert len(notes) == 1 and "step_00000004 is damaged: rank 1: " in notes[0] \
            and "model-stage1.safetensors: its bytes do not match the manifest's digest" in notes[0], notes
        assert (ck / "step_00000004.damaged").is_dir()
        # a cut file (of rank 0's optimizer state) in the newest: the one before is used
        f = ckpt.step_dir(ck, 6) / "optim-stage0.safetensors"
        f.write_bytes(f.read_bytes()[:f.stat().st_size // 2])
        logs = tmp_path / "logs2"
        assert run(cfg(7, ck, resume=True, log_dir=logs)) == [{"start": 5}] * 2
        assert "the manifest says" in _notes(logs)[0] and "rank 0: " in _notes(logs)[0]
        # a full disk while rank 1 writes step 8: one line on every rank, the partial step removed
        out = run(cfg(8, ck, resume=True), fail_write_at=8)
        assert out[0] == out[1] and out[0]["error"].startswith(f"--checkpoint-dir {ck}: writing checkpoint step 8 "
                                                               "failed on rank 1 at model-stage1.safetensors: No "
                                                               "space left on device"), out
        assert "the partial step_00000008 was removed, the newest complete checkpoint is step 7" in out[0]["error"]
        assert not ckpt.step_dir(ck, 8).exists() and ckpt.latest_local(ck) == 7
        assert run(cfg(8, ck, resume=True)) == [{"start": 7}] * 2
    want, got = _weights(ref, 8), _weights(ck, 8)
    assert set(want) == set(got) and all(torch.equal(want[k], got[k]) for k in want)


def test_no_intact_checkpoint_is_one_error_on_every_rank(tmp_path):
    plan = write_plan(tmp_path / "plan.json")
    ck = tmp_path / "ck"
    config = dict(plan=plan, threads=1, timeout_s=60.0, steps=1, checkpoint_dir=ck)
    with RankPool(2, threads=1) as pool:
        pool.run(_train, config, timeout_s=300, pg_timeout_s=60)
        index = ckpt.step_dir(ck, 1) / "model.safetensors.index.json"
        data = json.loads(index.read_text())
        data["weight_map"] = {k: "../../elsewhere.safetensors" for k in data["weight_map"]}
        index.write_text(json.dumps(data))
        out = pool.run(_train, {**config, "steps": 2, "resume": True}, timeout_s=300, pg_timeout_s=60)
    assert out[0] == out[1] and out[0]["error"].startswith(f"--checkpoint-dir {ck}: no intact checkpoint to resume "
                                                           "from ("), out
    assert "model.safetensors.index.json" in out[0]["error"]


def test_outputs_are_never_written_through_a_symbolic_link(tmp_path, capsys):
    from test_analyze import events, write_trace
    from torchpp.cli import main
    from torchpp.validate import open_output

    (tmp_path / "tr").mkdir()
    write_trace(tmp_path / "tr" / "timeline_step1_all.json", events([1.0, 1.5], [2.0, 3.0], 4))
    victim = tmp_path / "victim.txt"
    victim.write_text("mine\n")
    (tmp_path / "rep").mkdir()
    (tmp_path / "rep" / "report.md").symlink_to(victim)
    assert main(["analyze", str(tmp_path / "tr"), "--out", str(tmp_path / "rep")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "report.md' is a symbolic link" in err[0], err
    assert victim.read_text() == "mine\n" and not (tmp_path / "rep" / "report.json").exists()
    (tmp_path / "metrics.jsonl").symlink_to(victim)
    with pytest.raises(ValueError, match="is a symbolic link"):
        open_output(tmp_path / "metrics.jsonl", "a")
    assert victim.read_text() == "mine\n"
