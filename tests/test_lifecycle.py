"""Ranks die with their launcher: whatever ends torchrun or `torchpp run --elastic` (SIGTERM,
SIGKILL, SIGINT), no rank outlives it by more than --timeout-s; a foreign program holding the
rendezvous port is one line on every rank within --timeout-s, not a wait without end."""
from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from test_elastic import measurements
from test_runtime_failures import ROOT, _env, write_plan
from torchpp.models.presets import load_config, model_info
from torchpp.planner.simple import make_plan
from torchpp.runtime.launch import free_port, popen_ranks, wait_ranks

TIMEOUT_S = 60  # also the ranks' wait to join: imports of a loaded 2-core machine take tens of seconds


def _stepped(log_dir: Path) -> bool:
    try:
        return '"step"' in (log_dir / "metrics.jsonl").read_text()
    except OSError:
        return False


def _alive(p: psutil.Process) -> bool:
    """Running: an orphan that has exited but is not reaped yet (a zombie) is not."""
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _ranks_of(launcher: psutil.Process) -> list[psutil.Process]:
    return [p for p in launcher.children(recursive=True) if "torchpp.train" in " ".join(p.cmdline())]


def _as_from_a_terminal() -> None:
    """SIGINT acts as Ctrl-C would, even when the test runs in the background (where a shell starts
    jobs with SIGINT ignored, and Python then never turns it into KeyboardInterrupt)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _kill_and_look_for_survivors(cmd: list[str], logs: Path, sig: int, tmp_path: Path) -> None:
    with open(tmp_path / "launcher.log", "w") as out:
        launcher = subprocess.Popen(cmd, env=_env(), cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, preexec_fn=_as_from_a_terminal)
    try:
        deadline = time.monotonic() + 600  # the first step: imports and setup under load
        while not _stepped(logs) and time.monotonic() < deadline and launcher.poll() is None:
            time.sleep(0.3)
        assert _stepped(logs), (tmp_path / "launcher.log").read_text()[-3000:]
        ranks = _ranks_of(psutil.Process(launcher.pid))
        assert len(ranks) == 2, ranks
        launcher.send_signal(sig)
        launcher.wait(60)
        deadline = time.monotonic() + TIMEOUT_S + 30
        while (alive := [p for p in ranks if _alive(p)]) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not alive, f"ranks {[p.pid for p in alive]} outlived their launcher"
    finally:
        if launcher.poll() is None:
            launcher.kill()


def _train_args(plan: Path, logs: Path) -> list[str]:
    return ["--plan", str(plan), "--steps", "100000", "--threads", "1", "--timeout-s", str(TIMEOUT_S),
            "--log-dir", str(logs)]


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT])
def test_ranks_die_with_torchrun(tmp_path, sig):
    plan = write_plan(tmp_path / "plan.json")
    logs = tmp_path / "logs"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           "-m", "torchpp.train", *_train_args(plan, logs), "--no-output"]
    _kill_and_look_for_survivors(cmd, logs, sig, tmp_path)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT])
def test_ranks_die_with_the_torchpp_run_driver(tmp_path, sig):
    """`torchpp run --elastic`, with the measurement files its re-planning needs."""
    meas = measurements(tmp_path)
    info = model_info(load_config("qwen3-tiny"), "qwen3-tiny")
    plan = tmp_path / "plan.json"
    make_plan(info, seq_len=16, global_batch=4, num_microbatches=2, layer_ranges=[(0, 2), (2, 4)], group_sizes=[1, 1],
              hosts=["h0", "h1"]).save(plan)
    logs = tmp_path / "logs"
    cmd = [sys.executable, "-m", "torchpp.cli", "run", "--elastic", "--plan", str(plan), "--layers",
           *map(str, meas["layers"]), "--devices", str(meas["devices"]), "--bandwidth", str(meas["bandwidth"]),
           "--checkpoint-dir", str(tmp_path / "ck"), "--work-dir", str(tmp_path / "work"), "--timeout-s",
           str(TIMEOUT_S), "--startup-s", "300", "--", "--steps", "100000", "--threads", "1", "--log-dir", str(logs)]
    _kill_and_look_for_survivors(cmd, logs, sig, tmp_path)


def test_a_foreign_program_on_the_rendezvous_port_is_one_line_on_every_rank(tmp_path):
    plan = write_plan(tmp_path / "plan.json")
    foreign = socket.socket()
    foreign.bind(("127.0.0.1", 0))
    foreign.listen(16)  # accepts connections, never answers
    port = foreign.getsockname()[1]
    try:
        procs = popen_ranks([sys.executable, "-m", "torchpp.train", "--plan", str(plan), "--steps", "1", "--threads",
                             "1", "--timeout-s", str(TIMEOUT_S), "--no-output"], 2,
                            env=_env(), per_rank=lambda r: {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)},
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        results = wait_ranks(procs, timeout_s=600)  # imports alone take minutes on a loaded 2-core machine
    finally:
        foreign.close()
    for rank, (code, _, err) in enumerate(results):
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert code != 0 and len(lines) == 1 and f"rank {rank}" in lines[0], err[-3000:]
