"""HF-shaped inputs and outputs: ``pytorch_model.bin`` checkpoints train, ``--model org/name``
comes from the local HF cache, and the run's final directory loads with
``AutoModelForCausalLM``/``AutoTokenizer`` as it is, weights under HF's on-disk names (MoE
experts split per expert as ``save_pretrained`` writes them). Everything is built here.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from dist_harness import RankPool
from torchpp.models.presets import load_config, model_info, resolve_model
from torchpp.models.stages import read_tensors
from torchpp.planner.simple import make_plan

README = Path(__file__).resolve().parents[1] / "README.md"
STEPS = 2


def _tokenizer(d: Path) -> int:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train([str(README)], trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "</s>"]))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(str(d))
    return len(fast)


def _llama_bin(d: Path) -> None:
    """A Llama directory with a tokenizer, a generation config and only pytorch_model.bin."""
    import transformers as T

    d.mkdir()
    vocab = _tokenizer(d)
    cfg = T.LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                        tie_word_embeddings=False, eos_token_id=1)
    torch.manual_seed(0)
    m = T.AutoModelForCausalLM.from_config(cfg)
    cfg.save_pretrained(str(d))
    T.GenerationConfig(eos_token_id=1, max_new_tokens=7).save_pretrained(str(d))
    torch.save({n: p.detach().clone() for n, p in m.state_dict().items()}, d / "pytorch_model.bin")


def _mixtral_in_cache(cache: Path) -> Path:
    """``org/tiny-moe`` in a HF hub cache layout (refs/main -> snapshot), saved by save_pretrained."""
    import transformers as T

    snap = cache / "models--org--tiny-moe" / "snapshots" / "0123abcd"
    snap.mkdir(parents=True)
    (cache / "models--org--tiny-moe" / "refs").mkdir()
    (cache / "models--org--tiny-moe" / "refs" / "main").write_text("0123abcd")
    cfg = T.MixtralConfig(vocab_size=300, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                          max_position_embeddings=64, tie_word_embeddings=False)
    torch.manual_seed(0)
    T.AutoModelForCausalLM.from_config(cfg).save_pretrained(str(snap))
    return snap


def _plan(model: str, path: Path, layers: list[tuple[int, int]]) -> Path:
    info = model_info(load_config(model), model)
    make_plan(info, seq_len=16, global_batch=4, num_microbatches=2, layer_ranges=layers, group_sizes=[1, 1],
              schedule="1f1b").save(path)
    return path


def _train(rank: int, world: int, case: dict) -> None:
    from torchpp.runtime.trainer import TrainConfig, train

    train(TrainConfig(**case))


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    llama = root / "llama_bin"
    _llama_bin(llama)
    cache = root / "hub"
    snap = _mixtral_in_cache(cache)
    old = os.environ.get("HF_HUB_CACHE")
    os.environ["HF_HUB_CACHE"] = str(cache)  # the ranks import huggingface_hub with it
    try:
        with RankPool(2, threads=1) as pool:
            pool.run(_train, dict(plan=_plan(str(llama), root / "p1.json", [(0, 1), (1, 4)]), model=str(llama),
                                  data=str(README), data_cache=root / "cache", steps=STEPS, threads=1,
                                  timeout_s=60.0,
                                  checkpoint_dir=root / "ck_llama"), world=2, timeout_s=300, pg_timeout_s=60)
            pool.run(_train, dict(plan=_plan(str(snap), root / "p2.json", [(0, 1), (1, 2)]), model="org/tiny-moe",
                                  steps=STEPS, threads=1, timeout_s=60.0, checkpoint_dir=root / "ck_moe"),
                     world=2, timeout_s=300, pg_timeout_s=60)
    finally:
        if old is None:
            os.environ.pop("HF_HUB_CACHE", None)
        else:
            os.environ["HF_HUB_CACHE"] = old
    return {"root": root, "llama": llama, "snap": snap}


def _same_as_step_checkpoint(final: Path, step_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(str(final), local_files_only=True)
    names = [n for n, _ in loaded.named_parameters()]
    trained = read_tensors(step_dir, names)
    init = None
    for n, p in loaded.named_parameters():
        assert torch.equal(p.detach(), trained[n]), n
        init = n
    assert init is not None


def test_bin_checkpoint_trains_and_final_directory_loads_with_tokenizer(runs):
    from transformers import AutoTokenizer, GenerationConfig

    final = runs["root"] / "ck_llama" / "final"
    _same_as_step_checkpoint(final, runs["root"] / "ck_llama" / f"step_{STEPS:08d}")
    tok = AutoTokenizer.from_pretrained(str(final), local_files_only=True)
    ref = AutoTokenizer.from_pretrained(str(runs["llama"]), local_files_only=True)
    assert tok("pipeline parallel")["input_ids"] == ref("pipeline parallel")["input_ids"]
    assert GenerationConfig.from_pretrained(str(final)).max_new_tokens == 7
    # the weights moved away from the .bin ones they started from
    start = torch.load(runs["llama"] / "pytorch_model.bin", weights_only=True)
    step = read_tensors(final, ["model.layers.3.mlp.up_proj.weight"])["model.layers.3.mlp.up_proj.weight"]
    assert not torch.equal(step, start["model.layers.3.mlp.up_proj.weight"])


def test_hub_id_from_the_local_cache_and_moe_keys_round_trip(runs):
    from safetensors import safe_open

    final = runs["root"] / "ck_moe" / "final"
    _same_as_step_checkpoint(final, runs["root"] / "ck_moe" / f"step_{STEPS:08d}")
    with safe_open(str(runs["snap"] / "model.safetensors"), framework="pt") as f:
        on_disk = set(f.keys())
    index = json.loads((final / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(index) == on_disk  # HF's own on-disk names: per-expert w1/w2/w3
    assert any(".experts.3.w2." in k for k in index)
    assert (final / "generation_config.json").is_file()


def test_resolve_model_reads_only_the_cache(tmp_path, monkeypatch):
    from huggingface_hub import constants

    snap = _mixtral_in_cache(tmp_path)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    assert Path(resolve_model("org/tiny-moe")) == snap
    assert resolve_model("org/not-cached") == "org/not-cached"
    with pytest.raises(ValueError, match="local HF cache"):
        load_config("org/not-cached")
    assert resolve_model("qwen3-tiny") == "qwen3-tiny"
    shutil.rmtree(snap)
