"""README's "Train your own model on your own data": its commands, copied out of README.md as
they are, run one after another on a tiny Llama-architecture model directory and a byte-level
BPE tokenizer built here, on text from this repository; then the corpus, the trained model with
its tokenizer and the resumed run are checked."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tiny_hf import ROOT, TEXT, tiny_llama

SECTION = "## Train your own model on your own data"


def commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    body = text[text.index(SECTION):]
    body = body[:body.index("\n## ", len(SECTION))]
    block = re.search(r"```bash\n(.*?)```", body, re.S).group(1)
    return [ln for ln in block.splitlines() if ln.strip()]


def test_the_section_sits_right_after_the_fresh_machine_commands():
    text = (ROOT / "README.md").read_text()
    assert text.index("\n## ", text.index("bash launch/test.sh")) + 1 == text.index(SECTION)  # the first section


@pytest.mark.timeout(1800)  # a profile, a plan and two training runs, each a fresh process
def test_every_command_of_the_section_runs(tmp_path):
    cmds = commands()
    assert cmds[0].startswith("MODEL=my-model DATA=my-texts")
    assert any(c.startswith("torchpp data prepare") for c in cmds) and any("--resume" in c for c in cmds)
    tiny_llama(tmp_path / "my-model", vocab_size=400)
    (tmp_path / "my-texts").mkdir()
    (tmp_path / "my-texts" / "a.txt").write_text(TEXT.read_text())
    (tmp_path / "my-texts" / "b.md").write_text((ROOT / "README.md").read_text())
    shim = tmp_path / "bin"
    shim.mkdir()
    (shim / "torchpp").write_text(f'#!/bin/sh\nexec {sys.executable} -m torchpp.cli "$@"\n')
    (shim / "torchpp").chmod(0o755)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "TORCHPP_CACHE": str(tmp_path / "cache"),
           "PATH": f"{shim}:{Path(sys.executable).parent}:{os.environ['PATH']}"}
    script = "set -e\n" + "\n".join(cmds) + "\n"
    res = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1500)
    assert res.returncode == 0, (res.stdout[-3000:], res.stderr[-3000:])
    index = json.loads((tmp_path / "corpus" / "index.json").read_text())
    assert index["format"] == "torchpp.tokens/1" and index["documents"] == 2 and index["tokenizer"]["name"] == "my-model"
    assert "documents" in res.stdout and "epoch" in res.stdout  # the start-up line
    assert (tmp_path / "ckpt" / f"step_{40:08d}").is_dir() and "resumed from" in res.stdout
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tmp_path / "ckpt" / "final"))
    assert tok("pipeline")["input_ids"] == AutoTokenizer.from_pretrained(str(tmp_path / "my-model"))("pipeline")["input_ids"]
