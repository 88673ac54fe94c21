"""What keeps the demo's local runs light: ranks started as torchrun starts them on one node, without
its agent (`python -m torchpp.runtime.local_cli`), a preset's model fields read without building it,
and the benchmarks' quick sizes probing the runtime's call cost in a few steps."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[1]
LAUNCH = [sys.executable, "-m", "torchpp.runtime.local_cli"]
RANK = """
import os, sys, time
from pathlib import Path
e = os.environ
Path(sys.argv[1], "rank" + e["RANK"]).write_text(str(os.getpid()))
# one write per line: under PYTHONUNBUFFERED, print() writes each piece apart and two ranks' pieces mix
os.write(1, (" ".join(str(e.get(k)) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                                             "HOST", "OMP_NUM_THREADS", "TORCHELASTIC_RESTART_COUNT")) + "\\n").encode())
while e.get("AFTER_" + e["RANK"]) and not Path(sys.argv[1], e["AFTER_" + e["RANK"]]).exists():
    time.sleep(0.05)
time.sleep(float(e.get("NAP_" + e["RANK"], "0")))
sys.exit(int(e.get("EXIT_" + e["RANK"], "0")))
"""


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    return {**env, "PYTHONPATH": str(ROOT), **extra}


def _gone(pids: list[int], within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids):
            return True
        time.sleep(0.1)
    return False


def _pids(d: Path, n: int, within_s: float = 60) -> list[int]:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        files = [d / f"rank{r}" for r in range(n)]
        if all(f.exists() and f.read_text() for f in files):
            return [int(f.read_text()) for f in files]
        time.sleep(0.05)
    raise AssertionError(f"ranks did not start: {list(d.iterdir())}")


def test_every_rank_gets_torchruns_variables_and_the_launchers_output(tmp_path):
    r = subprocess.run([*LAUNCH, "--nproc-per-node", "2", "--host-prefix", "local", "--", sys.executable, "-c", RANK,
                        str(tmp_path)], env=_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    rows = sorted(line.split() for line in r.stdout.splitlines())
    assert [x[:4] for x in rows] == [["0", "2", "0", "127.0.0.1"], ["1", "2", "1", "127.0.0.1"]]
    assert rows[0][4] == rows[1][4] and 0 < int(rows[0][4]) < 65536  # one rendezvous port
    assert [x[5:] for x in rows] == [["local0", "1", "0"], ["local1", "1", "0"]]  # OMP_NUM_THREADS=1 as torchrun's


def test_a_failed_rank_stops_the_others_and_gives_its_exit_code(tmp_path):
    t0 = time.monotonic()
    r = subprocess.run([*LAUNCH, "--nproc-per-node", "2", "--", sys.executable, "-c", RANK, str(tmp_path)],
                       env=_env(NAP_0="600", AFTER_1="rank0", EXIT_1="3"), capture_output=True, text=True, timeout=120)
    assert r.returncode == 3, (r.stdout, r.stderr)
    assert r.stderr.strip().splitlines() == [
        "python -m torchpp.runtime.local_cli: rank 1 exited with code 3; the other ranks were stopped"]
    assert time.monotonic() - t0 < 60 and _gone(_pids(tmp_path, 2), 5)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["TERM", "KILL"])
def test_no_rank_outlives_the_launcher(tmp_path, sig):
    """TERM: the ranks are stopped and the exit code says by what; KILL: each rank's parent-death signal."""
    proc = subprocess.Popen([*LAUNCH, "--nproc-per-node", "2", "--", sys.executable, "-c", RANK, str(tmp_path)],
                            env=_env(NAP_0="600", NAP_1="600"), stdout=subprocess.DEVNULL)
    try:
        pids = _pids(tmp_path, 2)
        proc.send_signal(sig)
        code = proc.wait(timeout=60)
        assert code == (128 + signal.SIGTERM if sig == signal.SIGTERM else -signal.SIGKILL)
        assert _gone(pids, 10), [psutil.Process(p).cmdline() for p in pids if psutil.pid_exists(p)]
    finally:
        if proc.poll() is None:
            proc.kill()


def test_bad_options_are_one_line(tmp_path):
    for argv, want in ((["--nproc-per-node", "0", "--", "true"], "--nproc-per-node: expected 1..64, got 0"),
                       (["--nproc-per-node", "2"], "expected -- COMMAND")):
        r = subprocess.run([*LAUNCH, *argv], env=_env(), capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and want in r.stderr.strip().splitlines()[-1], r.stderr


def test_the_launcher_imports_no_torch():
    code = "import sys, torchpp.runtime.local_cli, torchpp.runtime.launch; print('torch' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=60)
    assert r.stdout.strip() == "False", r.stderr


def test_a_presets_fields_read_off_its_table_equal_its_configs():
    from torchpp.models.presets import PRESETS, ModelSpecError, load_config, model_info, preset_info

    for name in PRESETS:
        total = model_info(load_config(name), name).num_layers
        for n in (None, 1, total):
            for dtype, autocast in (("float32", ""), ("float32", "bfloat16"), ("float16", "")):
                assert preset_info(name, n, dtype, autocast) == model_info(load_config(name, n), name, dtype, autocast)
        with pytest.raises(ModelSpecError, match=rf"--layers: expected 1\.\.{total} for {name}, got {total + 1}"):
            preset_info(name, total + 1)


def test_the_quick_sizes_profile_with_a_short_call_probe_and_start_ranks_without_torchrun(tmp_path, monkeypatch):
    from torchpp.demo import Demo, DemoConfig, DemoError, LocalHosts

    cmds = []
    for cfg, steps in ((DemoConfig.smoke(), " --call-probe-steps 3 "), (DemoConfig.quick(), None)):
        demo = Demo(cfg, tmp_path / "out", LocalHosts(2))
        monkeypatch.setattr(demo.p, "run", lambda title, cmd, **kw: cmds.append(cmd) or "")
        with pytest.raises(DemoError, match="profile wrote no"):  # nothing ran
            demo.profile()
        assert (steps in cmds[-1][-1]) if steps else "--call-probe-steps" not in cmds[-1][-1]
    ranks = LocalHosts(2).probe([sys.executable, "-m", "torchpp", "bandwidth", "probe"], tmp_path)
    assert ranks[:5] == [sys.executable, "-m", "torchpp.runtime.local_cli", "--nproc-per-node", "2"]
    assert "torch.distributed.run" not in ranks
