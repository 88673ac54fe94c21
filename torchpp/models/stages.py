"""One pipeline stage of a HuggingFace causal LM, built on its rank alone.

The whole model is constructed on the meta device (no memory), every module the stage does
not own is dropped, and only what is left is materialised: with a preset it is initialised
per parameter name (``presets.init_parameters``), so the stage holds exactly the tensors the
whole model would hold; with a local checkpoint only the stage's tensors are read (safetensors
``safe_open``). Parameter names stay the HF names (``model.layers.5.mlp.up_proj.weight``), so
checkpoints written by the stages together load into the HF model.

A stage computes exactly what the whole model computes: positions are rebuilt per stage,
rotary cos/sin are recomputed from the stage's own ``rotary_emb`` buffers, the causal mask is
rebuilt per stage with the model's own ``create_causal_mask`` (eager attention without a mask
would silently attend to the future), and each layer keeps its original index.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Protocol

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .presets import DTYPES, ModelSpecError, init_parameters, is_preset


# ----------------------------------------------------------------------------- where the blocks live
@dataclass(frozen=True, slots=True)
class ArchParts:
    """Module paths of one architecture's blocks inside its ``*ForCausalLM``."""

    family: str
    """How the decoder layers are called: "llama" (rotary, position_embeddings=) or "gpt2" (learned positions)."""
    embed: tuple[str, ...]
    layers: str
    norm: str
    lm_head: str
    rotary: str | None

    @property
    def embed_weight(self) -> str:
        """The parameter a tied lm_head shares."""
        return f"{self.embed[0]}.weight"


_LLAMA_LIKE = ArchParts("llama", ("model.embed_tokens",), "model.layers", "model.norm", "lm_head", "model.rotary_emb")
_GPT2 = ArchParts("gpt2", ("transformer.wte", "transformer.wpe"), "transformer.h", "transformer.ln_f", "lm_head", None)
ARCHS = {"llama": _LLAMA_LIKE, "qwen2": _LLAMA_LIKE, "qwen3": _LLAMA_LIKE, "mistral": _LLAMA_LIKE, "gpt2": _GPT2}


def arch_parts(cfg) -> ArchParts:
    mt = getattr(cfg, "model_type", "")
    if mt not in ARCHS:
        raise ModelSpecError(f"model_type {mt!r}: expected one of {', '.join(sorted(ARCHS))} (architectures torchpp "
                             "can cut into stages)")
    return ARCHS[mt]


def _get(root: nn.Module, path: str) -> nn.Module | None:
    m = root
    for part in path.split("."):
        m = getattr(m, part, None)
        if m is None:
            return None
    return m


def _set(root: nn.Module, path: str, value: nn.Module | None) -> None:
    parent, _, leaf = path.rpartition(".")
    setattr(_get(root, parent) if parent else root, leaf, value)


# ----------------------------------------------------------------------------- the stage
class BlockObserver(Protocol):
    """Told when each block (``embed``, ``layer<i>``, ``tail``) starts and ends its forward."""

    def begin(self, name: str) -> None: ...

    def end(self, name: str, inp: torch.Tensor | None, out: torch.Tensor) -> None: ...


@dataclass(frozen=True, slots=True)
class StageSpec:
    """What a rank owns: a layer range, the embed and/or tail, and which layers to recompute."""

    layers: tuple[int, int]
    has_embed: bool
    has_tail: bool
    recompute: tuple[bool, ...] = ()
    num_stages: int = 1

    @staticmethod
    def from_plan(plan, index: int) -> "StageSpec":
        s = plan.stages[index]
        return StageSpec(layers=tuple(s.layers), has_embed=s.has_embed, has_tail=s.has_tail,
                         recompute=tuple(s.recompute), num_stages=plan.num_stages)

    @staticmethod
    def whole(num_layers: int) -> "StageSpec":
        return StageSpec(layers=(0, num_layers), has_embed=True, has_tail=True)


class Stage:
    """The pruned HF model of one stage and the forward that stage runs.

    ``module`` is the ``*ForCausalLM`` with foreign blocks removed (set to ``None`` or to an
    empty placeholder inside the layer list, so layer indices and parameter names are kept).
    """

    def __init__(self, module: nn.Module, cfg, spec: StageSpec, parts: ArchParts):
        self.module, self.cfg, self.spec, self.parts = module, cfg, spec, parts
        self.layer_list = _get(module, parts.layers)
        self.profiler: BlockObserver | None = None
        self.tied_copy = bool(getattr(cfg, "tie_word_embeddings", False)) and spec.has_tail and not spec.has_embed

    # -- parameters
    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        return self.module.named_parameters()

    def parameters(self) -> list[nn.Parameter]:
        return list(self.module.parameters())

    def tied_parameter(self) -> nn.Parameter | None:
        """The tied embedding / lm_head weight this stage holds (first or last stage), if tied."""
        if not getattr(self.cfg, "tie_word_embeddings", False) or self.spec.num_stages == 1:
            return None
        if self.spec.has_embed:
            return _get(self.module, self.parts.embed[0]).weight
        if self.spec.has_tail:
            return _get(self.module, self.parts.lm_head).weight
        return None

    def source_name(self, name: str) -> str:
        """The name under which ``name``'s initial value lives in the whole model."""
        if self.tied_copy and name == f"{self.parts.lm_head}.weight":
            return self.parts.embed_weight
        return name

    @property
    def hidden_size(self) -> int:
        return int(getattr(self.cfg, "hidden_size", None) or getattr(self.cfg, "n_embd"))

    @property
    def dtype(self) -> torch.dtype:
        return next(self.module.parameters()).dtype

    def train(self, mode: bool = True) -> "Stage":
        self.module.train(mode)
        return self

    # -- compute
    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None, n_tokens: int | None = None) -> torch.Tensor:
        """Token ids (first stage) or hidden states -> hidden states, or the loss on the last stage.

        The loss is the sum of token cross-entropies over this input divided by ``n_tokens``
        (the count of predicted tokens in the whole global batch), so summing every rank's and
        every micro-batch's losses gives the global mean, as single-process training does.
        """
        spec = self.spec
        prof = self.profiler
        T = x.shape[1]
        pos = torch.arange(T, device=x.device).unsqueeze(0)
        h = x
        if spec.has_embed:
            if prof:
                prof.begin("embed")
            h = self._embed(x, pos)
            if prof:
                prof.end("embed", None, h)
        a, b = spec.layers
        if b > a:
            call = self._layer_caller(h, pos)
            for i in range(a, b):
                rec = spec.recompute[i - a] if spec.recompute else False
                layer = self.layer_list[i]
                if prof:
                    prof.begin(f"layer{i}")
                out = checkpoint(call, layer, i, h, use_reentrant=False) if rec and torch.is_grad_enabled() \
                    else call(layer, i, h)
                if prof:
                    prof.end(f"layer{i}", h, out)
                h = out
        if not spec.has_tail:
            return h
        if labels is None or n_tokens is None:
            raise ValueError("the last stage needs labels and n_tokens to compute the loss")
        if prof:
            prof.begin("tail")
        loss = self.loss(self.logits(h), labels, n_tokens)
        if prof:
            prof.end("tail", h, loss)
        return loss

    def _embed(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        if self.parts.family == "gpt2":
            tr = _get(self.module, "transformer")
            return tr.drop(tr.wte(ids) + tr.wpe(pos))
        return _get(self.module, self.parts.embed[0])(ids)

    def _layer_caller(self, h: torch.Tensor, pos: torch.Tensor) -> Callable:
        """A function (layer, index, hidden) -> hidden with this stage's masks and rotary."""
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        cfg = self.cfg
        kw = dict(config=cfg, inputs_embeds=h, attention_mask=None, past_key_values=None, position_ids=pos)
        if self.parts.family == "gpt2":
            mask = create_causal_mask(**kw)

            def call_gpt2(layer: nn.Module, i: int, x: torch.Tensor) -> torch.Tensor:
                return layer(x, attention_mask=mask, position_ids=pos)
            return call_gpt2
        types = list(getattr(cfg, "layer_types", None) or ["full_attention"] * self.spec.layers[1])
        masks = {"full_attention": create_causal_mask(**kw)}
        if "sliding_attention" in types:
            masks["sliding_attention"] = create_sliding_window_causal_mask(**kw)
        pe = _get(self.module, self.parts.rotary)(h, pos)

        def call_llama(layer: nn.Module, i: int, x: torch.Tensor) -> torch.Tensor:
            return layer(x, attention_mask=masks[types[i]], position_ids=pos, position_embeddings=pe)
        return call_llama

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        h = _get(self.module, self.parts.norm)(h)
        return _get(self.module, self.parts.lm_head)(h)

    @staticmethod
    def loss(logits: torch.Tensor, labels: torch.Tensor, n_tokens: int) -> torch.Tensor:
        """HF's causal-LM loss (shift by one, ignore -100, fp32) summed, divided by ``n_tokens``."""
        shift = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
        ce = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), shift.reshape(-1),
                                               ignore_index=-100, reduction="sum")
        return ce / n_tokens


def count_targets(labels: torch.Tensor) -> int:
    """Predicted tokens of a batch: every position whose next label is not -100."""
    return int((labels[..., 1:] != -100).sum())


# ----------------------------------------------------------------------------- building
def build_stage(model: str, cfg, spec: StageSpec, *, seed: int = 0, dtype: str = "float32",
                weights: str | Path | None = None) -> Stage:
    """Materialise only ``spec``'s modules; weights from ``weights`` (a directory with safetensors)
    or, for a preset, the seeded per-name init; a local model path loads its own checkpoint."""
    from transformers import AutoModelForCausalLM

    if dtype not in DTYPES:
        raise ModelSpecError(f"dtype: expected one of {', '.join(DTYPES)}, got {dtype!r}")
    parts = arch_parts(cfg)
    n = int(getattr(cfg, "num_hidden_layers", None) or getattr(cfg, "n_layer"))
    a, b = spec.layers
    if not (0 <= a <= b <= n):
        raise ModelSpecError(f"stage layers [{a}, {b}): expected a range inside the model's {n} layers")
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(cfg, dtype=DTYPES[dtype])
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    layers = _get(hf, parts.layers)
    for i in range(n):
        if not a <= i < b:
            layers[i] = nn.Module()  # placeholder keeps the original index of every owned layer
    if not spec.has_embed:
        for p in parts.embed:
            _set(hf, p, None)
        if parts.family == "gpt2":
            _set(hf, "transformer.drop", None)
    if not spec.has_tail:
        _set(hf, parts.norm, None)
        _set(hf, parts.lm_head, None)
    rotary_cls = type(_get(hf, parts.rotary)) if parts.rotary else None
    hf.to_empty(device="cpu")
    if rotary_cls is not None:  # buffers computed in __init__: rebuild them for real
        _set(hf, parts.rotary, rotary_cls(config=cfg))
    if tied and spec.has_embed and spec.has_tail:
        _get(hf, parts.lm_head).weight = _get(hf, parts.embed[0]).weight
    stage = Stage(hf, cfg, spec, parts)
    source = weights if weights is not None else (None if is_preset(model) else model)
    if source is None:
        _init_stage(stage, seed, float(getattr(cfg, "initializer_range", 0.02)))
    else:
        load_stage_weights(stage, source)
    hf.train()
    return stage


@torch.no_grad()
def _init_stage(stage: Stage, seed: int, std: float) -> None:
    names = [n for n, _ in stage.named_parameters()]
    plain = [n for n in names if stage.source_name(n) == n]
    init_parameters(stage.module, seed, std, names=plain)
    for n in names:
        src = stage.source_name(n)
        if src != n:  # a tied copy: initialise it as the parameter it copies
            holder = _holder(src, dict(stage.named_parameters())[n])
            init_parameters(holder, seed, std, names=[src])


def _holder(name: str, param: nn.Parameter) -> nn.Module:
    """A module tree in which ``param`` is reachable under ``name``."""
    root = nn.Module()
    m = root
    *path, leaf = name.split(".")
    for part in path:
        child = nn.Module()
        setattr(m, part, child)
        m = child
    setattr(m, leaf, param)
    return root


# ----------------------------------------------------------------------------- loading tensors by name
def safetensors_index(directory: str | Path) -> dict[str, Path]:
    """name -> file of a HF checkpoint directory (sharded index or a single model.safetensors)."""
    d = Path(directory)
    idx = d / "model.safetensors.index.json"
    if idx.is_file():
        wm = json.loads(idx.read_text()).get("weight_map")
        if not isinstance(wm, dict):
            raise ModelSpecError(f"{idx}: field 'weight_map': expected an object name -> file")
        return {k: d / v for k, v in wm.items()}
    single = d / "model.safetensors"
    if single.is_file():
        from safetensors import safe_open

        with safe_open(str(single), framework="pt") as f:
            return {k: single for k in f.keys()}
    raise ModelSpecError(f"{d}: expected model.safetensors or model.safetensors.index.json (safetensors weights)")


def read_tensors(directory: str | Path, names: list[str], aliases: dict[str, str] | None = None) -> dict[str, torch.Tensor]:
    """Read only ``names`` (falling back to ``aliases[name]``) from a safetensors checkpoint."""
    from safetensors import safe_open

    index = safetensors_index(directory)
    aliases = aliases or {}
    by_file: dict[Path, list[tuple[str, str]]] = {}
    for n in names:
        key = n if n in index else aliases.get(n)
        if key is None or key not in index:
            raise ModelSpecError(f"{directory}: tensor {n!r} is missing from the checkpoint")
        by_file.setdefault(index[key], []).append((n, key))
    out: dict[str, torch.Tensor] = {}
    for path, pairs in by_file.items():
        if not path.is_file():
            raise ModelSpecError(f"{path}: file named by the checkpoint index does not exist")
        with safe_open(str(path), framework="pt") as f:
            for n, key in pairs:
                out[n] = f.get_tensor(key)
    return out


@torch.no_grad()
def load_stage_weights(stage: Stage, directory: str | Path) -> None:
    params = dict(stage.named_parameters())
    aliases = {n: stage.source_name(n) for n in params if stage.source_name(n) != n}
    tensors = read_tensors(directory, list(params), aliases)
    for n, p in params.items():
        t = tensors[n]
        if tuple(t.shape) != tuple(p.shape):
            raise ModelSpecError(f"{directory}: tensor {n!r}: expected shape {tuple(p.shape)}, got {tuple(t.shape)}")
        p.copy_(t.to(p.dtype))
