"""The supported-architecture matrix: every family trains exactly as plain HF trains it, or is refused.

Each family is a tiny random checkpoint written here with ``save_pretrained`` (safetensors,
nothing downloaded). Plain HF training (HF's own loss, AdamW, the same batches) is the
reference; torchpp's stages are trained for two steps on one rank (one stage holding the whole
model) and as a 2-stage pipeline chained in this process (the activation's gradient crosses the
boundary, the tied embedding's two copies are summed as the runtime's all-reduce does). Losses
and every weight must agree within 1e-5. A family torchpp cannot run exactly must be refused by
``load_config`` (which ``plan``, ``profile`` and ``train`` call) with one line naming the feature.
A few families also run through the real multi-process runtime.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers as T

from dist_harness import run_cases
from torchpp.models.presets import ModelSpecError, load_config, model_info
from torchpp.models.stages import Stage, StageSpec, build_stage, count_targets, read_tensors
from torchpp.planner.simple import make_plan

SEQ, BATCH, STEPS, VOCAB = 12, 2, 2, 128
BASE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)

# family -> (config class, overrides, tie settings to check)
FAMILIES: dict[str, tuple[type, dict, tuple[bool, ...]]] = {
    "llama": (T.LlamaConfig, {}, (False, True)),
    "smollm": (T.LlamaConfig, dict(tie_word_embeddings=True, rope_theta=100000.0), (True,)),
    "qwen2": (T.Qwen2Config, {}, (False, True)),
    "qwen3": (T.Qwen3Config, dict(head_dim=8), (False, True)),
    "mistral-sliding": (T.MistralConfig, dict(sliding_window=4), (False,)),
    "phi3": (T.Phi3Config, {}, (False,)),
    "phi": (T.PhiConfig, {}, (False,)),
    "olmo2": (T.Olmo2Config, {}, (False,)),
    "stablelm": (T.StableLmConfig, {}, (False,)),
    "gemma": (T.GemmaConfig, dict(head_dim=8), (True,)),
    "gemma2": (T.Gemma2Config, dict(head_dim=8, sliding_window=4), (True,)),
    "gemma3": (T.Gemma3TextConfig, dict(head_dim=8, sliding_window=4), (True,)),
    "granite": (T.GraniteConfig, dict(embedding_multiplier=3.0, logits_scaling=2.0, residual_multiplier=0.5,
                                      attention_multiplier=0.3), (False, True)),
    "falcon": (T.FalconConfig, dict(num_kv_heads=2, new_decoder_architecture=False, alibi=False), (True,)),
    "qwen3-moe": (T.Qwen3MoeConfig, dict(head_dim=8, num_experts=4, num_experts_per_tok=2,
                                         moe_intermediate_size=16), (False,)),
    "mixtral": (T.MixtralConfig, dict(num_local_experts=4, num_experts_per_tok=2), (False,)),
    "gpt-neox": (T.GPTNeoXConfig, {}, (False,)),
    "gpt2": (T.GPT2Config, dict(n_embd=32, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
                                attn_pdrop=0.0), (True,)),
}
# family -> (config class, overrides, the feature the refusal names)
REFUSED: dict[str, tuple[type, dict, str]] = {
    "falcon-alibi": (T.FalconConfig, dict(num_kv_heads=2, new_decoder_architecture=False, alibi=True), "ALiBi"),
    "bloom": (T.BloomConfig, dict(n_head=4, n_layer=2), "word_embeddings_layernorm"),
    "opt": (T.OPTConfig, dict(ffn_dim=64, word_embed_proj_dim=32), "decoder layer list"),
}


def checkpoint(root: Path, cls: type, overrides: dict, tied: bool | None = None) -> str:
    """A tiny random HF checkpoint directory (seeded), as a user's ``save_pretrained`` writes it."""
    kw = {**BASE, **overrides}
    if tied is not None:
        kw["tie_word_embeddings"] = tied
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(cls(**kw))
    d = root / f"{cls.__name__}_{tied}_{abs(hash(json.dumps(overrides, sort_keys=True))) % 10**6}"
    model.save_pretrained(d)
    return str(d)


def batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, VOCAB, (BATCH, SEQ), generator=g) for _ in range(STEPS)]


def adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.0, eps=1e-6)


def hf_reference(path: str) -> tuple[list[float], dict[str, torch.Tensor], set[str]]:
    """Plain HF training: ``from_pretrained`` with torchpp's config, HF's own loss, AdamW."""
    model = T.AutoModelForCausalLM.from_pretrained(path, config=load_config(path), local_files_only=True)
    model.train()
    opt, losses = adamw(model.parameters()), []
    for ids in batches():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return (losses, {n: p.detach() for n, p in model.named_parameters(remove_duplicate=False)},
            {n for n, _ in model.named_parameters()})


def torchpp_train(path: str, cuts: list[tuple[int, int]], keys: bool = False) -> tuple[list[float], list[Stage]]:
    """torchpp's stages chained in one process: forward through each, gradients back across
    each boundary, the tied copies' gradients summed, one AdamW per stage."""
    cfg = load_config(path)
    n = len(cuts)
    stages = [build_stage(path, cfg, StageSpec(layers=c, has_embed=k == 0, has_tail=k == n - 1, num_stages=n))
              for k, c in enumerate(cuts)]
    opts = [adamw(st.parameters()) for st in stages]
    losses = []
    for step, ids in enumerate(batches()):
        h, outs = ids, []
        for st in stages:
            st.rng_key = (step, 0) if keys else None
            x = h if st.spec.has_embed else h.detach().requires_grad_(True)
            h = st.forward(x, labels=ids, n_tokens=count_targets(ids))
            outs.append((x, h))
        outs[-1][1].backward()
        for k in range(n - 2, -1, -1):
            outs[k][1].backward(outs[k + 1][0].grad)
        tied = [st.tied_parameter() for st in stages if st.tied_parameter() is not None]
        if len(tied) == 2:
            total = tied[0].grad + tied[1].grad
            tied[0].grad, tied[1].grad = total.clone(), total.clone()
        for o in opts:
            o.step()
            o.zero_grad()
        losses.append(float(h))
    return losses, stages


def assert_same_weights(stages: list[Stage], ref: dict[str, torch.Tensor], names: set[str]) -> None:
    """Every weight of the model is held by some stage and equals plain HF's."""
    seen = set()
    for st in stages:
        for name, p in st.named_parameters():
            seen.add(st.source_name(name))
            diff = float((p.detach() - ref[name]).abs().max())
            assert diff < 1e-5, f"{name}: differs from plain HF by {diff:.3g}"
    assert seen == names


CASES = [(f, t) for f, (_, _, ties) in FAMILIES.items() for t in ties]


@pytest.mark.parametrize("family,tied", CASES, ids=[f"{f}-{'tied' if t else 'untied'}" for f, t in CASES])
def test_family_trains_as_hf(tmp_path, family, tied):
    cls, overrides, _ = FAMILIES[family]
    path = checkpoint(tmp_path, cls, overrides, tied)
    ref_losses, ref, names = hf_reference(path)
    n = load_config(path).num_hidden_layers
    for cuts in ([(0, n)], [(0, 1), (1, n)]):
        losses, stages = torchpp_train(path, cuts)
        assert losses == pytest.approx(ref_losses, abs=1e-5), cuts
        assert_same_weights(stages, ref, names)


@pytest.mark.parametrize("family", list(REFUSED))
def test_family_is_refused_with_one_line(tmp_path, family):
    cls, overrides, feature = REFUSED[family]
    path = checkpoint(tmp_path, cls, overrides)
    with pytest.raises(ModelSpecError, match="torchpp does not support") as e:
        load_config(path)
    assert feature in str(e.value) and "\n" not in str(e.value)


def test_buffers_are_built_for_real(tmp_path):
    """Gemma's non-persistent ``embed_scale`` is sqrt(hidden), not whatever memory held."""
    path = checkpoint(tmp_path, T.GemmaConfig, dict(head_dim=8), True)
    st = build_stage(path, load_config(path), StageSpec(layers=(0, 1), has_embed=True, has_tail=False, num_stages=2))
    assert float(st.module.model.embed_tokens.embed_scale) == pytest.approx(32 ** 0.5)


def test_dropout_is_the_same_whatever_the_split(tmp_path):
    """GPT-2 with its default dropout 0.1: the pipeline draws the masks one rank draws."""
    path = checkpoint(tmp_path, T.GPT2Config, dict(n_embd=32, num_hidden_layers=3, n_head=4, n_positions=64), False)
    one, a = torchpp_train(path, [(0, 3)], keys=True)
    two, b = torchpp_train(path, [(0, 1), (1, 3)], keys=True)
    three, c = torchpp_train(path, [(0, 2), (2, 3)], keys=True)
    assert one == pytest.approx(two, abs=1e-6) and one == pytest.approx(three, abs=1e-6)
    whole = dict(a[0].named_parameters())
    for st in b + c:
        for name, p in st.named_parameters():
            assert float((p - whole[name]).abs().max()) < 1e-6, name
    nodrop, _ = torchpp_train(path, [(0, 3)], keys=False)
    assert abs(nodrop[0] - one[0]) > 1e-4  # dropout really is on


RUNTIME_FAMILIES = ["gemma", "mistral-sliding", "qwen3-moe"]


def test_families_through_the_multiprocess_runtime(tmp_path):
    """A few families through ``torchrun``'s code path: 2 ranks, 1F1B, checkpoint compared with HF."""
    specs, dirs = [], {}
    for fam in RUNTIME_FAMILIES:
        cls, overrides, ties = FAMILIES[fam]
        path = checkpoint(tmp_path, cls, overrides, ties[0])
        d = tmp_path / f"run_{fam}"
        d.mkdir()
        info = model_info(load_config(path), path)
        plan = make_plan(info, seq_len=SEQ, global_batch=BATCH, num_microbatches=2, layer_ranges=[(0, 1), (1, 2)],
                         group_sizes=[1, 1], schedule="1f1b")
        plan.save(d / "plan.json")
        dirs[fam] = (path, d)
        specs.append({"world_size": 2, "result": str(d / "result.json"), "config": dict(
            plan=d / "plan.json", model=path, steps=STEPS, lr=1e-3, adam_eps=1e-6, seed=0, threads=1,
            checkpoint_dir=d / "ckpt", timeout_s=60.0, data="synthetic")})
    run_cases(specs, nprocs=2, workdir=tmp_path, timeout_s=240)
    from torchpp.data import SyntheticTokens

    for fam, (path, d) in dirs.items():
        model = T.AutoModelForCausalLM.from_pretrained(path, config=load_config(path), local_files_only=True)
        opt, ref_losses = adamw(model.parameters()), []
        data = SyntheticTokens(vocab_size=VOCAB, seq_len=SEQ, global_batch=BATCH, seed=0)
        for step in range(STEPS):
            ids = data.batch(step)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            ref_losses.append(loss.item())
        got = json.loads((d / "result.json").read_text())["losses"]
        assert got == pytest.approx(ref_losses, abs=1e-5), fam
        step_dir = d / "ckpt" / f"step_{STEPS:08d}"
        names = [n for n, _ in model.named_parameters()]
        tensors = read_tensors(step_dir, names)
        for n, p in model.named_parameters():
            assert float((tensors[n] - p.detach()).abs().max()) < 1e-5, f"{fam}: {n}"
