"""Small records between ranks as JSON in uint8 tensors, never as pickles.

``torch.distributed``'s ``*_object`` collectives unpickle what peers send, so any process
that can reach the rendezvous could run code on every rank. Here a record is JSON encoded
into a uint8 tensor; its length travels first as an int64 tensor, so every rank pads to
the longest record and decodes exactly the bytes sent. A peer can send wrong data, never code.
"""
from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist

MAX_RECORD_BYTES = 256 << 20
"""A peer announcing more than this is refused before any buffer is allocated."""


class ExchangeError(RuntimeError):
    """A peer sent a record that is not valid JSON or is larger than :data:`MAX_RECORD_BYTES`."""


def _world(group: Any = None) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def _encode(obj: Any) -> torch.Tensor:
    data = json.dumps(obj, separators=(",", ":")).encode("utf-8")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.zeros(0, dtype=torch.uint8)


def _decode(buf: torch.Tensor, n: int, rank: int) -> Any:
    try:
        return json.loads(buf[:n].numpy().tobytes().decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise ExchangeError(f"rank {rank} sent a record that is not JSON: {e}") from None


def _lengths(n: int, world: int, group: Any) -> list[int]:
    mine = torch.tensor([n], dtype=torch.int64)
    out = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(out, mine, group=group)
    sizes = [int(t) for t in out]
    for r, s in enumerate(sizes):
        if not 0 <= s <= MAX_RECORD_BYTES:
            raise ExchangeError(f"rank {r} announced a record of {s} bytes (at most {MAX_RECORD_BYTES})")
    return sizes


def _padded(data: torch.Tensor, size: int) -> torch.Tensor:
    buf = torch.zeros(max(size, 1), dtype=torch.uint8)
    buf[:data.numel()] = data
    return buf


def all_gather_json(obj: Any, group: Any = None) -> list[Any]:
    """Every rank's ``obj`` (JSON-serialisable), in rank order, on every rank."""
    data = _encode(obj)
    world = _world(group)
    if world == 1:
        return [obj]
    sizes = _lengths(data.numel(), world, group)
    top = max(sizes)
    bufs = [torch.zeros(max(top, 1), dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(bufs, _padded(data, top), group=group)
    return [_decode(b, n, r) for r, (b, n) in enumerate(zip(bufs, sizes))]


def gather_json(obj: Any, dst: int = 0, group: Any = None) -> list[Any] | None:
    """Every rank's ``obj`` in rank order on ``dst`` (a global rank); None on the other ranks."""
    data = _encode(obj)
    world = _world(group)
    if world == 1:
        return [obj]
    sizes = _lengths(data.numel(), world, group)
    top = max(sizes)
    me = dist.get_rank()
    bufs = [torch.zeros(max(top, 1), dtype=torch.uint8) for _ in range(world)] if me == dst else None
    dist.gather(_padded(data, top), bufs, dst=dst, group=group)
    if me != dst:
        return None
    return [_decode(b, n, r) for r, (b, n) in enumerate(zip(bufs, sizes))]


class DisagreementError(ValueError):
    """Ranks were started with different plans, models, data or options, or a rank's setup failed."""


def _ranks(rs: list[int]) -> str:
    return f"rank {rs[0]}" if len(rs) == 1 else f"ranks {', '.join(map(str, rs))}"


def require_agreement(fields: dict[str, str]) -> None:
    """Raise the same :class:`DisagreementError` on every rank unless all ranks hold equal ``fields``.

    Values should be short (a hash, a number, a name): the message quotes them, grouped by rank."""
    every = all_gather_json(fields)
    names = sorted({k for f in every for k in f})
    diffs = []
    for k in names:
        by_value: dict[str, list[int]] = {}
        for r, f in enumerate(every):
            by_value.setdefault(str(f.get(k, "<missing>")), []).append(r)
        if len(by_value) > 1:
            diffs.append(f"{k} (" + "; ".join(f"{v} on {_ranks(rs)}" for v, rs in by_value.items()) + ")")
    if diffs:
        raise DisagreementError("ranks were started with different " + ", ".join(diffs)
                                + ": start every rank with the same files and options")


def require_no_errors(error: str | None) -> None:
    """Raise on every rank when any rank reports a local ``error`` (one message naming the ranks)."""
    every = all_gather_json(error or "")
    bad: dict[str, list[int]] = {}
    for r, e in enumerate(every):
        if e:
            bad.setdefault(str(e), []).append(r)
    if bad:
        raise DisagreementError("; ".join(f"{_ranks(rs)}: {e}" for e, rs in bad.items()))
