"""The in-place embedding gradient equals nn.Embedding's and builds no table-sized block."""
import torch
from torch import nn

from torchpp.models.embedding import embed, in_place_capable


def _grads(module: nn.Module, batches: list[torch.Tensor], in_place: bool) -> torch.Tensor:
    module.weight.grad = None
    gen = torch.Generator().manual_seed(1)
    for ids in batches:
        out = embed(module, ids) if in_place else module(ids)
        out.backward(torch.randn(out.shape, generator=gen))
    return module.weight.grad.clone()


def test_gradient_equals_nn_embedding_over_micro_batches_with_padding():
    torch.manual_seed(0)
    m = nn.Embedding(50, 8, padding_idx=3)
    batches = [torch.randint(0, 50, (2, 7)) for _ in range(3)]
    batches[0][0, :3] = 3  # the padding row is used and must get no gradient
    ref, got = _grads(m, batches, False), _grads(m, batches, True)
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
    assert torch.count_nonzero(got[3]) == 0


def test_adds_to_a_gradient_another_use_of_the_weight_left():
    """A tied lm_head's gradient may be in .grad first (same stage, either order)."""
    torch.manual_seed(0)
    m = nn.Embedding(20, 4)
    ids = torch.randint(0, 20, (2, 5))
    h = torch.randn(2, 5, 4)
    for in_place in (False, True):
        m.weight.grad = None
        (embed(m, ids) if in_place else m(ids)).sum().backward()
        (h @ m.weight.t()).sum().backward()
        if not in_place:
            ref = m.weight.grad.clone()
    torch.testing.assert_close(m.weight.grad, ref)


def test_bfloat16_weights_and_no_grad_and_frozen_fall_through():
    m = nn.Embedding(30, 8).to(torch.bfloat16)
    ids = torch.randint(0, 30, (1, 4))
    out = embed(m, ids)
    out.float().sum().backward()
    assert m.weight.grad.dtype == torch.bfloat16 and torch.count_nonzero(m.weight.grad) > 0
    with torch.no_grad():
        assert embed(m, ids).grad_fn is None
    m.weight.requires_grad_(False)
    assert embed(m, ids).grad_fn is None


def test_only_plain_dense_embeddings():
    class Scaled(nn.Embedding):
        def forward(self, ids):
            return super().forward(ids) * 2.0

    assert in_place_capable(nn.Embedding(5, 2))
    assert not in_place_capable(Scaled(5, 2))
    assert not in_place_capable(nn.Embedding(5, 2, sparse=True))
    assert not in_place_capable(nn.Embedding(5, 2, max_norm=1.0))
    m = Scaled(5, 2)
    ids = torch.tensor([[1, 2]])
    torch.testing.assert_close(embed(m, ids), m(ids))  # the subclass's own forward runs


def test_backward_allocates_no_table_sized_block():
    """What the change is for: nn.Embedding's backward allocates the whole table per micro-batch."""
    from torch.profiler import ProfilerActivity, profile

    m = nn.Embedding(20000, 64)
    table = m.weight.numel() * 4
    ids = torch.randint(0, 20000, (2, 16))

    def largest_alloc(in_place: bool) -> int:
        m.weight.grad = torch.zeros_like(m.weight)  # a later micro-batch: .grad exists
        out = embed(m, ids) if in_place else m(ids)
        g = torch.ones_like(out)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            out.backward(g)
        return max((e.cpu_memory_usage for e in prof.events()), default=0)

    assert largest_alloc(False) >= table  # the control: the dense backward does build it
    assert largest_alloc(True) < table // 100
