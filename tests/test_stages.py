"""A stage built alone computes exactly what the whole model computes, and holds only its part."""
from __future__ import annotations

import pytest
import torch

from torchpp.data import SyntheticTokens, TokenCorpus, prepare_corpus
from torchpp.models.presets import build_model, load_config
from torchpp.models.stages import StageSpec, build_stage, count_targets

SPLIT = [(0, 1), (1, 3), (3, 4)]


def stages(model: str, seed: int = 3, recompute: bool = False, weights=None):
    cfg = load_config(model)
    return [build_stage(model, cfg, StageSpec(layers=r, has_embed=k == 0, has_tail=k == len(SPLIT) - 1,
                                              recompute=(recompute,) * (r[1] - r[0]), num_stages=len(SPLIT)),
                        seed=seed, weights=weights) for k, r in enumerate(SPLIT)]


@pytest.mark.parametrize("model", ["qwen3-tiny", "llama-tiny", "gpt2-tiny"])
def test_stages_compose_to_the_whole_model(model):
    full = build_model(model, seed=3)
    ids = torch.randint(0, full.config.vocab_size, (3, 16), generator=torch.Generator().manual_seed(0))
    ref = full(input_ids=ids, labels=ids)
    ref.loss.backward()
    h = ids
    parts = stages(model, recompute=True)
    for st in parts:
        h = st.forward(h, labels=ids, n_tokens=count_targets(ids))
    assert torch.equal(h, ref.loss)  # bit for bit: same ops, same order
    h.backward()
    grads: dict[str, torch.Tensor] = {}  # a tied weight's two copies add up to the whole model's gradient
    for st in parts:
        for n, p in st.named_parameters():
            src = st.source_name(n)
            grads[src] = grads[src] + p.grad if src in grads else p.grad
    full_params = dict(full.named_parameters())
    assert set(grads) == set(full_params)
    for n, g in grads.items():
        assert torch.allclose(g, full_params[n].grad, atol=1e-7, rtol=1e-5), n


@pytest.mark.parametrize("model", ["qwen3-tiny", "gpt2-tiny"])
def test_stage_holds_only_its_parameters_with_the_whole_models_values(model):
    full = dict(build_model(model, seed=5).named_parameters())
    total = sum(p.numel() for p in full.values())
    mid = stages(model, seed=5)[1]
    names = [n for n, _ in mid.named_parameters()]
    assert names and all(".1." in n or ".2." in n for n in names)  # layers 1 and 2 only
    assert not any(t.is_meta for t in list(mid.module.parameters()) + list(mid.module.buffers()))
    assert sum(p.numel() for _, p in mid.named_parameters()) < total / 2
    for n, p in mid.named_parameters():
        assert torch.equal(p, full[n]), n
    last = stages(model, seed=5)[2]
    if load_config(model).tie_word_embeddings:
        head = dict(last.named_parameters())["lm_head.weight"]
        assert last.tied_parameter() is head
        assert torch.equal(head, full[last.source_name("lm_head.weight")])


@pytest.mark.parametrize("model", ["gpt2-tiny", "qwen3-tiny"])
def test_middle_stage_is_causal(model):
    """Eager attention without a mask attends to the future; the stage rebuilds the mask."""
    mid = stages(model)[1]
    g = torch.Generator().manual_seed(1)
    h = torch.randn(2, 12, mid.hidden_size, generator=g)
    h2 = h.clone()
    h2[:, -1] += 1.0  # change only the last position
    with torch.no_grad():
        a, b = mid.forward(h), mid.forward(h2)
    assert torch.equal(a[:, :-1], b[:, :-1])
    assert not torch.equal(a[:, -1], b[:, -1])


def test_stage_loads_only_its_tensors_from_a_local_checkpoint(tmp_path):
    full = build_model("llama-tiny", seed=9)
    full.save_pretrained(tmp_path, safe_serialization=True)
    for st in stages("llama-tiny", seed=0, weights=tmp_path):
        for n, p in st.named_parameters():
            assert torch.equal(p, dict(full.named_parameters())[n]), n
    # a local model path (no preset) loads from its own checkpoint
    cfg = load_config(str(tmp_path))
    st = build_stage(str(tmp_path), cfg, StageSpec(layers=(2, 4), has_embed=False, has_tail=True, num_stages=2))
    assert torch.equal(dict(st.named_parameters())["lm_head.weight"], full.lm_head.weight)


def test_data_is_a_function_of_seed_and_step(tmp_path):
    s = SyntheticTokens(vocab_size=100, seq_len=8, global_batch=4, seed=1)
    assert torch.equal(s.batch(3), SyntheticTokens(vocab_size=100, seq_len=8, global_batch=4, seed=1).batch(3))
    assert not torch.equal(s.batch(3), s.batch(4))
    (tmp_path / "a.txt").write_text("".join(f"{i:015d}\n" for i in range(64)))  # 16-byte lines, all different
    (tmp_path / "b.jsonl").write_text("\n".join('{"text": "sample %d of the corpus"}' % i for i in range(30)))
    prepare_corpus([tmp_path / "a.txt", tmp_path / "b.jsonl"], tmp_path / "c", tokenizer="bytes", num_proc=1)
    t1 = TokenCorpus(tmp_path / "c", seq_len=16, global_batch=4, seed=2)
    t2 = TokenCorpus(tmp_path / "c", seq_len=16, global_batch=4, seed=2)
    n = len(t1)
    assert n >= 8
    for step in (0, 1, n):  # step n is in a later epoch
        assert torch.equal(t1.batch(step), t2.batch(step))
    seen = torch.cat([t1.batch(k) for k in range(n // 4)])
    first = {tuple(r.tolist()) for r in seen if bytes(r.tolist()).rstrip(b"\n").isdigit()}
    assert len(first) == sum(1 for r in seen if bytes(r.tolist()).rstrip(b"\n").isdigit())  # no repeats in an epoch
    assert len(first) > 40
    assert int(t1.batch(0).max()) < 256  # byte tokens

def test_masks_and_rotary_are_built_once_per_shape_and_stay_exact(monkeypatch):
    """The layers' masks and cos/sin depend only on the input's shape: built once per shape, reused
    by every later micro-batch of it, and the outputs equal the whole model's each time. A rotary
    embedding that rescales itself with the lengths it has seen (dynamic RoPE) is asked every time."""
    from torchpp.models import semantics

    calls = []
    real = semantics.layer_inputs
    monkeypatch.setattr(semantics, "layer_inputs", lambda *a, **k: calls.append(a[3].shape) or real(*a, **k))
    full = build_model("qwen3-tiny", seed=3)
    st = stages("qwen3-tiny")[0]
    for T in (16, 16, 8, 16, 8):
        ids = torch.randint(0, full.config.vocab_size, (2, T), generator=torch.Generator().manual_seed(T))
        want = full.model(input_ids=ids, output_hidden_states=True).hidden_states[SPLIT[0][1]]
        assert torch.equal(st.forward(ids), want)
    assert [tuple(s) for s in calls] == [(2, 16, 64), (2, 8, 64)]

    cfg = load_config("qwen3-tiny")
    cfg.rope_parameters = {**cfg.rope_parameters, "rope_type": "dynamic", "factor": 2.0}
    dyn = build_stage("qwen3-tiny", cfg, StageSpec(layers=(0, 1), has_embed=True, has_tail=False, num_stages=2))
    calls.clear()
    for _ in range(3):
        dyn.forward(ids)
    assert len(calls) == 3


def test_a_large_eager_mask_is_rebuilt_rather_than_kept(monkeypatch):
    """Eager attention's batch x length^2 mask would stay through the step's peak if kept: above
    KEPT_MASK_BYTES it is built per forward, as before; small ones are kept."""
    from torchpp.models import stages as S

    st = stages("gpt2-tiny")[0]
    ids = torch.randint(0, 100, (2, 16))
    st.forward(ids)
    assert st._inputs  # 2 x 16 x 16 floats: kept
    monkeypatch.setattr(S, "KEPT_MASK_BYTES", 2 * 16 * 16 * 4 - 1)
    st._inputs.clear()
    st.forward(ids)
    assert not st._inputs
