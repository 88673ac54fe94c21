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


def _train_config(rank: int, world: int, config: dict[str, Any]) -> None:
    from torchpp.runtime.trainer import TrainConfig, train

    train(TrainConfig(**config))


def traced_tiny_run(root: Path, **train_kw: Any) -> Path:
    """A 2-stage 1F1B run of ``qwen3-tiny`` (2 steps), step 2 traced by torchpp and
    torch.profiler; the trace directory."""
    from torchpp.models.presets import load_config, model_info
    from torchpp.planner.simple import make_plan

    info = model_info(load_config("qwen3-tiny"), "qwen3-tiny")
    make_plan(info, seq_len=16, global_batch=4, num_microbatches=2, layer_ranges=[(0, 2), (2, 4)],
              group_sizes=[1, 1], schedule="1f1b").save(root / "plan.json")
    with RankPool(2, threads=1) as pool:
        pool.run(_train_config, dict(plan=root / "plan.json", steps=2, threads=1, timeout_s=60.0,
                                     trace_dir=root / "tr", trace_steps=(2,), torch_profiler=True, **train_kw),
                 world=2, timeout_s=300, pg_timeout_s=60)
    return root / "tr"


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
