"""What crosses a link: the wire formats of pipeline traffic and the data-parallel sync of a group.

Plan fields (all optional; absent is today's behaviour, fp32 every step):

- ``stages[i].wire``: the format of the link from chunk i to chunk i+1, activations down and
  their gradients back up (``fp32``, ``bf16``, ``fp16``, ``int8``; gradients carry their rounding
  error to the next micro-batch).
- ``stages[i].sync``: how chunk i's device group agrees on its weights: ``allreduce`` (every step,
  its ``wire`` fp32, bf16, or int8: per-256-element codes all-gathered and summed in fp32, the
  rounding error carried to the next step), ``powersgd`` (torch's PowerSGD of ``rank``), or ``diloco`` (every
  replica steps alone; every ``H`` steps the replicas all-reduce their parameter change, in
  ``wire`` fp32, bf16 or int8, and apply an outer Nesterov SGD step of ``outer_lr`` and
  ``outer_momentum``).
- ``tied_sync``: the tied-weight all-reduce between the first and last stage (``allreduce``
  with wire fp32/bf16/int8, or ``powersgd``), or ``rows`` (exact): the last stage alone updates
  the tied weight; the first stage sends it only the rows of its embedding gradient that the
  step's tokens touched and receives only the rows the next step reads (``rows``: the expected
  distinct token ids of a step, for pricing; 0: every token of the step, at most the vocabulary).

Byte counts live here so the cost model prices a format without importing the codec.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .base import FormatError, Reader, to_dict

WIRE_FORMATS = ("fp32", "bf16", "fp16", "int8")
"""Every format of pipeline traffic; ``fp32`` sends the tensor as it is."""
LOSSY = ("bf16", "fp16", "int8", "powersgd", "diloco")
"""The choices the planner makes only when the user allows them (``--allow-lossy``)."""
SYNC_KINDS = {"allreduce": ("fp32", "bf16", "int8"), "powersgd": ("fp32",), "diloco": ("fp32", "bf16", "int8"),
              "rows": ("fp32",)}
"""Each data-parallel sync kind and the wire formats its all-reduce may use (``rows``: the tied pair only)."""
EXACT_SYNCS = ("allreduce", "rows")
"""Sync kinds that in fp32 give every member the single-process sum, bit for bit."""
OPTIMIZERS = ("adamw", "sgd")
"""The optimizers ``torchpp.train`` offers; a plan with lossy choices names the one they were made for
(``Plan.optimizer``): PowerSGD's low-rank gradient trains far worse under AdamW (docs/links.md)."""
POWERSGD_RANK = 4
"""The rank ``torchpp profile`` times PowerSGD's arithmetic at (``codec_s_per_byte.powersgd``); the
cost model scales it by the plan's rank over this."""
SCALE_BYTES = 4
"""int8 carries one fp32 scale per row (a row: one token's hidden vector)."""


def wire_bytes(fmt: str | None, numel: int, row: int) -> int:
    """Bytes on the wire for ``numel`` fp32 elements in rows of ``row`` elements, sent as ``fmt``."""
    fmt = fmt or "fp32"
    if fmt == "fp32":
        return 4 * numel
    if fmt in ("bf16", "fp16"):
        return 2 * numel
    if fmt == "int8":
        return numel + SCALE_BYTES * -(-numel // max(1, row))
    raise ValueError(f"wire format: expected one of {list(WIRE_FORMATS)}, got {fmt!r}")


def wire_ratio(fmt: str | None, row: int) -> float:
    """Bytes on the wire per fp32 byte (1.0 for fp32)."""
    return wire_bytes(fmt, row, row) / (4 * row)


@dataclass(kw_only=True, slots=True)
class Sync:
    """How a device group (or the tied pair) agrees on its weights."""

    kind: str = "allreduce"
    """``allreduce`` every step, ``powersgd`` every step, ``diloco`` every ``H`` steps, or ``rows``
    (the tied pair: the touched rows each way, exact)."""
    wire: str = "fp32"
    """Format of the all-reduce (for diloco: of the parameter change)."""
    H: int = 1
    """diloco: inner steps between two outer steps."""
    outer_lr: float = 0.7
    """diloco: the outer SGD's learning rate (DiLoCo's 0.7)."""
    outer_momentum: float = 0.9
    """diloco: the outer SGD's Nesterov momentum (0: plain SGD)."""
    rank: int = 4
    """powersgd: the rank of its low-rank approximation."""
    rows: int = 0
    """rows: the distinct token ids a step is expected to touch (pricing only; 0: every token of
    the step, at most the vocabulary)."""

    def __post_init__(self) -> None:
        if self.kind not in SYNC_KINDS:
            raise ValueError(f"kind: expected one of {sorted(SYNC_KINDS)}, got {self.kind!r}")
        if self.wire not in SYNC_KINDS[self.kind]:
            raise ValueError(f"wire: expected one of {list(SYNC_KINDS[self.kind])} for {self.kind}, got {self.wire!r}")
        if self.rows < 0:
            raise ValueError(f"rows: expected an integer >= 0 (0: every token of a step), got {self.rows}")
        if self.H < 1 or self.rank < 1:
            raise ValueError(f"H and rank: expected integers >= 1, got H={self.H}, rank={self.rank}")
        if not self.outer_lr > 0 or not 0 <= self.outer_momentum < 1:
            raise ValueError(f"outer_lr > 0 and 0 <= outer_momentum < 1: got {self.outer_lr}, {self.outer_momentum}")

    @property
    def lossy(self) -> bool:
        return self.kind not in EXACT_SYNCS or self.wire != "fp32"

    def to_json(self) -> dict[str, Any]:
        """Only the fields the kind reads."""
        d = to_dict(self)
        keep = {"allreduce": ("kind", "wire"), "powersgd": ("kind", "rank"),
                "diloco": ("kind", "wire", "H", "outer_lr", "outer_momentum"), "rows": ("kind", "rows")}[self.kind]
        return {k: d[k] for k in keep}

    def allreduce_bytes(self, fp32_bytes: float, hidden: int, shape: tuple[int, int] | None = None) -> float:
        """Average bytes one step all-reduces for ``fp32_bytes`` of weights: diloco its outer all-reduce
        spread over H steps (int8: codes plus one scale per 256 elements); powersgd its two rank-r
        factors of each weight matrix: (n + m)·r values of an n × m ``shape`` (the tied weight:
        vocabulary × hidden), else every matrix taken as ``hidden`` × ``hidden`` (2r/hidden of the bytes)."""
        if self.kind == "powersgd":
            if shape is not None:
                return min(fp32_bytes, 4.0 * self.rank * (shape[0] + shape[1]))
            return fp32_bytes * min(1.0, 2 * self.rank / max(1, hidden))
        per = wire_ratio(self.wire, 256) * fp32_bytes
        return per / self.H if self.kind == "diloco" else per


def tied_rows(sync: Sync, vocab: int, tokens: int) -> int:
    """Rows of the tied weight one ``rows`` sync moves each way per step: the plan's expected
    distinct token ids, else every token of the step, never more than the vocabulary."""
    return max(1, min(vocab, sync.rows or tokens))


def parse_sync(r: Reader, key: str) -> Sync | None:
    """``key`` of ``r`` as a :class:`Sync` (None when absent)."""
    if not r.has(key):
        return None
    s = r.obj(key)
    try:
        return Sync(kind=s.str("kind", "allreduce"), wire=s.str("wire", "fp32"), H=s.int("H", 1, min_value=1),
                    outer_lr=s.float("outer_lr", 0.7), outer_momentum=s.float("outer_momentum", 0.9),
                    rank=s.int("rank", 4, min_value=1), rows=s.int("rows", 0, min_value=0))
    except ValueError as e:
        if isinstance(e, FormatError):
            raise
        what, _, rest = str(e).partition(": ")
        raise FormatError(r.source, s.path + "." + what.split(" ")[0], rest.removeprefix("expected ")) from None


def parse_wire(r: Reader, key: str) -> str | None:
    return r.str(key, None, choices=set(WIRE_FORMATS)) if r.has(key) else None
