"""What a HF causal LM's model-level forward does around its decoder layers, read from its config.

A stage re-runs the pieces of ``*Model.forward`` that sit between the blocks: the masks, the
rotary cos/sin, the extra layer arguments and the scalings of the embedding and the logits.
Each is derived from the config and the modules' own signatures with HF's own functions, so a
family is handled by what it declares, not by its name; what torchpp cannot reproduce is
named by :func:`unsupported_feature` so that ``plan``, ``profile`` and ``train`` refuse it.
"""
from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

FULL, SLIDING = "full_attention", "sliding_attention"
_SUPPLIED = {"hidden_states", "attention_mask", "position_ids", "position_embeddings"}


def layer_types(cfg: Any, n: int) -> list[str]:
    """Attention type of each layer: the config's ``layer_types``, else a ``sliding_window`` set
    on the config slides every layer (Mistral, Mixtral, Phi3 build their mask that way)."""
    declared = getattr(cfg, "layer_types", None)
    if declared:
        return list(declared)
    return [SLIDING if getattr(cfg, "sliding_window", None) is not None else FULL] * n


def _signature_params(fn: Any) -> dict[str, inspect.Parameter]:
    try:
        return dict(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return {}


def required_layer_args(layer: nn.Module) -> list[str]:
    """Arguments a decoder layer's forward requires beyond those a stage supplies."""
    params = list(_signature_params(layer.forward).values())[1:]  # the first is the hidden state
    return [p.name for p in params if p.default is inspect.Parameter.empty and p.name not in _SUPPLIED
            and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def layer_inputs(cfg: Any, module: nn.Module, parts: Any, h: torch.Tensor, pos: torch.Tensor, n_layers: int):
    """(masks by type, rotary (cos, sin) by type or None, type of each layer, extra layer kwargs)."""
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    types = layer_types(cfg, n_layers)
    kw = dict(config=cfg, inputs_embeds=h, attention_mask=None, past_key_values=None, position_ids=pos)
    masks = {}
    for t in set(types):
        masks[t] = create_sliding_window_causal_mask(**kw) if t == SLIDING else create_causal_mask(**kw)
    rotary = None
    if parts.rotary is not None:
        rot = module.get_submodule(parts.rotary)
        if "layer_type" in _signature_params(rot.forward):  # Gemma3: one rotary table per attention type
            rotary = {t: rot(h, pos, t) for t in set(types)}
        else:
            pe = rot(h, pos)
            rotary = {t: pe for t in set(types)}
    extra: dict[str, Any] = {}
    owned = [m for m in module.get_submodule(parts.layers) if type(m) is not nn.Module]
    if owned and "alibi" in _signature_params(owned[0].forward):
        extra["alibi"] = None  # Falcon without ALiBi still takes the argument (refused when it is on)
    return masks, rotary, types, extra


def scale_logits(cfg: Any, logits: torch.Tensor) -> torch.Tensor:
    """The scalings HF's ``*ForCausalLM.forward`` applies to the lm_head output."""
    div = getattr(cfg, "logits_scaling", None)  # Granite
    if div is not None and div != 1:
        logits = logits / div
    mul = getattr(cfg, "logit_scale", None)  # Cohere
    if isinstance(mul, (int, float)) and mul != 1:
        logits = logits * mul
    cap = getattr(cfg, "final_logit_softcapping", None)  # Gemma2, Gemma3
    if cap is not None:
        logits = torch.tanh(logits / cap) * cap
    return logits


def unsupported_feature(cfg: Any, model: nn.Module, parts: Any) -> str | None:
    """The feature of ``model`` a stage cannot reproduce exactly, or None when it can
    (``parts``: the :class:`torchpp.models.blocks.ModelParts` of ``model``)."""
    layers = model.get_submodule(parts.layers_path)
    if len(layers):
        missing = required_layer_args(layers[0])
        alibi_on = "alibi" in missing and getattr(cfg, "alibi", True)
        if alibi_on:
            return "ALiBi attention bias (the decoder layers need 'alibi')"
        missing = [a for a in missing if a != "alibi"]
        if missing:
            return f"decoder layers that require {', '.join(repr(a) for a in missing)}"
    if getattr(cfg, "use_bidirectional_attention", False):
        return "bidirectional attention (use_bidirectional_attention)"
    return None
