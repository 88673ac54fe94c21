"""Which blocks a host can hold while ``torchpp profile`` times them.

Profiling runs forward and backward through every block it times, so it holds their weights, their
gradients and their activations at once; a model's embedding and tail are the largest of these by
far on a small host (Qwen3-0.6B: a 622 MB tied embedding/lm_head, its 622 MB gradient and
151,936-wide logits, ~2.5 GB with the decoder layers, on a 2 GB Raspberry Pi). A host whose memory
surely cannot hold them (``profile_bytes``, a lower bound: a profile that ran before still runs)
times the decoder layers alone, and the planner prices the embedding and tail from the hosts that
did (``cost.profiles``).

The limit is the smallest of ``--memory``, the process's memory cgroup (v2 ``memory.max`` or v1
``memory.limit_in_bytes``), an emulated host's ``TORCHPP_HOST_MEMORY`` and the machine's memory;
what the profile may add is that limit less what the process already holds (torch and transformers
imported), and no more than the machine has available.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

LOGIT_COPIES = 2
"""Vocabulary-wide fp32 tensors per token the tail certainly holds at once: the logits (the model's
output) and their log-softmax (kept for the loss's backward)."""
OPTIMIZER_SAMPLE_BYTES = 16 * 2**20
"""Parameter bytes the optimizer step is timed on at most (``measure.measure_optimizer``): its time is
linear in them, and a host profiling a model it cannot train (gradients and two moments for every
weight) must not run out of memory doing so."""


@dataclass(frozen=True)
class HostMemory:
    limit_bytes: int
    source: str
    """What set the limit: ``--memory``, ``cgroup <path>``, ``TORCHPP_HOST_MEMORY``, ``machine``."""
    room_bytes: int
    """What this process may still add."""
    held_bytes: int = 0
    """What this process already holds (its resident set when the limit was read)."""


def _cgroup_limit() -> tuple[int, str] | None:
    """The memory limit of this process's cgroup (v2 or v1), None without one."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, rel = line.split(":", 2)
        if controllers == "":
            path = Path("/sys/fs/cgroup") / rel.lstrip("/") / "memory.max"
        elif "memory" in controllers.split(","):
            path = Path("/sys/fs/cgroup/memory") / rel.lstrip("/") / "memory.limit_in_bytes"
        else:
            continue
        try:
            raw = path.read_text().strip()
        except OSError:
            continue
        if raw != "max" and raw.isdigit() and int(raw) < 2**60:  # v1 writes "no limit" as a huge number
            return int(raw), f"cgroup {path}"
    return None


def host_memory(explicit: int | None = None) -> HostMemory:
    """This host's memory limit and what the profile may still add (see the module's docstring)."""
    vm = psutil.virtual_memory()
    found: list[tuple[int, str]] = [(int(vm.total), "machine")]
    if explicit is not None:
        found.append((int(explicit), "--memory"))
    emulated = os.environ.get("TORCHPP_HOST_MEMORY", "")
    if emulated.isdigit():
        found.append((int(emulated), "TORCHPP_HOST_MEMORY"))
    cg = _cgroup_limit()
    if cg is not None:
        found.append(cg)
    limit, source = min(found)
    rss = psutil.Process().memory_info().rss
    return HostMemory(limit_bytes=limit, source=source, room_bytes=max(0, min(limit - rss, int(vm.available))),
                      held_bytes=int(rss))


@dataclass(frozen=True)
class BlockBytes:
    """Bytes of the model's blocks, from its config alone (parameters on the meta device)."""

    layer: list[int]
    embed: int
    tail: int
    ends: int
    """Embedding and tail together, a tied weight once."""


def block_bytes(cfg: Any, dtype: "Any") -> BlockBytes:
    """Parameter bytes per block of ``cfg``'s model in ``dtype``, without allocating it."""
    import torch
    from transformers import AutoModelForCausalLM

    from ..models.blocks import EMBED, TAIL, find_parts, layer_block

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    parts = find_parts(model)
    ends = {id(p): p.numel() * p.element_size() for b in (EMBED, TAIL) for _, p in parts.named_parameters(b)}
    return BlockBytes(layer=[parts.param_bytes(layer_block(i)) for i in range(parts.num_layers)],
                      embed=parts.param_bytes(EMBED), tail=parts.param_bytes(TAIL), ends=sum(ends.values()))


def profile_bytes(cfg: Any, sizes: BlockBytes, batch: int, seq_len: int, ends: bool) -> int:
    """What profiling certainly adds to the process (a lower bound): the weights and gradients of
    the blocks it times, each layer's output, the optimizer timing's sample (weights, gradients,
    two moments) and, with the tail, the logits and their log-softmax. The rest of the activations,
    the allocator's cache and the gradients' peaks come on top, so a profile this does not fit
    would surely be killed, and one it fits is left as it always ran."""
    tokens = batch * seq_len
    need = 2 * sum(sizes.layer) + len(sizes.layer) * tokens * int(cfg.hidden_size) * 4 + 4 * OPTIMIZER_SAMPLE_BYTES
    if ends:
        need += 2 * sizes.ends + LOGIT_COPIES * tokens * int(cfg.vocab_size) * 4
    return int(need)


@dataclass(frozen=True)
class Fit:
    """What this host profiles: ``left_out`` blocks it cannot hold, and the figures that said so."""

    left_out: tuple[str, ...]
    memory: HostMemory
    need_all: int
    need_layers: int


class DoesNotFit(ValueError):
    """Not even the decoder layers fit this host's memory."""


def choose_blocks(cfg: Any, dtype: Any, batch: int, seq_len: int, explicit: int | None = None) -> Fit:
    """Every block unless the host surely cannot hold them all; then the decoder layers alone
    (embedding and tail left out together: tied, they share one weight); DoesNotFit when not even
    the layers can fit."""
    sizes = block_bytes(cfg, dtype)
    mem = host_memory(explicit)
    need_all = profile_bytes(cfg, sizes, batch, seq_len, ends=True)
    need_layers = profile_bytes(cfg, sizes, batch, seq_len, ends=False)
    if need_all <= mem.room_bytes:
        return Fit((), mem, need_all, need_layers)
    if need_layers <= mem.room_bytes:
        return Fit(("embed", "tail"), mem, need_all, need_layers)
    fit = int((mem.room_bytes - 4 * OPTIMIZER_SAMPLE_BYTES) // max(2 * max(sizes.layer), 1))
    hint = f"profile fewer with --layers {fit}" if fit >= 1 else "this host cannot hold one decoder layer"
    raise DoesNotFit(f"--memory: {len(sizes.layer)} decoder layer(s) alone need at least {_mib(need_layers)} "
                     f"(weights, gradients, outputs) and this host may add {_mib(mem.room_bytes)} (limit "
                     f"{_mib(mem.limit_bytes)}, {mem.source}, less the {_mib(mem.held_bytes)} this process holds): {hint}")


def _mib(x: float) -> str:
    return f"{x / 2**20:.0f} MiB"
