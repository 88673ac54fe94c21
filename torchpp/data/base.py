"""What every token source shares: the error type, the batch protocol, seeded synthetic tokens."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch


class DataError(ValueError):
    """Bad data or tokenizer input; the message names the file and the fix (exit 2)."""


class TokenSource(Protocol):
    def batch(self, step: int) -> "torch.Tensor":
        """The global batch of ``step``: int64 token ids of shape (global_batch, seq_len)."""
        ...


def seed_of(*parts: object) -> int:
    """A 63-bit seed derived from ``parts`` (the same on every rank and every run)."""
    return int.from_bytes(hashlib.sha256(":".join(map(str, parts)).encode()).digest()[:8], "little") & ((1 << 63) - 1)


@dataclass(frozen=True, slots=True)
class SyntheticTokens:
    """Uniform random tokens, a function of (seed, step) only; for speed runs and tests."""

    vocab_size: int
    seq_len: int
    global_batch: int
    seed: int = 0

    def batch(self, step: int) -> "torch.Tensor":
        import torch

        g = torch.Generator().manual_seed(seed_of("synthetic", self.seed, step))
        return torch.randint(0, self.vocab_size, (self.global_batch, self.seq_len), generator=g, dtype=torch.int64)
