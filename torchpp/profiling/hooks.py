"""Per-block forward and backward times of a HF causal LM, from hooks that leave the model unchanged.

Blocks are those of :mod:`torchpp.models.blocks`: ``embed``, ``layer<i>``, ``tail``. Each hook
only stamps a time (``timer.mark(id)``) and returns ``None``, so outputs are bit-for-bit those
of the bare model; :meth:`BlockProfiler.detach` removes every hook it added.

Forward boundaries come from module hooks: the model's forward start, each decoder layer's
pre-hook and hook, the model's forward end. Backward boundaries come from autograd itself,
not from module backward hooks (which miss time): a tensor hook on every block-boundary
activation fires when that activation's gradient is complete, i.e. when the block after it
has finished its backward and the block before it starts; a hook on the loss fires when the
backward begins, and post-accumulate-grad hooks on the embedding parameters fire when the
last gradient of the step has been written. So per step:

- embed forward: model forward start -> layer 0 starts (embeddings, position ids, causal
  mask, rotary cos/sin: everything a stage with the embedding does before its first layer);
- layer i forward: its pre-hook -> its hook;
- tail forward: last layer ends -> model forward returns (final norm, lm_head, loss);
- tail backward: loss gradient -> gradient of the last layer's output;
- layer i backward: gradient of its output -> gradient of its input;
- embed backward: gradient of layer 0's input -> last embedding parameter's gradient written.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch
from torch import nn

from ..models.blocks import EMBED, TAIL, ModelParts, find_parts, layer_block
from .timer import SpanTimer

# Event ids (timer rows). Layer i uses _LAYER + 3*i + {0: forward begin, 1: forward end, 2: output grad}.
_STEP_BEGIN, _STEP_END, _FWD_BEGIN, _FWD_END, _LOSS_GRAD, _EMBED_OUT_GRAD, _EMBED_PARAM_GRAD = range(7)
_LAYER = 16


def _first_tensor(x: Any) -> torch.Tensor | None:
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, (tuple, list)):
        for y in x:
            t = _first_tensor(y)
            if t is not None:
                return t
    return None


def _tail_tensor(out: Any) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(loss, logits) of a model output (ModelOutput, tuple or tensor)."""
    loss = getattr(out, "loss", None)
    logits = getattr(out, "logits", None)
    if logits is None:
        logits = _first_tensor(out)
    return loss, logits


@dataclass(kw_only=True)
class StepTimes:
    """Times of one forward+backward step, in seconds, per block name (embed, layer<i>, tail)."""

    wall_s: float
    """start_step() -> end_step(): forward call, loss, backward."""
    begin_ns: int
    forward_s: dict[str, float]
    backward_s: dict[str, float]
    spans_ns: dict[str, tuple[int, int, int, int]]
    """block -> (forward start, forward end, backward start, backward end) in timer nanoseconds."""
    activation_bytes: dict[str, int] = field(default_factory=dict)
    """Bytes of each block's output tensor for the whole batch (tail: the logits)."""
    batch: int = 0

    def blocks_total_s(self) -> float:
        return sum(self.forward_s.values()) + sum(self.backward_s.values())


class BlockProfiler:
    """Attach timing hooks to a causal LM; one :class:`StepTimes` per forward+backward step.

    Usage::

        with BlockProfiler(model) as prof:
            prof.start_step(); loss = model(input_ids=x, labels=x, use_cache=False).loss
            loss.backward(); times = prof.end_step()
    """

    def __init__(self, model: nn.Module, timer: Any | None = None, parts: ModelParts | None = None):
        self.model = model
        self.parts = parts or find_parts(model)
        self.timer = timer if timer is not None else SpanTimer(1 << 14)
        self.backend: str = getattr(self.timer, "backend", "python")
        self.n = self.parts.num_layers
        self._handles: list[Any] = []
        self._act: dict[str, int] = {}
        self._batch = 0
        self._in_step = False

    # ------------------------------------------------------------------ attach / detach
    def attach(self) -> "BlockProfiler":
        if self._handles:
            return self
        mark = self.timer.mark
        h = self._handles

        def model_pre(mod, args, kwargs):
            mark(_FWD_BEGIN)

        def model_post(mod, args, kwargs, out):
            mark(_FWD_END)
            loss, logits = _tail_tensor(out)
            if logits is not None:
                self._act[TAIL] = logits.nelement() * logits.element_size()
            root = loss if loss is not None and loss.requires_grad else logits
            if root is not None and root.requires_grad:
                root.register_hook(lambda g: (mark(_LOSS_GRAD), None)[1])

        h.append(self.model.register_forward_pre_hook(model_pre, with_kwargs=True))
        h.append(self.model.register_forward_hook(model_post, with_kwargs=True))
        for i, layer in enumerate(self.parts.layers):
            h.append(layer.register_forward_pre_hook(self._layer_pre(i, mark), with_kwargs=True))
            h.append(layer.register_forward_hook(self._layer_post(i, mark)))
        for _, p in self.parts.named_parameters(EMBED):
            if p.requires_grad:
                h.append(p.register_post_accumulate_grad_hook(lambda p: (mark(_EMBED_PARAM_GRAD), None)[1]))
        return self

    def _layer_pre(self, i: int, mark: Callable[[int], int]):
        begin = _LAYER + 3 * i

        def pre(mod, args, kwargs):
            if i == 0:
                x = args[0] if args else kwargs.get("hidden_states")
                if isinstance(x, torch.Tensor):
                    self._batch = int(x.shape[0])
                    self._act[EMBED] = x.nelement() * x.element_size()
                    if x.requires_grad:
                        x.register_hook(lambda g: (mark(_EMBED_OUT_GRAD), None)[1])
            mark(begin)

        return pre

    def _layer_post(self, i: int, mark: Callable[[int], int]):
        end, grad = _LAYER + 3 * i + 1, _LAYER + 3 * i + 2
        name = layer_block(i)

        def post(mod, args, out):
            mark(end)
            y = _first_tensor(out)
            if y is not None:
                self._act[name] = y.nelement() * y.element_size()
                if y.requires_grad:
                    y.register_hook(lambda g: (mark(grad), None)[1])

        return post

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def __enter__(self) -> "BlockProfiler":
        return self.attach()

    def __exit__(self, *exc) -> None:
        self.detach()

    @property
    def attached(self) -> bool:
        return bool(self._handles)

    # ------------------------------------------------------------------ steps
    def start_step(self) -> None:
        self.timer.reset()
        self._act = {}
        self._in_step = True
        self.timer.mark(_STEP_BEGIN)

    def end_step(self) -> StepTimes:
        """Close the step (call after backward returns) and turn its stamps into block times."""
        self.timer.mark(_STEP_END)
        if not self._in_step:
            raise RuntimeError("BlockProfiler.end_step() without start_step()")
        self._in_step = False
        if self.timer.dropped():
            raise RuntimeError(f"span timer overflow: {self.timer.dropped()} stamps dropped "
                               f"(capacity {self.timer.capacity()})")
        return self._times(self.timer.read())

    def run_step(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> StepTimes:
        """One timed forward (with loss) and backward; gradients are left in ``.grad``."""
        self.start_step()
        out = self.model(input_ids=input_ids, labels=input_ids if labels is None else labels, use_cache=False)
        out.loss.backward()
        return self.end_step()

    def _times(self, rows: np.ndarray) -> StepTimes:
        stamps: dict[int, list[int]] = {}
        for ident, t, _ in rows.tolist():
            stamps.setdefault(ident, []).append(t)

        def one(ident: int, what: str) -> int:
            v = stamps.get(ident)
            if not v:
                raise RuntimeError(f"block profiler: no '{what}' stamp in this step (was the forward run with "
                                   "gradients and the backward called between start_step and end_step?)")
            if len(v) != 1 and ident != _EMBED_PARAM_GRAD:
                raise RuntimeError(f"block profiler: {len(v)} '{what}' stamps in one step (one forward and "
                                   "one backward per step)")
            return max(v)

        n = self.n
        L = [(one(_LAYER + 3 * i, f"layer{i} forward begin"), one(_LAYER + 3 * i + 1, f"layer{i} forward end"),
              one(_LAYER + 3 * i + 2, f"layer{i} output gradient")) for i in range(n)]
        fwd0, fwd1, loss_g = one(_FWD_BEGIN, "model forward begin"), one(_FWD_END, "model forward end"), \
            one(_LOSS_GRAD, "loss gradient")
        emb_g = one(_EMBED_OUT_GRAD, "embedding output gradient")
        emb_end = one(_EMBED_PARAM_GRAD, "embedding parameter gradient") if _EMBED_PARAM_GRAD in stamps else \
            one(_STEP_END, "step end")
        spans = {EMBED: (fwd0, L[0][0], emb_g, emb_end), TAIL: (L[-1][1], fwd1, loss_g, L[-1][2])}
        for i in range(n):
            spans[layer_block(i)] = (L[i][0], L[i][1], L[i][2], L[i - 1][2] if i else emb_g)
        order = [EMBED, *(layer_block(i) for i in range(n)), TAIL]
        t0 = one(_STEP_BEGIN, "step begin")
        return StepTimes(
            wall_s=(one(_STEP_END, "step end") - t0) * 1e-9, begin_ns=t0,
            forward_s={b: (spans[b][1] - spans[b][0]) * 1e-9 for b in order},
            backward_s={b: (spans[b][3] - spans[b][2]) * 1e-9 for b in order},
            spans_ns={b: spans[b] for b in order}, activation_bytes=dict(self._act), batch=self._batch,
        )
