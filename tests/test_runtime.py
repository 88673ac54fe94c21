"""The runtime trains exactly what single-process training trains.

Each case runs two optimizer steps of a real pipeline (gloo, one process per rank) and
compares every weight, loaded back from the checkpoint the run wrote (so the stages' files
together must form the HF model), and both losses against plain HF training on the whole
global batch.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from dist_harness import run_cases
from torchpp.data import SyntheticTokens
from torchpp.models.presets import build_model, load_config, model_info
from torchpp.models.stages import read_tensors, safetensors_index
from torchpp.planner.simple import make_plan

SEQ = 16
STEPS = 2


@dataclass(frozen=True)
class Case:
    model: str
    layers: list[tuple[int, int]]
    groups: list[int]
    mbs: int
    m: int
    schedule: str
    recompute: list[list[bool]]
    shares: list[list[float]] | None = None
    optimizer: str = "adamw"
    lr: float = 1e-3
    eps: float = 1e-6
    """AdamW divides by sqrt(v) + eps: with the default 1e-8, a gradient element that is zero up to
    fp32 rounding (1e-10) moves by up to lr / 100 depending on the rounding, which any change of
    summation order (a sample split across ranks) changes. 1e-6 keeps that below 1e-7."""


CASES = {
    # 2-stage uneven pipeline, tied embeddings synced across stages, 1F1B
    "qwen3_pp2_uneven_1f1b": Case("qwen3-tiny", [(0, 3), (3, 4)], [1, 1], 2, 4, "1f1b", [[False] * 3, [False]]),
    # 3-stage uneven pipeline, GPipe, recompute on some layers
    "qwen3_pp3_uneven_gpipe_recompute": Case("qwen3-tiny", [(0, 1), (1, 3), (3, 4)], [1, 1, 1], 1, 3, "gpipe",
                                             [[True], [False, True], [True]]),
    # hybrid (2, 1) with unequal shares: stage 1 receives one micro-batch from two ranks; untied
    "llama_hybrid21_shares_1f1b": Case("llama-tiny", [(0, 1), (1, 4)], [2, 1], 3, 2, "1f1b",
                                       [[False], [True, False, True]], shares=[[2.0, 1.0], [1.0]]),
    # hybrid (1, 2): the tied last stage is a group of two unequal ranks
    "qwen3_hybrid12_tied_gpipe": Case("qwen3-tiny", [(0, 2), (2, 4)], [1, 2], 3, 2, "gpipe",
                                      [[False, False], [True, True]], shares=[[1.0], [1.0, 2.0]]),
    # pure data parallel over 3 ranks with unequal shares (eager attention: masks must be rebuilt)
    "gpt2_dp3_shares": Case("gpt2-tiny", [(0, 4)], [3], 4, 2, "1f1b", [[False] * 4], shares=[[2.0, 1.0, 1.0]]),
    # 3-stage GPT-2 (learned positions, eager attention in every stage), SGD
    "gpt2_pp3_1f1b_sgd": Case("gpt2-tiny", [(0, 2), (2, 3), (3, 4)], [1, 1, 1], 1, 4, "1f1b",
                              [[False, True], [False], [True]], optimizer="sgd", lr=0.5),
}


def _plan(case: Case, path: Path) -> Path:
    info = model_info(load_config(case.model), case.model)
    plan = make_plan(info, seq_len=SEQ, global_batch=case.mbs * case.m, num_microbatches=case.m,
                     layer_ranges=case.layers, group_sizes=case.groups, schedule=case.schedule, shares=case.shares)
    for st, flags in zip(plan.stages, case.recompute):
        st.recompute = list(flags)
    plan.save(path)
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("runtime")
    specs, dirs = [], {}
    for name, case in CASES.items():
        d = root / name
        d.mkdir()
        dirs[name] = d
        specs.append({"world_size": sum(case.groups), "result": str(d / "result.json"), "config": dict(
            plan=_plan(case, d / "plan.json"), steps=STEPS, lr=case.lr, optimizer=case.optimizer, seed=7,
            adam_eps=case.eps,
            threads=1, checkpoint_dir=d / "ckpt", timeout_s=60.0)})
    run_cases(specs, nprocs=3, workdir=root, timeout_s=420)
    return dirs


def reference(case: Case) -> tuple[torch.nn.Module, list[float]]:
    """Plain HF training of the whole model on the whole global batch."""
    torch.manual_seed(0)
    model = build_model(case.model, seed=7)
    if case.optimizer == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=case.lr)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=case.lr, weight_decay=0.0, eps=case.eps)
    data = SyntheticTokens(vocab_size=model.config.vocab_size, seq_len=SEQ, global_batch=case.mbs * case.m, seed=7)
    losses = []
    for step in range(STEPS):
        ids = data.batch(step)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return model, losses


@pytest.mark.parametrize("name", list(CASES))
def test_weights_equal_single_process(runs, name):
    case = CASES[name]
    ref, ref_losses = reference(case)
    d = runs[name]
    got_losses = json.loads((d / "result.json").read_text())["losses"]
    assert got_losses == pytest.approx(ref_losses, abs=1e-5)
    step_dir = d / "ckpt" / f"step_{STEPS:08d}"
    index = safetensors_index(step_dir)
    names = [n for n, _ in ref.named_parameters()]
    tensors = read_tensors(step_dir, names)
    worst = max((float((tensors[n] - p.detach()).abs().max()), n) for n, p in ref.named_parameters())
    assert worst[0] < 1e-5, f"largest difference {worst[0]:.3g} in {worst[1]}"
    # the weights really moved (a run that did nothing would not be close to the reference anyway)
    init = build_model(case.model, seed=7)
    moved = max(float((p.detach() - q.detach()).abs().max()) for p, q in zip(ref.parameters(), init.parameters()))
    assert moved > 1e-4
    if ref.config.tie_word_embeddings and len(case.layers) > 1:
        # the last stage's own copy of the tied weight stayed in sync with the embedding
        head = read_tensors(step_dir, ["lm_head.weight"])["lm_head.weight"]
        assert "lm_head.weight" in index
        assert float((head - ref.get_output_embeddings().weight.detach()).abs().max()) < 1e-5


def test_checkpoint_loads_into_hf_model(runs):
    from transformers import AutoModelForCausalLM

    case = CASES["llama_hybrid21_shares_1f1b"]
    ref, _ = reference(case)
    step_dir = runs["llama_hybrid21_shares_1f1b"] / "ckpt" / f"step_{STEPS:08d}"
    loaded = AutoModelForCausalLM.from_pretrained(str(step_dir), local_files_only=True)
    for (n, p), (_, q) in zip(ref.named_parameters(), loaded.named_parameters()):
        assert float((p.detach() - q.detach()).abs().max()) < 1e-5, n
    manifest = json.loads((step_dir / "manifest.json").read_text())
    assert manifest["step"] == STEPS and set(manifest["files"]) == {
        "model-stage0.safetensors", "model-stage1.safetensors", "optim-stage0.safetensors", "optim-stage1.safetensors"}
