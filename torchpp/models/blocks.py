"""Find the blocks of a HuggingFace causal LM: embed, each decoder layer, tail.

Every architecture torchpp supports keeps its decoder layers in one ``nn.ModuleList``
(Qwen2/3, Llama, Mistral: ``model.layers``; GPT-2: ``transformer.h``). Around it sit the
embedding modules (GPT-2: ``wte`` + ``wpe`` + ``drop``), an optional rotary-embedding module
(buffers only; every pipeline stage keeps its own), the final norm and ``lm_head``. Profiling,
stage cutting and parameter selection all go through :class:`ModelParts` so that the names
used for a block are the same everywhere:

- ``"embed"``: the embedding modules,
- ``"layer<i>"``: decoder layer *i* (its original index),
- ``"tail"``: final norm + lm_head (+ the loss, which has no parameters).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch
from torch import nn

EMBED, TAIL = "embed", "tail"
# Attribute names (on the base model) of the modules that make up each block, in the order
# the forward runs them. The first name of each list found on the base model is used,
# except for embeddings, where every name found belongs to the block.
_EMBED_NAMES = ("embed_tokens", "wte", "word_embeddings", "embed_in", "wpe", "embed_positions", "drop", "embed_dropout",
                "emb_dropout")
_NORM_NAMES = ("norm", "ln_f", "final_layernorm", "final_layer_norm")
_LAYER_LIST_NAMES = ("layers", "h", "layer", "blocks")
_ROTARY_NAMES = ("rotary_emb",)


class UnsupportedModelError(ValueError):
    """The model's decoder layers do not form a list torchpp can cut into blocks."""


def layer_block(i: int) -> str:
    return f"layer{i}"


def block_names(num_layers: int) -> list[str]:
    """All block names in forward order: embed, layer0 .. layer{N-1}, tail."""
    return [EMBED, *(layer_block(i) for i in range(num_layers)), TAIL]


@dataclass
class ModelParts:
    """Where each block of one causal LM lives (modules and HF attribute paths)."""

    model: nn.Module
    base_path: str
    """Attribute path of the base model inside the causal LM ("model", "transformer")."""
    embed_paths: list[str]
    """Full attribute paths of the embedding modules, in forward order."""
    layers_path: str
    """Full attribute path of the decoder layer list ("model.layers", "transformer.h")."""
    norm_path: str
    lm_head_path: str
    rotary_path: str | None
    tied_embeddings: bool

    # ------------------------------------------------------------------ modules
    def get(self, path: str) -> nn.Module:
        return self.model.get_submodule(path)

    @property
    def base(self) -> nn.Module:
        return self.get(self.base_path)

    @property
    def embeddings(self) -> list[nn.Module]:
        return [self.get(p) for p in self.embed_paths]

    @property
    def layers(self) -> nn.ModuleList:
        return self.get(self.layers_path)  # type: ignore[return-value]

    @property
    def norm(self) -> nn.Module:
        return self.get(self.norm_path)

    @property
    def lm_head(self) -> nn.Module:
        return self.get(self.lm_head_path)

    @property
    def rotary_emb(self) -> nn.Module | None:
        return None if self.rotary_path is None else self.get(self.rotary_path)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def block_names(self) -> list[str]:
        return block_names(self.num_layers)

    def block_modules(self, block: str) -> list[nn.Module]:
        """Modules that hold the block's parameters, in forward order."""
        if block == EMBED:
            return self.embeddings
        if block == TAIL:
            return [self.norm, self.lm_head]
        return [self.layers[self._layer_index(block)]]

    # ------------------------------------------------------------------ parameters by block
    def prefixes(self, block: str) -> tuple[str, ...]:
        """HF parameter-name prefixes (each ending in '.') of a block's parameters."""
        if block == EMBED:
            return tuple(f"{p}." for p in self.embed_paths)
        if block == TAIL:
            return (f"{self.norm_path}.", f"{self.lm_head_path}.")
        return (f"{self.layers_path}.{self._layer_index(block)}.",)

    def block_of(self, param_name: str) -> str:
        """The block a parameter (or buffer) name belongs to; raises KeyError if none."""
        if self.rotary_path and param_name.startswith(f"{self.rotary_path}."):
            raise KeyError(f"{param_name!r} belongs to the rotary embedding (shared by every stage, not a block)")
        for p in (f"{x}." for x in self.embed_paths):
            if param_name.startswith(p):
                return EMBED
        if param_name.startswith(f"{self.layers_path}."):
            idx = param_name[len(self.layers_path) + 1:].split(".", 1)[0]
            if idx.isdigit() and int(idx) < self.num_layers:
                return layer_block(int(idx))
        if param_name.startswith((f"{self.norm_path}.", f"{self.lm_head_path}.")):
            return TAIL
        raise KeyError(f"parameter {param_name!r} is in no block of {type(self.model).__name__}")

    def named_parameters(self, block: str) -> Iterator[tuple[str, nn.Parameter]]:
        """Parameters of a block by HF name. A tied lm_head weight appears in both embed and
        tail (each pipeline end holds its own copy)."""
        pre = self.prefixes(block)
        for name, p in self.model.named_parameters(remove_duplicate=False):
            if name.startswith(pre):
                yield name, p

    def param_names(self, block: str) -> list[str]:
        return [n for n, _ in self.named_parameters(block)]

    def param_bytes(self, block: str) -> int:
        """Parameter count × element size of the block (tied weights counted in both ends)."""
        return sum(p.numel() * p.element_size() for _, p in self.named_parameters(block))

    def _layer_index(self, block: str) -> int:
        if not block.startswith("layer") or not block[5:].isdigit():
            raise KeyError(f"unknown block {block!r}; expected {EMBED!r}, 'layer<i>' or {TAIL!r}")
        i = int(block[5:])
        if i >= self.num_layers:
            raise KeyError(f"block {block!r}: the model has {self.num_layers} decoder layers")
        return i


def find_parts(model: nn.Module) -> ModelParts:
    """Locate embed, decoder layers, final norm, lm_head and rotary embedding of a causal LM."""
    kind = type(model).__name__
    prefix = getattr(model, "base_model_prefix", "") or ""
    if not prefix or not isinstance(getattr(model, prefix, None), nn.Module):
        raise UnsupportedModelError(f"{kind}: no base model attribute (base_model_prefix={prefix!r})")
    base = getattr(model, prefix)
    children = dict(base.named_children())

    def pick(names: tuple[str, ...], what: str) -> str:
        for n in names:
            if n in children:
                return n
        raise UnsupportedModelError(f"{kind}: no {what} (looked for {', '.join(names)} on {prefix})")

    layers_name = pick(_LAYER_LIST_NAMES, "decoder layer list")
    if not isinstance(children[layers_name], nn.ModuleList):
        raise UnsupportedModelError(f"{kind}: {prefix}.{layers_name} is not an nn.ModuleList")
    norm_name = pick(_NORM_NAMES, "final norm")
    embed_names = [n for n in _EMBED_NAMES if n in children]
    in_emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if not embed_names or (in_emb is not None and all(children[n] is not in_emb for n in embed_names)):
        raise UnsupportedModelError(f"{kind}: no token embedding found on {prefix}")
    # Keep the order the modules were registered in (the order the forward uses them).
    order = list(children)
    embed_names.sort(key=order.index)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head_name = next((n for n, m in model.named_children() if m is head), None) if head is not None else None
    if head_name is None:
        raise UnsupportedModelError(f"{kind}: no lm_head (get_output_embeddings() is not a child module)")
    rotary = next((n for n in _ROTARY_NAMES if n in children), None)
    _check_all_placed(kind, prefix, children, {*embed_names, layers_name, norm_name, rotary})
    tied = head.weight is in_emb.weight if in_emb is not None and hasattr(head, "weight") else False
    return ModelParts(model=model, base_path=prefix, embed_paths=[f"{prefix}.{n}" for n in embed_names],
                      layers_path=f"{prefix}.{layers_name}", norm_path=f"{prefix}.{norm_name}",
                      lm_head_path=head_name, rotary_path=None if rotary is None else f"{prefix}.{rotary}",
                      tied_embeddings=bool(tied))


def _check_all_placed(kind: str, prefix: str, children: dict[str, nn.Module], placed: set) -> None:
    """Refuse a base model with a module in no block: its forward would silently be skipped."""
    stray = [n for n, m in children.items() if n not in placed
             and (any(True for _ in m.parameters()) or any(True for _ in m.buffers()))]
    if stray:
        raise UnsupportedModelError(f"{kind}: module {prefix}.{stray[0]} is in no block (torchpp runs only embeddings, "
                                    "decoder layers, the final norm and the rotary embedding)")


def dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
