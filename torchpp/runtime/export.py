"""The trained model as a HF checkpoint directory, loadable as it is by
``AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer.from_pretrained``.

Step checkpoints (``checkpoint.py``) keep the in-memory parameter names so a run resumes
exactly; this export writes what ``save_pretrained`` would: weights under HF's on-disk names
(its key conversions reverted, e.g. fused MoE experts split back per expert), one tied weight,
``config.json``, ``generation_config.json`` and the tokenizer files of the model directory the
run started from. Each stage's writer writes its own shard, so no rank holds the whole model.
"""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

from ..formats import write_json
from ..models.stages import Stage, StageSet
from .checkpoint import Roles, _atomic, _save_safetensors
from .exchange import all_gather_json

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "tokenizer.model", "added_tokens.json", "chat_template.jinja", "chat_template.json", "vocab.txt",
                   "spiece.model")
INDEX = "model.safetensors.index.json"


def hf_state(stage: Stage) -> dict[str, torch.Tensor]:
    """The stage's weights as ``save_pretrained`` names them on disk (a tied lm_head is left out,
    as HF saves it)."""
    from transformers.core_model_loading import revert_weight_conversion

    state = {n: p.detach().contiguous() for n, p in stage.named_parameters()
             if not (stage.tied_copy and n == f"{stage.parts.lm_head}.weight")}
    return {n: t.contiguous() for n, t in revert_weight_conversion(stage.module, state).items()}


def export_hf(out: str | Path, *, roles: Roles, stage: Stage | StageSet, source: str | None) -> Path | None:
    """All ranks call this after the last step; returns ``out`` on the ranks that wrote its index.

    ``source``: the model directory the run started from (its tokenizer and generation config
    are copied), None for a preset (a generation config is derived from the model config)."""
    d = Path(out)
    d.mkdir(parents=True, exist_ok=True)
    names: list[str] = []
    stages = list(stage.chunks.values()) if isinstance(stage, StageSet) else [stage]
    if roles.writes_stage:
        state = {n: t for st in stages for n, t in hf_state(st).items()}
        _save_safetensors(d / f"model-stage{roles.stage}.safetensors", state)
        names = sorted(state)
    parts = all_gather_json([roles.stage, names])  # also the barrier: every shard is in place
    if not roles.writes_manifest:
        return None
    weight_map = {n: f"model-stage{s}.safetensors" for s, ns in parts for n in ns}
    _atomic(d / "config.json", lambda tmp: stages[0].cfg.to_json_file(tmp))
    _write_generation_config(d, stages[0].cfg, source)
    copy_tokenizer(source, d)
    write_json(d / INDEX, {"metadata": {"format": "pt"}, "weight_map": weight_map})
    return d


def _write_generation_config(d: Path, cfg: Any, source: str | None) -> None:
    src = Path(source) / "generation_config.json" if source else None
    if src is not None and src.is_file():
        shutil.copyfile(src, d / "generation_config.json")
        return
    from transformers import GenerationConfig

    GenerationConfig.from_model_config(cfg).save_pretrained(str(d))


def copy_tokenizer(source: str | None, d: Path) -> list[str]:
    """Copy the tokenizer files ``source`` has; returns their names."""
    if not source or not Path(source).is_dir():
        return []
    copied = []
    for name in TOKENIZER_FILES:
        f = Path(source) / name
        if f.is_file():
            shutil.copyfile(f, d / name)
            copied.append(name)
    return copied
