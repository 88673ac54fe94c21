"""Cutting HF causal LMs into blocks: every parameter in exactly one block, paths that resolve."""
import pytest
import torch
from transformers import AutoModelForCausalLM, MistralConfig, Qwen2Config

from torchpp.models.blocks import EMBED, TAIL, UnsupportedModelError, block_names, find_parts
from torchpp.models.presets import build_model

EXPECTED = {
    "qwen3-tiny": dict(embed=["model.embed_tokens"], layers="model.layers", norm="model.norm",
                       rotary="model.rotary_emb", tied=True),
    "llama-tiny": dict(embed=["model.embed_tokens"], layers="model.layers", norm="model.norm",
                       rotary="model.rotary_emb", tied=False),
    "gpt2-tiny": dict(embed=["transformer.wte", "transformer.wpe", "transformer.drop"], layers="transformer.h",
                      norm="transformer.ln_f", rotary=None, tied=True),
}


def _extra(kind):
    kw = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128)
    cfg = (Qwen2Config if kind == "qwen2" else MistralConfig)(**kw)
    return AutoModelForCausalLM.from_config(cfg)


@pytest.mark.parametrize("preset", sorted(EXPECTED))
def test_parts_of_presets(preset):
    m = build_model(preset)
    parts = find_parts(m)
    exp = EXPECTED[preset]
    assert parts.embed_paths == exp["embed"]
    assert parts.layers_path == exp["layers"] and parts.norm_path == exp["norm"]
    assert parts.lm_head_path == "lm_head" and parts.rotary_path == exp["rotary"]
    assert parts.tied_embeddings is exp["tied"]
    assert parts.num_layers == 4 and parts.block_names() == block_names(4)
    assert parts.layers is m.get_submodule(exp["layers"]) and parts.lm_head is m.lm_head
    assert parts.embeddings[0] is m.get_input_embeddings()


@pytest.mark.parametrize("name", ["qwen3-tiny", "llama-tiny", "gpt2-tiny", "qwen2", "mistral"])
def test_every_parameter_in_exactly_one_block(name):
    m = build_model(name) if name in EXPECTED else _extra(name)
    parts = find_parts(m)
    blocks = parts.block_names()
    seen: dict[str, str] = {}
    for b in blocks:
        for n in parts.param_names(b):
            assert n not in seen, f"{n} in {seen.get(n)} and {b}"
            seen[n] = b
            assert parts.block_of(n) == b
    all_names = [n for n, _ in m.named_parameters(remove_duplicate=False)]
    assert sorted(seen) == sorted(all_names)
    # Bytes by block add up to the model's bytes, counting a tied lm_head weight at both ends.
    total = sum(p.numel() * p.element_size() for p in m.parameters())
    tied = parts.lm_head.weight.numel() * parts.lm_head.weight.element_size() if parts.tied_embeddings else 0
    assert sum(parts.param_bytes(b) for b in blocks) == total + tied
    for i in range(parts.num_layers):
        assert parts.prefixes(f"layer{i}") == (f"{parts.layers_path}.{i}.",)
        assert parts.block_modules(f"layer{i}")[0] is parts.layers[i]


def test_tail_holds_lm_head_and_norm_and_tied_weight_counts_in_both_ends():
    parts = find_parts(build_model("qwen3-tiny"))
    assert parts.param_names(TAIL) == ["model.norm.weight", "lm_head.weight"]
    assert parts.param_names(EMBED) == ["model.embed_tokens.weight"]
    assert parts.param_bytes(TAIL) == (512 * 64 + 64) * 4 and parts.param_bytes(EMBED) == 512 * 64 * 4


def test_bad_names_and_unsupported_models():
    parts = find_parts(build_model("qwen3-tiny"))
    with pytest.raises(KeyError, match="layer9"):
        parts.prefixes("layer9")
    with pytest.raises(KeyError, match="rotary"):
        parts.block_of("model.rotary_emb.inv_freq")
    with pytest.raises(KeyError, match="no block"):
        parts.block_of("foo.bar")
    with pytest.raises(UnsupportedModelError, match="base model"):
        find_parts(torch.nn.Linear(2, 2))
