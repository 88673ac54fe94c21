"""Run training cases on real gloo process groups in spawned processes, with a hard deadline.

The processes are started once (importing torch and transformers is the slow part) and run
every case in turn; a case with a smaller world leaves the higher ranks idle. Each case
joins its own process group through a FileStore in the work directory (no port races).
"""
from __future__ import annotations

import json
import os
import time
import traceback
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp


def _worker(rank: int, cases: list[dict[str, Any]], workdir: str) -> None:
    os.environ["HF_HUB_OFFLINE"] = "1"
    import datetime

    import torch
    import torch.distributed as dist

    from torchpp.runtime.trainer import TrainConfig, train

    torch.set_num_threads(1)
    for i, case in enumerate(cases):
        world = case["world_size"]
        if rank >= world:
            continue
        try:
            dist.init_process_group("gloo", init_method=f"file://{workdir}/store_{i}", rank=rank, world_size=world,
                                    timeout=datetime.timedelta(seconds=case.get("timeout_s", 60)))
            cfg = TrainConfig(**case["config"])
            summary = train(cfg)
            if rank == 0:
                Path(case["result"]).write_text(json.dumps({"losses": summary.losses, "start": summary.start_step}))
            dist.destroy_process_group()
        except BaseException:
            Path(workdir, f"error_case{i}_rank{rank}.txt").write_text(traceback.format_exc())
            os._exit(1)


def run_cases(cases: list[dict[str, Any]], nprocs: int, workdir: Path, timeout_s: float = 300.0) -> None:
    """Run ``cases`` on ``nprocs`` spawned ranks; raise with the first error's traceback."""
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_worker, args=(r, cases, str(workdir)), daemon=True) for r in range(nprocs)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    try:
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.exitcode not in (0, None):
                break
    finally:
        alive = [p for p in procs if p.is_alive()]
        for p in alive:
            p.kill()
            p.join(5)
    errors = sorted(workdir.glob("error_case*_rank*.txt"))
    if errors:
        raise AssertionError(f"{errors[0].name}:\n{errors[0].read_text()}")
    if alive:
        raise TimeoutError(f"ranks {[procs.index(p) for p in alive]} still running after {timeout_s:.0f} s")
    bad = [(i, p.exitcode) for i, p in enumerate(procs) if p.exitcode != 0]
    if bad:
        raise AssertionError(f"ranks exited with codes {bad}")


def single_process_losses(model, opt, data, steps: int) -> list[float]:
    """Plain HF training of the whole model on the whole batch: the reference that pipeline and
    cluster runs must reproduce (losses per step; the model is trained in place)."""
    losses = []
    for step in range(steps):
        ids = data.batch(step)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses
