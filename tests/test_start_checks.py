"""Every rank agrees before the first collective: a bad option, data file, output directory or
checkpoint gives one line on every rank and exit 2, under torchrun as under `torchpp run`; never
"peer closed", and never a rank killed by torchrun before it said why."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from test_runtime_failures import ROOT, _env, write_plan
from torchpp.runtime.launch import free_port, popen_ranks, wait_ranks

RANK_LINE = re.compile(r"^torchpp\.train: rank (\d+): error: (.*)$")


def _torchrun(args: list[str], timeout_s: float = 600) -> str:
    """torchrun with 2 ranks of `torchpp.train`; its output (the ranks' lines included)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           "-m", "torchpp.train", *args, "--threads", "1", "--timeout-s", "120"]
    res = subprocess.run(cmd, env=_env(), cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, timeout=timeout_s)
    assert res.returncode != 0, res.stdout[-3000:]
    return res.stdout


def _one_line_each_and_exit_2(out: str, expect: str) -> None:
    lines = [m.groups() for m in map(RANK_LINE.match, out.splitlines()) if m]
    assert sorted(r for r, _ in lines) == ["0", "1"], out[-4000:]
    assert all(expect in text for _, text in lines), out[-4000:]
    assert "peer closed" not in out, out[-4000:]
    assert out.count("Traceback") == out.count("raise ChildFailedError") == 1, out[-4000:]  # torchrun's own report
    # torchrun's report: both ranks exited 2 themselves (none was stopped by torchrun's SIGTERM)
    assert out.count("exitcode  : 2 ") == 2 and "Signal 15" not in out, out[-4000:]


@pytest.fixture(scope="module")
def plan(tmp_path_factory) -> Path:
    return write_plan(tmp_path_factory.mktemp("plan") / "plan.json")


@pytest.mark.parametrize("case", ["eval-fraction", "empty-data", "binary-data", "log-dir", "trace-dir", "export-dir"])
def test_a_bad_option_or_file_is_one_line_on_every_rank_under_torchrun(tmp_path, plan, case):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "binary.txt").write_bytes(b"caf\xe9\xff\xfe\x00\x01 not text" * 10)
    args, expect = {
        "eval-fraction": (["--eval-fraction", "2"], "--eval-fraction: expected a fraction"),
        "empty-data": (["--data", str(tmp_path / "empty.txt"), "--tokenizer", "bytes", "--data-cache",
                        str(tmp_path / "cache")], "0 tokens, expected at least seq_len=16"),
        "binary-data": (["--data", str(tmp_path / "binary.txt"), "--tokenizer", "bytes", "--data-cache",
                         str(tmp_path / "cache")], "not UTF-8 text"),
        "log-dir": (["--log-dir", str(blocker / "logs")], "--log-dir"),
        "trace-dir": (["--trace-dir", str(blocker / "traces")], "--trace-dir"),
        "export-dir": (["--export-dir", str(blocker / "model")], "--export-dir"),
    }[case]
    out = _torchrun(["--plan", str(plan), "--steps", "2", "--no-output", *args])
    _one_line_each_and_exit_2(out, expect)
    assert "step 1" not in out, out[-3000:]


def test_resuming_another_models_checkpoint_is_one_line_on_every_rank_under_torchrun(tmp_path):
    ck = tmp_path / "ck"
    llama = write_plan(tmp_path / "llama.json", model="llama-tiny")
    made = wait_ranks(popen_ranks([sys.executable, "-m", "torchpp.train", "--plan", str(llama), "--model",
                                   "llama-tiny", "--steps", "1", "--threads", "1", "--timeout-s", "120",
                                   "--checkpoint-dir", str(ck)], 2, env=_env(), cwd=ROOT,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True), timeout_s=600)
    assert all(code == 0 for code, _, _ in made), made[0][2][-3000:]
    tiny = write_plan(tmp_path / "tiny.json")
    out = _torchrun(["--plan", str(tiny), "--steps", "2", "--checkpoint-dir", str(ck), "--resume",
                     "--accept-changes"])
    _one_line_each_and_exit_2(out, "step 1 holds another model (")


def test_a_rank_that_fails_alone_is_named_on_every_rank(tmp_path, plan):
    """Only rank 1 fails its own checks (a bad host name in its environment): rank 0, which would
    otherwise wait in its first collective, hears why before it and exits 2 with one line."""
    procs = popen_ranks([sys.executable, "-m", "torchpp.train", "--plan", str(plan), "--steps", "2", "--threads", "1",
                         "--timeout-s", "300", "--no-output"], 2, env=_env(),
                        per_rank=lambda r: {"TORCHPP_HOST": "bad host/name"} if r == 1 else {},
                        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    results = wait_ranks(procs, timeout_s=280)  # within the peers' --timeout-s: no rank waited for it
    lines = []
    for rank, (code, _, err) in enumerate(results):
        ours = [ln for ln in err.splitlines() if ln.strip()]
        assert code == 2 and len(ours) == 1 and ours[0].startswith(f"torchpp.train: rank {rank}: error: "), err[-3000:]
        lines.append(ours[0])
    assert "TORCHPP_HOST" in lines[1], lines
    assert lines[0] == "torchpp.train: rank 0: error: rank 1: " + lines[1].split(": error: ", 1)[1], lines
