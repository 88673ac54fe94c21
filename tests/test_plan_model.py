"""The plan remembers its model: a local directory's path and config hash (torchpp.models.identity)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from torchpp.formats import FormatError, Plan
from torchpp.models.presets import ModelSpecError, build_model, config_hash, load_config, model_info
from torchpp.planner.simple import make_plan
from torchpp.runtime.launch import popen_ranks, wait_ranks
from torchpp.runtime.trainer import TrainConfig, prepare

ROOT = Path(__file__).resolve().parents[1]


def _save(directory: Path, **overrides) -> Path:
    cfg = load_config("qwen3-tiny")
    for k, v in overrides.items():
        setattr(cfg, k, v)
    build_model("qwen3-tiny", config=cfg).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {"mine": _save(root / "mine"), "other": _save(root / "other", rms_norm_eps=1e-5)}


def _plan(model: str, path: Path, stages: int = 1) -> Path:
    info = model_info(load_config(model), model)
    n = info.num_layers
    ranges = [(0, n)] if stages == 1 else [(0, n // 2), (n // 2, n)]
    make_plan(info, seq_len=16, global_batch=2, num_microbatches=2, layer_ranges=ranges, group_sizes=[1] * stages,
              schedule="1f1b").save(path)
    return path


def test_plan_records_path_and_config_hash_and_train_uses_them(models, tmp_path):
    plan = Plan.load(_plan(str(models["mine"]), tmp_path / "plan.json"))
    assert plan.model.path == str(models["mine"].resolve())
    assert plan.model.config_hash == config_hash(models["mine"]) and plan.model.config_hash.startswith("sha256:")
    assert prepare(TrainConfig(plan=tmp_path / "plan.json"), 1).model == str(models["mine"].resolve())


def test_a_copy_elsewhere_is_the_same_model_another_config_is_refused_by_name(models, tmp_path):
    _plan(str(models["mine"]), tmp_path / "plan.json")
    copy = shutil.copytree(models["mine"], tmp_path / "copy")
    cfg = json.loads((copy / "config.json").read_text())
    cfg["transformers_version"] = "0.0.0"  # saved by another version: still the same model
    (copy / "config.json").write_text(json.dumps(cfg))
    assert prepare(TrainConfig(plan=tmp_path / "plan.json", model=str(copy)), 1).model == str(copy)
    with pytest.raises(ModelSpecError, match=r"^--model .*other: expected the plan's model mine \(.*\), got other "
                                             r"\(config sha256:[0-9a-f]+\)"):
        prepare(TrainConfig(plan=tmp_path / "plan.json", model=str(models["other"])), 1)
    with pytest.raises(ModelSpecError, match="got preset qwen3-tiny"):
        prepare(TrainConfig(plan=tmp_path / "plan.json", model="qwen3-tiny"), 1)


def test_preset_plan_refuses_another_preset(tmp_path):
    _plan("qwen3-tiny", tmp_path / "plan.json")
    assert prepare(TrainConfig(plan=tmp_path / "plan.json"), 1).model == "qwen3-tiny"
    with pytest.raises(ModelSpecError, match="expected the plan's model qwen3-tiny .*got preset llama-tiny"):
        prepare(TrainConfig(plan=tmp_path / "plan.json", model="llama-tiny"), 1)


def test_older_plan_without_path_still_loads_and_asks_for_model(models, tmp_path):
    _plan(str(models["mine"]), tmp_path / "new.json")
    data = json.loads((tmp_path / "new.json").read_text())
    del data["model"]["path"], data["model"]["config_hash"]
    (tmp_path / "old.json").write_text(json.dumps(data))
    old = Plan.load(tmp_path / "old.json")
    assert old.model.path == "" and old.model.config_hash == ""
    with pytest.raises(FormatError, match=r"old.json: field 'model.path': expected a local checkpoint directory .*--model PATH"):
        prepare(TrainConfig(plan=tmp_path / "old.json"), 1)
    assert prepare(TrainConfig(plan=tmp_path / "old.json", model=str(models["other"])), 1).model == str(models["other"])
    data["model"]["config_hash"] = "md5:x"
    (tmp_path / "bad.json").write_text(json.dumps(data))
    with pytest.raises(FormatError, match="model.config_hash"):
        Plan.load(tmp_path / "bad.json")


def test_torchrun_without_model_trains_and_a_different_model_is_one_line_exit_2_on_every_rank(models, tmp_path):
    _plan(str(models["mine"]), tmp_path / "plan.json", stages=2)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torchpp.train", "--plan", str(tmp_path / "plan.json"), "--steps", "1", "--threads",
           "1", "--timeout-s", "60"]
    done = wait_ranks(popen_ranks(cmd, 2, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True),
                      timeout_s=240)
    assert [rc for rc, _, _ in done] == [0, 0], done
    bad = wait_ranks(popen_ranks(cmd + ["--model", str(models["other"])], 2, env=env, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.PIPE, text=True), timeout_s=120)
    assert [rc for rc, _, _ in bad] == [2, 2]
    for rank, (_, _, err) in enumerate(bad):
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"torchpp.train: rank {rank}: error: --model ")
        assert "expected the plan's model mine" in lines[0]
