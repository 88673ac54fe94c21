"""Multi-rank tests on the one launcher (``torchpp.runtime.launch``): training cases on a pool
of gloo ranks, and a decorator that runs a test's body on every rank.

The pool's processes are started once (importing torch and transformers is the slow part) and
run every case in turn; a case with a smaller world leaves the higher ranks idle. Each case
joins its own process group (a FileStore in the pool's temp dir, so no port races).
"""
from __future__ import annotations

import functools
import importlib
import inspect
import json
import time
from pathlib import Path
from typing import Any, Callable

from torchpp.runtime.launch import RankPool, run_ranks


def _train_case(rank: int, world: int, case: dict[str, Any]) -> None:
    from torchpp.runtime.trainer import TrainConfig, train

    summary = train(TrainConfig(**case["config"]))
    if rank == 0:
        Path(case["result"]).write_text(json.dumps({"losses": summary.losses, "start": summary.start_step}))


def run_cases(cases: list[dict[str, Any]], nprocs: int, workdir: Path, timeout_s: float = 300.0) -> None:
    """Run ``cases`` one after another on ``nprocs`` ranks, all within ``timeout_s``; raise
    ``RankError`` (rank and traceback) for the first failure, ``RanksTimedOut`` at the deadline.
    ``workdir`` is where the cases write; the pool keeps its own stores elsewhere."""
    deadline = time.monotonic() + timeout_s
    with RankPool(nprocs, threads=1) as pool:
        for case in cases:
            pool.run(_train_case, case, world=case["world_size"], timeout_s=max(1.0, deadline - time.monotonic()),
                     pg_timeout_s=case.get("timeout_s", 60))


class _Body:
    """A decorated test's own function, found by name in the rank (the module attribute is the
    wrapper that launches it, so the function cannot be pickled by reference itself)."""

    def __init__(self, module: str, name: str):
        self.module, self.name = module, name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        wrapper = getattr(importlib.import_module(self.module), self.name)
        return wrapper.__wrapped__(*args, **kwargs)


def on_ranks(world: int, timeout_s: float = 60.0, threads: int = 1) -> Callable:
    """Decorator: the test's body ``body(rank, world, **fixtures)`` runs on ``world`` gloo ranks
    within ``timeout_s``; the test fails with the failing rank's traceback."""
    def wrap(body: Callable) -> Callable:
        target = _Body(body.__module__, body.__qualname__)

        @functools.wraps(body)
        def test(*args: Any, **kwargs: Any) -> None:
            run_ranks(world, target, *args, timeout_s=timeout_s, threads=threads, **kwargs)

        params = list(inspect.signature(body).parameters.values())[2:]  # pytest fills the rest
        test.__signature__ = inspect.Signature(params)
        return test
    return wrap


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
