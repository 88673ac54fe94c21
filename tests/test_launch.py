"""The one rank launcher: values come back by rank, a failure names its rank and traceback, a
rank that hangs is killed at the deadline, and nothing is left running afterwards."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from dist_harness import on_ranks
from torchpp.runtime.launch import RankError, RankPool, RanksTimedOut, popen_ranks, run_ranks, wait_ranks


def _children() -> set[int]:
    """This process's descendants, less multiprocessing's resource tracker (one per parent, for
    its whole life)."""
    out = set()
    for p in psutil.Process().children(recursive=True):
        try:
            if "multiprocessing.resource_tracker" not in " ".join(p.cmdline()):
                out.add(p.pid)
        except psutil.NoSuchProcess:
            pass
    return out


@pytest.fixture
def no_leftovers():
    """Every process a test starts is gone when it ends."""
    before = _children()
    yield
    left = _children() - before
    assert not left, [psutil.Process(p).cmdline() for p in left if psutil.pid_exists(p)]


def _sum_ranks(rank: int, world: int, scale: int) -> tuple[int, int, float, str, int]:
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return rank, world, scale * float(t[0]), os.environ["OMP_NUM_THREADS"], torch.get_num_threads()


def _fail_on(rank: int, world: int, bad: int) -> int:
    if rank == bad:
        raise ValueError(f"boom on {rank}")
    return rank


def _exit_on(rank: int, world: int, bad: int) -> int:
    if rank == bad:
        os._exit(3)
    return rank


def _hang_on(rank: int, world: int, bad: int, pid_file: str) -> int:
    if rank == bad:
        child = subprocess.Popen(["sleep", "600"])  # what the rank started must go too
        Path(pid_file).write_text(str(child.pid))
        time.sleep(600)
    return rank


def test_values_come_back_by_rank_in_one_group(no_leftovers):
    got = run_ranks(3, _sum_ranks, 2, timeout_s=120, threads=2)
    assert got == [(r, 3, 2 * (0 + 1 + 2), "2", 2) for r in range(3)]


def test_pool_runs_smaller_worlds_and_removes_its_temp_dir(no_leftovers):
    with RankPool(3) as pool:
        assert [x[:3] for x in pool.run(_sum_ranks, 1, world=2, timeout_s=120)] == [(0, 2, 1.0), (1, 2, 1.0)]
        assert [x[:3] for x in pool.run(_sum_ranks, scale=1, timeout_s=60)] == [(r, 3, 3.0) for r in range(3)]
        workdir = Path(pool._workdir)
        assert workdir.is_dir()
    assert not workdir.exists()
    with pytest.raises(RuntimeError, match="stopped"):
        pool.run(_sum_ranks, 1)


def test_exception_names_rank_message_and_traceback(no_leftovers):
    with pytest.raises(RankError) as e:
        run_ranks(2, _fail_on, 1, timeout_s=120)
    assert e.value.rank == 1 and e.value.message == "ValueError: boom on 1"
    assert "rank 1: ValueError: boom on 1" in str(e.value) and "in _fail_on" in e.value.details


def test_rank_that_dies_is_named_with_its_exit_code(no_leftovers):
    with pytest.raises(RankError, match=r"rank 0: the process exited \(code 3\)") as e:
        run_ranks(2, _exit_on, 0, timeout_s=120)
    assert e.value.rank == 0


def test_hanging_rank_is_killed_at_the_deadline(tmp_path, no_leftovers):
    pid_file = tmp_path / "pid"
    with RankPool(2) as pool:
        pool.run(_sum_ranks, 1, timeout_s=120)  # started and imported: the deadline below is the call's alone
        workdir = Path(pool._workdir)
        t0 = time.monotonic()
        with pytest.raises(RanksTimedOut) as e:
            pool.run(_hang_on, 1, str(pid_file), timeout_s=3)
        elapsed = time.monotonic() - t0
    assert e.value.ranks == [1] and "ranks [1] still running after 3 s" in str(e.value)
    assert 3 <= elapsed < 3 + 5, elapsed
    assert not psutil.pid_exists(int(pid_file.read_text())) or \
        psutil.Process(int(pid_file.read_text())).status() == psutil.STATUS_ZOMBIE
    assert not workdir.exists()


def test_unpicklable_function_is_refused_before_any_rank_runs(no_leftovers):
    with pytest.raises(Exception, match="pickle|attribute lookup"):
        run_ranks(1, lambda rank, world: rank, timeout_s=30)


@on_ranks(2, timeout_s=120)
def test_decorator_runs_the_body_on_every_rank(rank, world, tmp_path):
    import torch
    import torch.distributed as dist

    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    assert world == 2 and float(t[0]) == 3.0
    (tmp_path / f"rank{rank}").write_text("ran")


def test_decorated_body_ran_on_both_ranks(tmp_path):
    test_decorator_runs_the_body_on_every_rank(tmp_path=tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0", "rank1"]


_CLI = "import os, time; print(os.environ['RANK'], os.environ['WORLD_SIZE'], os.environ['HOST']); " \
       "time.sleep(float(os.environ['NAP']) * int(os.environ['RANK']))"


def test_command_per_rank_gets_torchrun_variables(no_leftovers):
    procs = popen_ranks([sys.executable, "-c", _CLI], 2, env={**os.environ, "NAP": "0"},
                        per_rank=lambda r: {"HOST": f"h{r}"}, stdout=subprocess.PIPE, text=True)
    assert wait_ranks(procs, timeout_s=60) == [(0, "0 2 h0\n", None), (0, "1 2 h1\n", None)]


def test_command_that_overruns_is_killed(no_leftovers):
    procs = popen_ranks([sys.executable, "-c", _CLI], 2, env={**os.environ, "NAP": "600"},
                        per_rank=lambda r: {"HOST": "h"}, stdout=subprocess.DEVNULL)
    t0 = time.monotonic()
    with pytest.raises(RanksTimedOut) as e:
        wait_ranks(procs, timeout_s=3)
    assert e.value.ranks == [1] and time.monotonic() - t0 < 3 + 5
    assert all(p.poll() is not None for p in procs)


_POOL_THEN_HANG = """
import os, sys, time
sys.path.insert(0, {root!r})
from torchpp.runtime.launch import RankPool

def _pid_then_sleep(rank, world, where):
    open(os.path.join(where, f"rank{{rank}}"), "w").write(str(os.getpid()))
    time.sleep(600)

if __name__ == "__main__":
    with RankPool(2) as pool:
        pool.run(_pid_then_sleep, {where!r}, timeout_s=900)
"""


def test_ranks_die_with_a_parent_killed_mid_task(tmp_path):
    """A pool's ranks are mid-task when their parent is SIGKILLed (no pipe closed, no cleanup ran):
    Linux's parent-death signal ends them; before, they ran on alone for the whole task."""
    script = tmp_path / "pool.py"
    script.write_text(_POOL_THEN_HANG.format(root=str(Path(__file__).resolve().parents[1]), where=str(tmp_path)))
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not all((tmp_path / f"rank{r}").exists() for r in range(2)) and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(0.5)  # the pid files are written: the task is running on both
        ranks = [psutil.Process(int((tmp_path / f"rank{r}").read_text())) for r in range(2)]
        parent.kill()
        parent.wait()
        gone, alive = psutil.wait_procs(ranks, timeout=30)
        assert not alive, [p.pid for p in alive]
    finally:
        parent.kill()
        for f in tmp_path.glob("rank*"):  # orphans are no children of this process
            try:
                psutil.Process(int(f.read_text())).kill()
            except (psutil.Error, ValueError):
                pass
