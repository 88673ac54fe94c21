"""A model directory whose config.json has a size that is no positive integer is refused in one
line naming the file and field (``num_hidden_layers: -1`` was a 20-line transformers traceback)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
CONFIG = {"model_type": "qwen3", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512, "max_position_embeddings": 256}


def _cli(*argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "torchpp.cli", *argv], capture_output=True, text=True, env=env,
                          timeout=600)


@pytest.mark.parametrize("field,value", [("num_hidden_layers", -1), ("num_hidden_layers", 0), ("hidden_size", "64")])
def test_profile_and_estimate_refuse_a_bad_size(tmp_path, field, value):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({**CONFIG, "num_hidden_layers": 2, field: value}))
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"devices": {"a": {"flops": 1e9, "memory_gb": 1}}, "link_gbps": 1}))
    for argv in (["profile", "--model", str(model), "--out", str(tmp_path / "l.json")],
                 ["plan", "--estimate", "--model", str(model), "--device-spec", str(spec), "--out-dir", str(tmp_path / "p")]):
        r = _cli(*argv)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1, r.stderr[-2000:]
        assert str(model / "config.json") in lines[0] and f"'{field}'" in lines[0] and "integer >= 1" in lines[0]


def test_profile_refuses_pickled_weights_in_one_line(tmp_path):
    """A ``pytorch_model.bin`` that is a pickle (not weights-only tensors) was refused with a
    33-41-line traceback."""
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({**CONFIG, "num_hidden_layers": 2}))
    (model / "pytorch_model.bin").write_bytes(b"\x80\x04\x95" + bytes(range(256)) * 4)
    r = _cli("profile", "--model", str(model), "--out", str(tmp_path / "l.json"))
    errors = [ln for ln in r.stderr.splitlines() if ": error: " in ln]  # the call probe's progress line precedes it
    assert r.returncode == 2 and len(errors) == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert str(model) in errors[0] and "weights-only" in errors[0]


def test_calibrate_memory_refuses_pickled_weights_in_one_line(tmp_path):
    """`calibrate-memory` builds its spans from the same checkpoint, in fresh processes: a pickled
    ``pytorch_model.bin`` is refused in one line before any span runs, not in a span's traceback."""
    from torchpp.planner.synthetic import layers_file

    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({**CONFIG, "num_hidden_layers": 2}))
    (model / "pytorch_model.bin").write_bytes(b"\x80\x04\x95" + bytes(range(256)) * 4)
    lf = layers_file("local", num_layers=2, layer_param_bytes=4 * 50_000, embed_param_bytes=4 * 32_768,
                     tail_param_bytes=4 * 32_768, act_bytes_per_sample=32 * 64 * 4, seq_len=32)
    lf.save(tmp_path / "layers_local.json")
    r = _cli("calibrate-memory", "--layers", str(tmp_path / "layers_local.json"), "--model", str(model),
             "--samples", "3", "--out", str(tmp_path / "mm.json"))
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert lines[0].startswith("torchpp calibrate-memory: error: ") and str(model) in lines[0], lines[0]
    assert "weights-only" in lines[0] and "span" not in r.stdout, (lines[0], r.stdout)
    assert not (tmp_path / "mm.json").exists()
