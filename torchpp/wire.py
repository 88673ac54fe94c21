"""The wire codecs: a tensor made smaller before a send and restored after the receive.

One encoded message is one flat tensor (gloo sends one buffer per message):

- ``fp32``: the tensor itself (the default; nothing is copied).
- ``bf16`` / ``fp16``: the tensor cast, viewed as int16 (so any backend moves it as bytes);
  decoding casts back to the original dtype. Values representable in the format cross exactly.
- ``int8``: per-row symmetric quantisation (a row: the last dimension, one token's hidden
  vector): ``rows × 4`` bytes of fp32 scales (``max|row| / 127``) followed by ``numel`` int8
  codes, all viewed as uint8. The error of an element is at most half its row's scale.

Error feedback (:class:`ErrorFeedback`): for gradients, what the rounding lost on one message
is added to the next message of the same link and sample range (the next micro-batch), so the
sum over micro-batches of what arrives equals the sum of what was meant, up to the last
message's residual.

This module sits below ``profiling`` (which measures each codec's CPU cost per byte) and
``runtime`` (which uses it on every p2p message); the byte counts the cost model needs are in
``formats.wire`` so pricing never imports torch codecs.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Hashable

import torch

from .formats.wire import POWERSGD_RANK, SCALE_BYTES, WIRE_FORMATS, wire_bytes

_HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}


def encoded_numel(fmt: str, shape: tuple[int, ...]) -> int:
    """Elements of the flat encoded message for a tensor of ``shape`` (what a receive allocates)."""
    n = 1
    for d in shape:
        n *= d
    if fmt == "fp32":
        return n
    if fmt in _HALF:
        return n
    return wire_bytes("int8", n, shape[-1] if shape else 1)


def encoded_dtype(fmt: str, dtype: torch.dtype) -> torch.dtype:
    return dtype if fmt == "fp32" else torch.int16 if fmt in _HALF else torch.uint8


def encode(fmt: str, x: torch.Tensor) -> torch.Tensor:
    """``x`` as one flat message in ``fmt`` (fp32: ``x`` itself)."""
    if fmt == "fp32":
        return x
    if fmt in _HALF:
        return x.detach().to(_HALF[fmt]).reshape(-1).view(torch.int16)
    if fmt != "int8":
        raise ValueError(f"wire format: expected one of {list(WIRE_FORMATS)}, got {fmt!r}")
    rows = x.detach().reshape(-1, x.shape[-1] if x.dim() else 1).float()
    scale = rows.abs().amax(dim=1, keepdim=True).div_(127.0)
    q = torch.where(scale > 0, rows / torch.where(scale > 0, scale, 1.0), 0.0).round_().clamp_(-127, 127)
    out = torch.empty(rows.shape[0] * SCALE_BYTES + rows.numel(), dtype=torch.uint8)
    out[:rows.shape[0] * SCALE_BYTES].view(torch.float32).copy_(scale.reshape(-1))
    out[rows.shape[0] * SCALE_BYTES:].view(torch.int8).copy_(q.reshape(-1))
    return out


def decode(fmt: str, msg: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The tensor of ``shape`` and ``dtype`` that ``msg`` (from :func:`encode`) carries."""
    if fmt == "fp32":
        return msg.reshape(shape)
    if fmt in _HALF:
        return msg.view(_HALF[fmt]).to(dtype).reshape(shape)
    row = shape[-1] if shape else 1
    nrows = msg.numel() // (row + SCALE_BYTES)
    scale = msg[:nrows * SCALE_BYTES].view(torch.float32).reshape(nrows, 1)
    q = msg[nrows * SCALE_BYTES:].view(torch.int8).reshape(nrows, row)
    return (q.to(torch.float32) * scale).to(dtype).reshape(shape)


def round_trip(fmt: str, x: torch.Tensor) -> torch.Tensor:
    """What the receiver gets for ``x``."""
    return decode(fmt, encode(fmt, x), tuple(x.shape), x.dtype)


@dataclass
class ErrorFeedback:
    """Per stream (a link, a direction, a sample range), the rounding error of the last message,
    added to the next one before it is encoded."""

    fmt: str
    residual: dict[Hashable, torch.Tensor] = field(default_factory=dict)

    def encode(self, key: Hashable, x: torch.Tensor) -> torch.Tensor:
        if self.fmt == "fp32":
            return x
        r = self.residual.get(key)
        want = x.detach().float() if r is None or r.shape != x.shape else x.detach().float() + r
        msg = encode(self.fmt, want)
        self.residual[key] = want - decode(self.fmt, msg, tuple(x.shape), torch.float32)
        return msg


@dataclass
class CodecCost:
    """Measured CPU seconds per fp32 byte to encode and to decode one format (one host)."""

    encode_s_per_byte: float
    decode_s_per_byte: float


def measure_codec(fmt: str, shape: tuple[int, int] = (512, 1024), iters: int = 20) -> CodecCost:
    """Median CPU time per fp32 byte of :func:`encode` and :func:`decode` of a ``shape`` tensor
    (process CPU time, so other processes on the host do not count)."""
    x = torch.randn(shape)
    enc, dec = [], []
    for _ in range(iters):
        t0 = time.process_time()
        msg = encode(fmt, x)
        t1 = time.process_time()
        decode(fmt, msg, shape, torch.float32)
        t2 = time.process_time()
        enc.append(t1 - t0)
        dec.append(t2 - t1)
    return _median_per_byte(enc, dec, x.numel() * 4)


def _median_per_byte(enc: list[float], dec: list[float], nbytes: int) -> CodecCost:
    """The median encode and decode CPU seconds of several runs, per fp32 byte."""
    return CodecCost(sorted(enc)[len(enc) // 2] / nbytes, sorted(dec)[len(dec) // 2] / nbytes)


def measure_powersgd(shape: tuple[int, int] = (1024, 256), rank: int = POWERSGD_RANK, iters: int = 10) -> CodecCost:
    """Median CPU time per fp32 byte of PowerSGD's arithmetic on one ``shape`` gradient, as torch's
    ``powerSGD_hook`` does it (error feedback added, P = M Q, P orthogonalized, Q = Mᵀ P; then
    the approximation P Qᵀ and the new error): (compress, decompress), communication left out."""
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _orthogonalize

    g, err = torch.randn(shape), torch.zeros(shape)
    q = torch.randn(shape[1], rank)
    enc, dec = [], []
    for _ in range(iters):
        t0 = time.process_time()
        m = g + err
        p = m @ q
        _orthogonalize(p.unsqueeze(0))
        q = m.t() @ p
        t1 = time.process_time()
        approx = p @ q.t()
        err = m - approx
        t2 = time.process_time()
        enc.append(t1 - t0)
        dec.append(t2 - t1)
    return _median_per_byte(enc, dec, g.numel() * 4)

