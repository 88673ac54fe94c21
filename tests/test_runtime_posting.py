"""Receives are posted ahead of the pass that needs them, once each, and never all at once."""
from __future__ import annotations

import pytest

from torchpp.models.presets import load_config, model_info
from torchpp.planner.simple import make_plan
from torchpp.runtime.executor import RECV_LOOKAHEAD, receive_posting
from torchpp.schedules import Kind, build

PLANS = {
    "pp3_1f1b": dict(layer_ranges=[(0, 1), (1, 2), (2, 4)], group_sizes=[1, 1, 1], schedule="1f1b"),
    "pp2_gpipe": dict(layer_ranges=[(0, 3), (3, 4)], group_sizes=[1, 1], schedule="gpipe"),
    "hybrid21_1f1b": dict(layer_ranges=[(0, 1), (1, 4)], group_sizes=[2, 1], schedule="1f1b",
                          shares=[[2.0, 1.0], [1.0]]),
}


@pytest.mark.parametrize("name", list(PLANS))
def test_every_receive_is_posted_once_and_ahead_of_its_pass(name):
    info = model_info(load_config("qwen3-tiny"), "qwen3-tiny")
    plan = make_plan(info, seq_len=16, global_batch=12, num_microbatches=6, **PLANS[name])
    m = plan.num_microbatches
    for rank, acts in build(plan).items():
        posting = receive_posting(acts)
        posted_at = {a: i for i, rs in posting.items() for a in rs}
        recvs = [a for a in acts if a.is_recv]
        assert sorted(posted_at, key=acts.index) == recvs  # each receive exactly once
        passes = [i for i, a in enumerate(acts) if a.kind in (Kind.FORWARD, Kind.BACKWARD)]
        for r in recvs:
            k = acts.index(r)
            consumer = next(i for i in passes if i > k)
            at = posted_at[r]
            assert at <= k
            ahead = sum(1 for i in passes if at <= i < consumer)
            assert ahead >= min(RECV_LOOKAHEAD, passes.index(consumer)), (rank, r, at)
        # never more receives outstanding than the lookahead needs: far fewer than the step's 2m
        live, most = set(), 0
        for i, a in enumerate(acts):
            live |= set(posting.get(i, ()))
            most = max(most, len(live))
            live.discard(a)
        if len(recvs) >= 2 * m:
            assert most < len(recvs)
        senders = max(len(s.devices) for s in plan.stages)
        assert most <= (RECV_LOOKAHEAD + 1) * senders * 2
