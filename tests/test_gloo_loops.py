"""gloo's I/O threads run under SCHED_BATCH once the runtime's groups exist (``comm.calm_gloo_loops``):
woken while a compute thread holds their pair's lock, they spun through a time slice instead of
letting it finish. The compute threads and gloo's collective workers keep the normal policy, and
messages still flow."""
from __future__ import annotations

import os
import sys

import pytest
import torch

from dist_harness import on_ranks

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="thread policies are read from /proc")


def _policies() -> dict[str, set[int]]:
    out: dict[str, set[int]] = {}
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/comm") as f:
            name = f.read().strip()
        out.setdefault(name, set()).add(os.sched_getscheduler(int(tid)))
    return out


@on_ranks(2)
def test_make_groups_puts_gloo_loops_in_batch_and_messages_still_flow(rank, world):
    import torch.distributed as dist

    from torchpp.models.presets import load_config, model_info
    from torchpp.planner.simple import make_plan
    from torchpp.runtime.comm import Comm, calm_gloo_loops
    from torchpp.schedules import build

    info = model_info(load_config("qwen3-tiny"), "qwen3-tiny")
    plan = make_plan(info, layer_ranges=[(0, 4)], group_sizes=[2], schedule="1f1b", seq_len=16, global_batch=4,
                     num_microbatches=2)
    before = _policies()
    assert before["gloo_tcp_loop"] == {os.SCHED_OTHER}  # torch's default, which the runtime changes
    comm = Comm(rank, 30.0)
    comm.make_groups(build(plan))
    assert comm.groups  # the data-parallel group was made: its device's I/O thread too
    after = _policies()
    assert after["gloo_tcp_loop"] == {os.SCHED_BATCH}
    assert all(p == {os.SCHED_OTHER} for name, p in after.items() if name != "gloo_tcp_loop"), after
    assert calm_gloo_loops() == 0  # idempotent: nothing left to change
    x = torch.arange(4.0) + rank
    dist.all_reduce(x, group=next(iter(comm.groups.values())))
    assert x.tolist() == [1.0, 3.0, 5.0, 7.0]
    y = torch.full((3,), float(rank))
    if rank == 0:
        dist.send(y, 1)
    else:
        dist.recv(y, 0)
        assert y.tolist() == [0.0, 0.0, 0.0]
