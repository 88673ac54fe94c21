"""Workloads from a mocked model (AICB's idea): per-block FLOPs and bytes from a config alone.

Nothing is built, not even on the meta device: parameter counts are the config's arithmetic
(attention ``q, k, v, o`` with grouped KV heads, a gated or plain MLP, norms, embeddings and
the lm_head), forward FLOPs per sample ``2·matmul params·seq + 4·seq²·hidden`` per layer
(estimate.py's rule), backward twice the forward, block output ``seq·hidden·dtype bytes``
per sample (the tail's: its logits). With tensor parallelism of ``tp`` a layer's FLOPs and
parameters are split ``tp`` ways and each layer adds Megatron's two all-reduces of its
output in the forward and two in the backward (priced by the caller on the topology).

``config`` is anything with a transformers config's attributes (an HF config object, a
``SimpleNamespace``, or :func:`config_dict`'s result); :data:`MEGATRON_GPT` holds seed
001's ``megatron_gpt`` sizes.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np

from ..formats import ModelInfo
from .profiles import Profiles

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
MEGATRON_GPT = {
    # seed 001's `megatron_gpt.sh -m 7 / 13 / 175` (GPT-3 shapes, swiglu off: plain 4h MLP)
    "megatron-gpt-7b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, vocab_size=50257,
                            intermediate_size=16384, model_type="gpt", tie_word_embeddings=False),
    "megatron-gpt-13b": dict(hidden_size=5120, num_hidden_layers=40, num_attention_heads=40, vocab_size=50257,
                             intermediate_size=20480, model_type="gpt", tie_word_embeddings=False),
    "megatron-gpt-175b": dict(hidden_size=12288, num_hidden_layers=96, num_attention_heads=96, vocab_size=50257,
                              intermediate_size=49152, model_type="gpt", tie_word_embeddings=False),
}


def config_dict(**kw: Any) -> SimpleNamespace:
    return SimpleNamespace(**kw)


def _get(cfg: Any, *names: str, default: Any = None) -> Any:
    for n in names:
        v = getattr(cfg, n, None)
        if v is not None:
            return v
    return default


@dataclass(frozen=True)
class Workload:
    """Per block (embed, layers…, tail) and per sample: forward FLOPs, parameters, output bytes."""

    model: ModelInfo
    seq_len: int
    flops: np.ndarray
    params: np.ndarray
    act_bytes: np.ndarray
    dtype_bytes: int

    def profiles(self, host: str, flops_per_s: float, tp: int = 1, tp_s_per_byte: float = 0.0,
                 tp_latency_s: float = 0.0) -> Profiles:
        """Profiles of one device kind: ``tp``-way split compute plus the per-layer tp all-reduces."""
        layer = np.zeros(len(self.flops))
        layer[1:-1] = 1.0
        ar_bytes = self.act_bytes * layer  # a layer's output, all-reduced twice each way
        fwd = self.flops / tp / flops_per_s + 2 * ar_bytes * tp_s_per_byte
        bwd = 2 * self.flops / tp / flops_per_s + 2 * ar_bytes * tp_s_per_byte
        fixed = 2 * layer * tp_latency_s
        prof = Profiles(model=self.model, seq_len=self.seq_len, param_bytes=self.params * self.dtype_bytes / tp,
                        act_bytes=self.act_bytes.astype(float))
        prof.set_table(host, fwd + fixed, bwd + fixed, 1, f"workload {self.model.name} tp={tp}", fixed, fixed)
        prof.origin[host] = f"workload: {flops_per_s:.3g} FLOP/s, tp {tp}"
        return prof


def layer_params(cfg: Any) -> tuple[int, int]:
    """(matmul parameters, other parameters) of one decoder layer."""
    h = int(_get(cfg, "hidden_size", "n_embd"))
    heads = int(_get(cfg, "num_attention_heads", "n_head"))
    kv = int(_get(cfg, "num_key_value_heads", default=heads))
    hd = int(_get(cfg, "head_dim", default=h // heads))
    kind = str(_get(cfg, "model_type", default=""))
    inter = int(_get(cfg, "intermediate_size", "n_inner", default=4 * h))
    attn = h * heads * hd * 2 + h * kv * hd * 2
    gated = kind not in ("gpt2", "gpt")
    mlp = (3 if gated else 2) * h * inter
    bias = (heads * hd + 2 * kv * hd + h + inter + h) if kind in ("gpt2", "gpt") or _get(cfg, "attention_bias") else 0
    norms = 4 * h if kind in ("gpt2", "gpt") else 2 * h  # LayerNorm has a bias, RMSNorm none
    other = norms + bias + (2 * hd if kind == "qwen3" else 0)
    return attn + mlp, other


def workload(cfg: Any, name: str, seq_len: int, dtype: str = "bfloat16") -> Workload:
    """The mocked model's per-block workload (see the module docstring)."""
    h = int(_get(cfg, "hidden_size", "n_embd"))
    L = int(_get(cfg, "num_hidden_layers", "n_layer"))
    V = int(cfg.vocab_size)
    tied = bool(_get(cfg, "tie_word_embeddings", default=False))
    by = DTYPE_BYTES[dtype]
    mm, other = layer_params(cfg)
    pos = int(_get(cfg, "n_positions", default=0)) * h if str(_get(cfg, "model_type", default="")) == "gpt2" else 0
    final_norm = 2 * h if str(_get(cfg, "model_type", default="")) in ("gpt2", "gpt") else h
    params = np.array([V * h + pos] + [mm + other] * L + [V * h + final_norm], dtype=float)
    flops = np.array([2.0 * seq_len * h] + [2.0 * mm * seq_len + 4.0 * seq_len * seq_len * h] * L
                     + [2.0 * h * V * seq_len])
    act = np.array([seq_len * h * by] * (L + 1) + [seq_len * V * by], dtype=float)
    info = ModelInfo(name=name, source="preset", num_layers=L, hidden_size=h, vocab_size=V, tied_embeddings=tied,
                     dtype=dtype, architecture=str(_get(cfg, "model_type", default="")))
    return Workload(model=info, seq_len=seq_len, flops=flops, params=params, act_bytes=act, dtype_bytes=by)
