"""The peer's stage, as `torch.distributed.pipelining`'s examples build one: the whole HF model,
pruned to a layer range, wrapped in a module whose forward is torchpp's per-stage compute
(positions, masks, rotary per stage) and whose last chunk returns logits (the peer's schedule
applies the loss). Shared by bench_pipelining.py and bench_chunked.py so both compare against
the same peer.

The logits are the plain modules' (``lm_head(norm(h))``), not :meth:`Stage.logits`: torchpp's
projection adds the lm_head's weight gradient into ``.grad`` inside its backward, where the
peer's zero-bubble weight pass (``stage_backward_weight``) looks for the weight in the autograd
graph and fails when it is not there."""
from __future__ import annotations


def peer_part(model, cfg, layers: tuple[int, int], *, first: bool, last: bool, num_stages: int = 1):
    """(module for ``PipelineStage``, torchpp's Stage inside it) of ``model`` pruned to ``layers``."""
    import gc

    import torch
    from torch import nn

    from torchpp.models.semantics import scale_logits
    from torchpp.models.stages import Stage, StagePaths, StageSpec, _get, _set

    parts = StagePaths.of(model)
    a, b = layers
    lay = _get(model, parts.layers)
    for i in range(int(cfg.num_hidden_layers)):
        if not a <= i < b:
            lay[i] = nn.Module()
    if not first:
        for p in parts.embed:
            _set(model, p, None)
    if not last:
        _set(model, parts.norm, None)
        _set(model, parts.lm_head, None)
    gc.collect()
    stage = Stage(model, cfg, StageSpec(layers=layers, has_embed=first, has_tail=False, num_stages=num_stages), parts)

    class Part(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.hf = model

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = stage.forward(x)
            if not last:
                return h
            return scale_logits(cfg, _get(model, parts.lm_head)(_get(model, parts.norm)(h)))

    return Part(), stage
