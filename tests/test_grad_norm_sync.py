"""The optimizer step waits for the other ranks only when it must.

The global gradient norm needs every rank's gradients. Without clipping no rank needs it before
its own update, so a rank that finishes its backward early updates at once and the norm's
all-reduce completes later; with clipping the update waits, and that wait is reported
(``sync_s``) apart from the update so that a trace does not show it as a slow optimizer.
"""
from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from dist_harness import on_ranks
from torchpp.runtime.optim import OptimSettings, SteppedOptimizer

LATE_S = 1.0


def _stepper(rank: int, clip: float) -> tuple[SteppedOptimizer, torch.nn.Parameter]:
    p = torch.nn.Parameter(torch.full((4,), float(rank + 1)))
    p.grad = torch.full((4,), float(rank + 1))  # squared norms 4 and 16: the global norm is sqrt(20)
    opt = torch.optim.SGD([p], lr=0.1)
    return SteppedOptimizer(opt, [p], OptimSettings(max_grad_norm=clip), counts_stage=True, skip=None), p


@on_ranks(2)
def test_without_clipping_an_early_rank_updates_without_waiting(rank, world):
    stepper, p = _stepper(rank, 0.0)
    dist.barrier()  # both ranks start the step together; then rank 1 is late by LATE_S
    if rank == 1:
        time.sleep(LATE_S)  # a slow last stage still in its backward
    t0 = time.perf_counter()
    stepper.step()
    took = time.perf_counter() - t0
    if rank == 0:
        assert took < LATE_S / 2 and stepper.sync_s == 0.0
        assert torch.allclose(p.detach(), torch.full((4,), 0.9))  # updated, unclipped
    assert stepper.last_grad_norm == pytest.approx(20 ** 0.5)  # the norm is still the global one


@on_ranks(2)
def test_with_clipping_the_wait_is_reported_apart_from_the_update(rank, world):
    stepper, p = _stepper(rank, 1.0)
    dist.barrier()
    if rank == 1:
        time.sleep(LATE_S)
    stepper.step()
    assert stepper.last_grad_norm == pytest.approx(20 ** 0.5)
    coef = 1.0 / (20 ** 0.5 + 1e-6)
    assert torch.allclose(p.detach(), torch.full((4,), (rank + 1) * (1 - 0.1 * coef)))
    if rank == 0:
        assert stepper.sync_s > LATE_S / 2
