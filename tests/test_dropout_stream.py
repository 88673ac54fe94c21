"""A block's dropout stream: seeded from its key alone, the caller's random state untouched, and
cheap (only the CPU generator: ``torch.manual_seed`` would also format the Python stack to queue a
lazy accelerator seed, once per block per micro-batch)."""
from __future__ import annotations

import torch

from torchpp.models import stages


def test_stream_depends_on_the_key_and_restores_the_callers_state(monkeypatch):
    def refuse(*_a, **_k):
        raise AssertionError("the stream must not reseed every device")

    torch.manual_seed(123)
    before = torch.rand(3)
    torch.manual_seed(123)
    monkeypatch.setattr(torch, "manual_seed", refuse)
    with stages._seeded(0, 1, 2, 3):
        a = torch.nn.functional.dropout(torch.ones(64), 0.5)
    with stages._seeded(0, 1, 2, 3):
        b = torch.nn.functional.dropout(torch.ones(64), 0.5)
    with stages._seeded(0, 1, 2, 4):
        c = torch.nn.functional.dropout(torch.ones(64), 0.5)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert torch.equal(torch.rand(3), before)  # as if no stream had run


def test_stream_restores_the_state_when_the_block_raises():
    torch.manual_seed(7)
    state = torch.get_rng_state()
    try:
        with stages._seeded(1, 2):
            torch.rand(5)
            raise ValueError
    except ValueError:
        pass
    assert torch.equal(torch.get_rng_state(), state)
