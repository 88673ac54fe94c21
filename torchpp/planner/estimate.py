"""Estimate-only planning: block costs from the model config, device speeds from a spec file.

Nothing is measured (seed 000's estimate-only script; seed 001's mocked-model workloads).
Per block and sample: parameter bytes from the model built on the meta device (exact counts,
no memory); forward FLOPs ``2·params·seq`` plus attention ``4·seq²·hidden`` per decoder layer,
``2·hidden·vocab·seq`` for the lm_head; backward twice the forward; output bytes
``seq·hidden·dtype bytes`` (seed 001's pipeline activation size ``2·mb·seq·hidden`` at 16 bits),
the tail's output being its logits. Time = FLOPs / the device's FLOP/s.

device spec (JSON)::

    {"devices": {"pi1": {"flops": 2e10, "memory_gb": 4}, ...},
     "link_gbps": 0.1, "latency_ms": 0.5,            # every pair, unless
     "links": {"pi1|pi2": 1.0}}                      # per directed pair (Gbit/s)
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..formats import GB, Bandwidth, FormatError, Reader, read_json
from ..cost import Profiles

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def block_params(model: str, num_layers: int | None = None) -> tuple[Any, list[int]]:
    """(config, parameter count per block: embed, layers…, tail) of a preset or local checkpoint."""
    import torch
    from transformers import AutoModelForCausalLM

    from ..models.presets import load_config

    cfg = load_config(model, num_layers)
    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(cfg)
    emb = m.get_input_embeddings()
    head = m.get_output_embeddings()
    base = m.base_model
    layers = None
    for name in ("layers", "h", "blocks"):
        if isinstance(getattr(base, name, None), torch.nn.ModuleList):
            layers = getattr(base, name)
            break
    if layers is None:
        raise ValueError(f"cannot find the decoder layers of {model}")
    in_layers = {id(p) for lay in layers for p in lay.parameters()}
    emb_ids = {id(p) for p in emb.parameters()}
    head_ids = {id(p) for p in head.parameters()} if head is not None else set()
    emb_n = sum(p.numel() for p in emb.parameters())
    # the last stage holds its own copy of a tied lm_head weight, so it is counted there too
    tail_n = sum(p.numel() for p in head.parameters()) if head is not None else 0
    for name, p in m.named_parameters(remove_duplicate=True):
        if id(p) in in_layers or id(p) in emb_ids or id(p) in head_ids:
            continue
        leaf = name.split(".")[-2] if "." in name else name
        if "norm" in leaf or leaf.startswith("ln_f"):
            tail_n += p.numel()       # final norm
        else:
            emb_n += p.numel()        # e.g. position embeddings
    return cfg, [emb_n, *[sum(p.numel() for p in lay.parameters()) for lay in layers], tail_n]


def estimate_profiles(model: str, spec_path: str, seq_len: int, dtype: str = "float32",
                      num_layers: int | None = None) -> tuple[Profiles, Bandwidth, dict[str, float]]:
    from ..models.presets import hidden_size, model_info, precision_fields

    data = read_json(spec_path)
    r = Reader(data, spec_path)
    devs = r.obj("devices")
    if not devs.data:
        raise FormatError(spec_path, "devices", "at least one device")
    cfg, params = block_params(model, num_layers)
    info = model_info(cfg, model, **precision_fields(dtype))
    by = DTYPE_BYTES[info.dtype]  # mixed precision keeps fp32 weights and sends fp32 activations
    h, V, L = hidden_size(cfg), int(cfg.vocab_size), info.num_layers
    flops = np.array([2.0 * seq_len * h]
                     + [2.0 * params[1 + i] * seq_len + 4.0 * seq_len * seq_len * h for i in range(L)]
                     + [2.0 * h * V * seq_len])
    act = np.array([seq_len * h * by] * (L + 1) + [seq_len * V * by], dtype=float)
    prof = Profiles(model=info, seq_len=seq_len, param_bytes=np.array(params, dtype=float) * by, act_bytes=act)
    budget = {}
    for host in devs.data:
        d = devs.obj(host)
        f = d.float("flops", positive=True)
        budget[host] = d.float("memory_gb", positive=True) * GB
        prof.set_table(host, list(flops / f), list(2 * flops / f), 1, f"{spec_path} devices.{host}")
        prof.origin[host] = f"estimate: {f:.3g} FLOP/s"
    default = r.float("link_gbps", None, positive=True)
    lat = r.float("latency_ms", 0.0, min_value=0.0) / 1e3
    links = r.obj("links", {})
    rates, lats = {}, {}
    for a in devs.data:
        for b in devs.data:
            if a == b:
                continue
            k = Bandwidth.key(a, b)
            if k in links.data:
                g = links.float(k, positive=True)
            elif default is not None:
                g = default
            else:
                raise FormatError(spec_path, f"links.{k}", "a rate in Gbit/s (or a default link_gbps)")
            rates[k] = g * 1e9 / 8
            if lat:
                lats[k] = lat
    return prof, Bandwidth(bytes_per_sec=rates, latency_s=lats, source=f"estimate from {spec_path}"), budget
