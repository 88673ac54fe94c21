"""A model directory's own code is never run: `profile`, `calibrate-memory`, `plan` and
`torchpp.train --model DIR` refuse a directory that would need it, in one line, without a prompt."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from torchpp.models.presets import ModelSpecError, load_config
from torchpp.planner.synthetic import layers_file

ROOT = Path(__file__).resolve().parents[1]
_CONFIG = {"model_type": "qwen3", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
           "tie_word_embeddings": True}


def _hostile_dir(root: Path, marker: Path, **config) -> Path:
    """A checkpoint whose config asks transformers to import its own modules, which leave a marker."""
    d = root / "model"
    d.mkdir()
    conf = dict(_CONFIG, auto_map={"AutoConfig": "configuration_evil.EvilConfig",
                                   "AutoModelForCausalLM": "modeling_evil.EvilModel"}, **config)
    (d / "config.json").write_text(json.dumps(conf))
    for name in ("configuration_evil.py", "modeling_evil.py"):
        (d / name).write_text(f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n")
    return d


def _env() -> dict[str, str]:
    return dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
                HF_MODULES_CACHE=os.environ.get("HF_MODULES_CACHE", "/nonexistent/hf_modules"),
                PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))


_COMMANDS = """
import json, sys
from torchpp.cli import main
model, layers, out = sys.argv[1:4]
codes = {
    "profile": main(["profile", "--model", model, "--out", out + "/layers.json", "--iters", "1", "--warmup", "0",
                    "--no-call-probe"]),
    "calibrate-memory": main(["calibrate-memory", "--layers", layers, "--model", model, "--samples", "3",
                              "--out", out + "/mm.json"]),
    "plan": main(["plan", "--strategy", "even", "--model", model, "--hosts", "a,b", "--global-batch", "4",
                  "--microbatches", "2", "--seq-len", "16", "--out", out + "/plan.json"]),
}
print(json.dumps(codes))
"""


def test_commands_refuse_auto_map_without_running_or_asking(tmp_path):
    marker = tmp_path / "MARKER"
    model = _hostile_dir(tmp_path, marker)
    lf = layers_file("local", num_layers=4, layer_param_bytes=4 * 50_000, embed_param_bytes=4 * 32_768,
                     tail_param_bytes=4 * 32_832, act_bytes_per_sample=16 * 64 * 4, seq_len=16)
    lf.save(tmp_path / "layers_local.json")
    out = tmp_path / "out"
    out.mkdir()
    proc = subprocess.run([sys.executable, "-c", _COMMANDS, str(model), str(tmp_path / "layers_local.json"), str(out)],
                          env=_env(), cwd=ROOT, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    codes = json.loads(proc.stdout.strip().splitlines()[-1])
    assert all(c == 2 for c in codes.values()), (codes, proc.stderr[-3000:])
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 3, proc.stderr[-3000:]
    for cmd, line in zip(codes, lines):
        assert line.startswith(f"torchpp {cmd}: error: {model / 'config.json'}: refused: 'auto_map'"), line
    assert "[y/N]" not in proc.stdout + proc.stderr
    assert not marker.exists() and not any(out.iterdir())


def test_train_refuses_auto_map_without_running_or_asking(tmp_path):
    from test_runtime_failures import write_plan

    marker = tmp_path / "MARKER"
    model = _hostile_dir(tmp_path, marker)
    plan = write_plan(tmp_path / "plan.json", layers=((0, 4),), groups=(1,))
    env = {k: v for k, v in _env().items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    proc = subprocess.run([sys.executable, "-m", "torchpp.train", "--plan", str(plan), "--model", str(model),
                           "--steps", "1", "--threads", "1", "--checkpoint-dir", str(tmp_path / "ckpt")],
                          env=env, cwd=ROOT, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=180)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith(
        f"torchpp.train: rank 0: error: {model / 'config.json'}: refused: 'auto_map'"), proc.stderr[-3000:]
    assert "[y/N]" not in proc.stdout + proc.stderr
    assert not marker.exists() and not (tmp_path / "ckpt").exists()


def _write(tmp_path: Path, name: str, text: str) -> Path:
    d = tmp_path / "m"
    d.mkdir(exist_ok=True)
    (d / name).write_text(text)
    return d


@pytest.mark.parametrize("case,expect", [
    ("unknown_type", "refused: model_type 'my_own_arch' is not an architecture"),
    ("no_type", "refused: model_type None is not an architecture"),
    ("not_json", "expected a JSON object"),
    ("list", "expected a JSON object, got list"),
    ("tokenizer_auto_map", "tokenizer_config.json: refused: 'auto_map'"),
])
def test_load_config_refuses_what_would_need_the_directory_code(tmp_path, case, expect):
    conf = {"unknown_type": dict(_CONFIG, model_type="my_own_arch"),
            "no_type": {k: v for k, v in _CONFIG.items() if k != "model_type"}}.get(case, _CONFIG)
    text = {"not_json": "{model_type: qwen3", "list": "[1, 2]"}.get(case, json.dumps(conf))
    d = _write(tmp_path, "config.json", text)
    if case == "tokenizer_auto_map":
        _write(tmp_path, "tokenizer_config.json", json.dumps({"auto_map": {"AutoTokenizer": ["tok_evil.T", None]}}))
    with pytest.raises(ModelSpecError, match=expect.replace("(", r"\(")):
        load_config(str(d))


def test_load_config_accepts_a_plain_checkpoint(tmp_path):
    d = _write(tmp_path, "config.json", json.dumps(_CONFIG))
    assert load_config(str(d)).num_hidden_layers == 4
