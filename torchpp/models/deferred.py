"""Weight gradients of linear layers set aside during the input-gradient pass (``I``) and computed
in the weight pass (``W``) of a zero-bubble schedule.

A linear layer's backward is two matrix products: ``dx = dy · Wᵀ`` (on the path to the stage's
input) and ``dW = dyᵀ · x`` (a leaf). Patched layers run through :class:`_Linear`, whose backward
hands out ``dx`` and, while an input pass collects, keeps ``(x, dy)`` instead of computing ``dW``.
The input pass then needs one autograd call and no graph kept alive; the weight pass is one
matrix product per layer call, with no autograd at all. Walking the graph for each weight's
branch point and restarting autograd there costs about a millisecond per decoder layer per call
(11 calls for a Qwen3 layer), which is what zero-bubble schedules would otherwise pay for their
split. Outside a collecting input pass (a full backward, the embedding chunk's deferred
backward, a recomputed layer) the layer computes both gradients at once, as ``nn.Linear`` does.

Weights of other modules (norms, embeddings) are small or off the input path: the input pass
computes their gradients along with the input's.

Wherever a patched layer computes its weight gradient (in ``W`` or at once), it adds it into the
accumulated ``.grad`` in the same product (:func:`weight_gradient`); the tail's lm_head runs
through :class:`_Linear` in every stage (:func:`project`) for that alone.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass(eq=False)
class Deferred:
    """One call of a patched layer whose weight gradient waits for ``W``: its (autocast) input and
    the gradient of its output."""

    weight: nn.Parameter
    bias: nn.Parameter | None
    x: torch.Tensor
    dy: torch.Tensor
    conv1d: bool
    """GPT-2's ``Conv1D`` keeps its weight as (in, out)."""

    def compute(self) -> None:
        """Accumulate this call's weight (and bias) gradient into ``.grad``."""
        dy = self.dy.reshape(-1, self.dy.shape[-1])
        x = self.x.reshape(-1, self.x.shape[-1])
        gw = weight_gradient(self.weight, dy, x, self.conv1d)
        if gw is not None:
            add_grad(self.weight, gw)
        if self.bias is not None and self.bias.requires_grad:
            add_grad(self.bias, dy.sum(0).to(self.bias.dtype))


@dataclass(eq=False)
class _Collector:
    """The input pass in progress: what it defers, and the weights it must compute now."""

    now: set[int]
    kept: list[Deferred] = field(default_factory=list)


_collecting: _Collector | None = None
_patched: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


class _Linear(torch.autograd.Function):
    """``nn.Linear`` (or ``Conv1D``) whose weight gradient can wait (module docstring)."""

    @staticmethod
    def forward(ctx, x, weight, bias, conv1d: bool):
        dev = x.device.type
        cast = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else None
        with torch.autocast(dev, enabled=False):
            if cast is not None:  # what autocast would run the product in; the casts' backward casts back
                xc, wc = x.to(cast), weight.to(cast)
                bc = None if bias is None else bias.to(cast)
            else:
                xc, wc, bc = x, weight, bias
            if conv1d:
                out = torch.addmm(bc, xc.reshape(-1, xc.shape[-1]), wc) if bc is not None \
                    else xc.reshape(-1, xc.shape[-1]).mm(wc)
                out = out.reshape(*xc.shape[:-1], wc.shape[-1])
            else:
                out = nn.functional.linear(xc, wc, bc)
        ctx.save_for_backward(xc, wc)
        ctx.params = (weight, bias)
        ctx.conv1d = conv1d
        ctx.x_dtype = x.dtype
        return out

    @staticmethod
    def backward(ctx, dy):
        xc, wc = ctx.saved_tensors
        weight, bias = ctx.params
        conv1d = ctx.conv1d
        dx = None
        if ctx.needs_input_grad[0]:
            dx = (dy.matmul(wc.t()) if conv1d else dy.matmul(wc)).to(ctx.x_dtype)
        want_w, want_b = ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[2]
        if not (want_w or want_b):
            return dx, None, None, None
        c = _collecting
        if c is not None and id(weight) not in c.now:
            # detached: an unpacked saved input carries its grad_fn, which would keep the graph
            # (every saved tensor upstream) alive until W
            c.kept.append(Deferred(weight, bias if want_b else None, xc.detach(), dy.detach(), conv1d))
            return dx, None, None, None
        dy2, x2 = dy.reshape(-1, dy.shape[-1]), xc.reshape(-1, xc.shape[-1])
        gw = weight_gradient(weight, dy2, x2, conv1d) if want_w else None
        gb = dy2.sum(0).to(bias.dtype) if want_b else None
        return dx, gw, gb, None


@torch.no_grad()
def weight_gradient(weight: nn.Parameter, dy: torch.Tensor, x: torch.Tensor, conv1d: bool) -> torch.Tensor | None:
    """``dW = dyᵀ · x`` (2-D ``dy`` and ``x``) added into ``weight.grad`` in one product where
    there is one of the product's dtype (None returned: nothing left for autograd to add), else
    returned. A pipeline rank accumulates over micro-batches anyway; the fresh product beside
    the accumulated gradient is one more weight-sized block per call, which for an lm_head (25 MiB
    on qwen3-homelab, 600 MiB on Qwen3-0.6B) fragmented the tail rank's heap and raised its
    peak by 8-25 MiB at random steps."""
    a, b = (x.t(), dy) if conv1d else (dy.t(), x)
    g = weight.grad
    if g is not None and g.dtype == a.dtype and not g.requires_grad:
        g.addmm_(a, b)
        return None
    return a.mm(b).to(weight.dtype)


def project(module: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """``module(h)`` for an output projection (the lm_head), its weight gradient added into
    ``.grad`` in place (:func:`weight_gradient`) where the module is a plain ``nn.Linear``."""
    if module in _patched or type(module) is not nn.Linear or not module.weight.requires_grad \
            or not torch.is_grad_enabled():
        return module(h)
    return _Linear.apply(h, module.weight, module.bias, False)


def defer_weight_gradients(module: nn.Module, enable: bool = True) -> int:
    """Patch every linear layer of ``module`` with a trainable weight so its weight gradient can
    wait for the weight pass (or, ``enable=False``, restore them); returns how many layers are
    patched (idempotent)."""
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:  # pragma: no cover - transformers is a dependency
        Conv1D = None
    n = 0
    for m in module.modules():
        conv1d = Conv1D is not None and isinstance(m, Conv1D)
        if not (isinstance(m, nn.Linear) or conv1d) or not m.weight.requires_grad:
            continue
        if not enable:
            if m in _patched:
                del m.forward  # the class's own forward again
                _patched.discard(m)
            continue
        n += 1
        if m not in _patched:
            m.forward = (lambda x, m=m, conv1d=conv1d: _Linear.apply(x, m.weight, m.bias, conv1d))
            _patched.add(m)
    return n


class collecting:
    """Context of one input pass: patched layers keep their weight gradient unless their weight is
    in ``now`` (layers recomputed from a checkpoint take theirs in this pass)."""

    def __init__(self, now: list[nn.Parameter]):
        self.collector = _Collector({id(p) for p in now})

    def __enter__(self) -> list[Deferred]:
        global _collecting
        if _collecting is not None:
            raise RuntimeError("an input pass is already collecting deferred weight gradients")
        _collecting = self.collector
        return self.collector.kept

    def __exit__(self, *exc) -> None:
        global _collecting
        _collecting = None


@torch.no_grad()
def add_grad(p: nn.Parameter, g: torch.Tensor) -> None:
    """Accumulate ``g`` into ``p.grad`` (set it where there is none yet)."""
    if p.grad is None:
        p.grad = g
    else:
        p.grad += g
