"""Ranks agree before they train: different plans stop every rank with one error before
anything is written; records between ranks are JSON in tensors (no pickles); rank 0's
rendezvous store listens only on MASTER_ADDR."""
from __future__ import annotations

import datetime
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from test_runtime_failures import _env, write_plan
from torchpp.runtime.launch import free_port as _free_port, torchrun_env, wait_ranks

ROOT = Path(__file__).resolve().parents[1]
OBJECT_COLLECTIVES = re.compile(r"(all_gather_object|gather_object|broadcast_object_list|scatter_object_list|"
                                r"send_object_list|recv_object_list)")


def test_no_pickling_collective_in_the_package():
    hits = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}"
            for p in sorted((ROOT / "torchpp").rglob("*.py"))
            for i, line in enumerate(p.read_text().splitlines(), 1) if OBJECT_COLLECTIVES.search(line)]
    assert not hits, "\n".join(hits)


def _exchange_worker(rank: int, store_path: str, out: str) -> None:
    import torch.distributed as dist

    from torchpp.runtime.exchange import DisagreementError, all_gather_json, gather_json, require_agreement

    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=30))
    got: dict = {"all": all_gather_json({"rank": rank, "text": "é" * (rank * 1000)}),
                 "gather": gather_json([rank, None, 1.5], dst=1), "empty": all_gather_json("")}
    require_agreement({"plan": "same", "seed": "0"})
    try:
        require_agreement({"plan": f"p{rank}", "seed": "0", "lr": "0.1"})
    except DisagreementError as e:
        got["error"] = str(e)
    dist.destroy_process_group()
    Path(out, f"rank{rank}.json").write_text(json.dumps(got))


def _spawn(target, args: tuple, nprocs: int, timeout_s: float) -> None:
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=target, args=(r, *args), daemon=True) for r in range(nprocs)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]


def test_json_exchange_and_agreement_between_two_ranks(tmp_path):
    _spawn(_exchange_worker, (str(tmp_path / "store"), str(tmp_path)), 2, timeout_s=120)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["all"] == r1["all"] == [{"rank": 0, "text": ""}, {"rank": 1, "text": "é" * 1000}]
    assert r0["gather"] is None and r1["gather"] == [[0, None, 1.5], [1, None, 1.5]]
    assert r0["empty"] == ["", ""]
    assert r0["error"] == r1["error"]
    assert "plan (p0 on rank 0; p1 on rank 1)" in r0["error"] and "lr (0.1 on ranks 0, 1)" not in r0["error"]
    assert "seed" not in r0["error"]


def _mismatch_worker(rank: int, plans: list[str], store_path: str, out: str) -> None:
    import torch.distributed as dist

    from torchpp.runtime import trainer
    from torchpp.runtime.exchange import DisagreementError
    from torchpp.runtime.trainer import TrainConfig, train

    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=900))
    cfg = TrainConfig(plan=Path(plans[rank]), steps=2, threads=1, timeout_s=900.0,
                      checkpoint_dir=Path(out, "ckpt"), log_dir=Path(out, "logs"))
    result: dict = {"at_check": None}
    agree = trainer.require_agreement

    def timed(fields):  # when this rank is up: it reached the first collective, the agreement
        result["at_check"] = time.monotonic()
        return agree(fields)

    trainer.require_agreement = timed
    t0 = time.monotonic()
    try:
        train(cfg)
        result["error"] = None
    except DisagreementError as e:
        result["error"] = str(e)
    result["stopped"] = time.monotonic()  # one clock for both processes (CLOCK_MONOTONIC is system-wide)
    result["seconds"] = result["stopped"] - t0
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    os._exit(0)  # as torchpp.train does after this error: no teardown of a group the peer has left


def _plans(tmp_path: Path) -> list[Path]:
    return [write_plan(tmp_path / "plan_a.json", layers=((0, 2), (2, 4))),
            write_plan(tmp_path / "plan_b.json", layers=((0, 3), (3, 4)))]


def test_different_plans_stop_every_rank_within_10_s(tmp_path):
    """Every rank stops within 10 s of the last rank being up (at the agreement, the first
    collective), where a rank that went on would wait --timeout-s 900 for its peer. Timed from
    the last rank up, not from train()'s call: how long a rank takes to get there (imports,
    the plan, the model's config) is the machine's load, 19-27 s on a loaded 2-core machine."""
    plans = [str(p) for p in _plans(tmp_path)]
    _spawn(_mismatch_worker, (plans, str(tmp_path / "store"), str(tmp_path)), 2, timeout_s=120)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert all(res["at_check"] is not None for res in results), results  # the check is the agreement
    up = max(res["at_check"] for res in results)  # its exchange ends only once every rank is in it
    for res in results:
        assert res["error"] and res["error"].startswith("ranks were started with different plan ("), res
        assert "on rank 0;" in res["error"] and "on rank 1)" in res["error"], res
        assert res["stopped"] - up < 10.0, res
    assert not (tmp_path / "ckpt").exists() and not (tmp_path / "logs").exists()


def test_different_plans_exit_2_on_every_rank_with_nothing_written(tmp_path):
    """Through `torchpp.train` with env:// (MASTER_ADDR), as torchrun starts ranks."""
    plans = _plans(tmp_path)
    outs = {k: tmp_path / k for k in ("ckpt", "logs", "traces")}
    start = time.monotonic()
    args = ["--steps", "2", "--threads", "1", "--timeout-s", "900", "--checkpoint-dir", str(outs["ckpt"]),
            "--log-dir", str(outs["logs"]), "--trace-dir", str(outs["traces"])]
    port = _free_port()
    # each rank its own plan file, so each is started by hand with torchrun's variables
    procs = [subprocess.Popen([sys.executable, "-m", "torchpp.train", "--plan", str(plan), *args],
                              env=_env(**torchrun_env(rank, 2, port)), cwd=ROOT, stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank, plan in enumerate(plans)]
    results = wait_ranks(procs, timeout_s=120)
    elapsed = time.monotonic() - start
    for rank, (code, out, err) in enumerate(results):
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert code == 2, err[-2000:]
        assert len(lines) == 1 and lines[0].startswith(f"torchpp.train: rank {rank}: error: ranks were started "
                                                        "with different plan ("), err[-2000:]
        assert not out.strip(), out
    assert elapsed < 120  # a rank past the check would wait --timeout-s 900 for its peer
    assert not any(p.exists() for p in outs.values()), [p for p in outs.values() if p.exists()]


def _listening(pid: int, port: int) -> list[str]:
    import psutil

    return [c.laddr.ip for c in psutil.Process(pid).net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port]


def test_store_listens_on_master_addr_only():
    from torchpp.runtime.rendezvous import env_store

    port = _free_port()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        store = env_store(0, 1, datetime.timedelta(seconds=10))
        store.set("k", "v")
        assert _listening(os.getpid(), port) == ["127.0.0.1"]
        del store
    finally:
        del os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]


def test_training_rank_0_store_listens_on_master_addr_only(tmp_path):
    """Rank 0 of `torchpp.train` waits for rank 1 in the store: while it waits, look at its socket."""
    plan = write_plan(tmp_path / "plan.json")
    port = _free_port()
    env = _env(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port))
    proc = subprocess.Popen([sys.executable, "-m", "torchpp.train", "--plan", str(plan), "--steps", "1",
                             "--threads", "1", "--timeout-s", "120"], env=env, cwd=ROOT, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline, seen = time.monotonic() + 90, []
        while time.monotonic() < deadline and not seen and proc.poll() is None:
            seen = _listening(proc.pid, port)
            time.sleep(0.2)
        assert seen == ["127.0.0.1"], (seen, proc.poll())
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("addr", ["", "not a host name"])
def test_bad_master_addr_is_one_error(addr, monkeypatch):
    from torchpp.runtime.rendezvous import RendezvousError, env_store

    monkeypatch.setenv("MASTER_ADDR", addr)
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    with pytest.raises(RendezvousError, match="MASTER_ADDR"):
        env_store(0, 1, datetime.timedelta(seconds=5))
