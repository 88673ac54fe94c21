"""A prepared corpus read row by row: a rank copies out only its step's rows.

The token stream (documents back to back) is cut into ``seq_len`` blocks; epoch e visits the
blocks in a seeded pseudo-random permutation (a Feistel network over the block numbers, a
pure function of (seed, epoch, position), so nothing of the corpus's size is held), and
step s's batch is positions ``[s·B, (s+1)·B)`` of that endless sequence. Each row is one
``pread`` of its bytes: mapping the file (as nanoGPT does, per batch) put 11–12 MiB of a 130 MB
token file into a rank's peak RSS for 8 rows (the kernel maps pages around each fault, and a
rank's peak counts them), where a read costs the row alone. Data memory is O(global batch),
not O(corpus).

Evaluation holds out ``round(fraction · blocks)`` blocks: the first ones of a seeded permutation
of the block numbers (the *split order*, again a Feistel network), so the split is a pure function
of (seed, blocks, fraction), the same on every rank and every resume, disjoint by construction, and
nothing of the corpus's size is held (an array of held-out or kept blocks for a 200 MB corpus was
O(blocks) on every rank). Epoch e's training order is the split order at ``held + σ_e(i)``, σ_e a
seeded permutation of the ``blocks - held`` training positions. The unit held out is a block, not
a document: a held-out block's neighbours in the same document may be trained on (as with
nanoGPT's token-range split), but no held-out token is.
"""
from __future__ import annotations

import os
from pathlib import Path

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

from ..formats import FormatError, TokensIndex, check_corpus_files
from .base import DataError, seed_of
from .prepare import INDEX

_M1, _M2, _G = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB), np.uint64(0x9E3779B97F4A7C15)


def _mix(x: np.ndarray, key: int) -> np.ndarray:
    """splitmix64 of ``x + key`` (uint64, wrapping)."""
    with np.errstate(over="ignore"):
        z = (x + np.uint64(key & 0xFFFFFFFFFFFFFFFF)) * _G
        z ^= z >> np.uint64(30)
        z *= _M1
        z ^= z >> np.uint64(27)
        z *= _M2
        return z ^ (z >> np.uint64(31))


def permute(pos: np.ndarray, n: int, key: int) -> np.ndarray:
    """A bijection of ``[0, n)`` applied to ``pos``: a 4-round Feistel network on the smallest
    even power of two >= n, cycle-walked back into range."""
    half = max(1, ((max(n, 2) - 1).bit_length() + 1) // 2)
    mask = np.uint64((1 << half) - 1)
    keys = [seed_of("feistel", key, r) for r in range(4)]

    def f(x: np.ndarray) -> np.ndarray:
        left, right = x >> np.uint64(half), x & mask
        for k in keys:
            left, right = right, left ^ (_mix(right, k) & mask)
        return (left << np.uint64(half)) | right

    y = f(np.asarray(pos, dtype=np.uint64))
    out = y >= np.uint64(n)
    while out.any():
        y[out] = f(y[out])
        out = y >= np.uint64(n)
    return y.astype(np.int64)


def is_corpus(path: str | Path) -> bool:
    return (Path(path) / INDEX).is_file()


def load_index(root: str | Path, flag: str = "--data") -> TokensIndex:
    """The corpus index, its token and offsets files checked; one line naming what is wrong."""
    root = Path(root)
    try:
        index = TokensIndex.load(root / INDEX)
        check_corpus_files(index, root, str(root / INDEX))
    except FormatError as e:
        raise DataError(f"{flag}: {e}") from None
    return index


class TokenReader:
    """Tokens ``[start, start + count)`` of a token file, read with ``pread`` (see the module's docstring)."""

    def __init__(self, path: Path, dtype: np.dtype):
        self.path, self.dtype = path, dtype
        self.fd = os.open(path, os.O_RDONLY)

    def read(self, start: int, count: int) -> np.ndarray:
        w = self.dtype.itemsize
        raw = os.pread(self.fd, count * w, start * w)
        if len(raw) != count * w:
            raise DataError(f"--data: {self.path}: ends at byte {start * w + len(raw)}, expected tokens up to byte "
                            f"{(start + count) * w} (the file changed after it was prepared; prepare it again)")
        return np.frombuffer(raw, dtype=self.dtype).astype(np.int64)

    def __enter__(self) -> "TokenReader":
        return self

    def __exit__(self, *exc: object) -> None:
        os.close(self.fd)


class TokenCorpus:
    """Blocks of a prepared corpus, in a seeded order per epoch (see the module's docstring)."""

    def __init__(self, root: str | Path, *, seq_len: int, global_batch: int, seed: int = 0,
                 index: TokensIndex | None = None, flag: str = "--data", held: int = 0):
        self.root = Path(root)
        self.index = index or load_index(self.root, flag)
        self.seq_len, self.global_batch, self.seed = seq_len, global_batch, seed
        self.dtype = np.dtype(self.index.dtype).newbyteorder("<")
        self.blocks = self.index.tokens // seq_len
        if self.blocks < 1:
            raise DataError(f"{flag}: {self.root}: {self.index.tokens} tokens, expected at least seq_len={seq_len} to "
                            "make one training sequence")
        if not 0 <= held < self.blocks:
            raise ValueError(f"held: expected 0 <= held < {self.blocks} blocks, got {held}")
        self.held = held
        """The first ``held`` blocks of the split order are held out (see the module's docstring)."""

    def __len__(self) -> int:
        return self.blocks - self.held

    @property
    def documents(self) -> int:
        return self.index.documents

    def split_order(self, j: np.ndarray) -> np.ndarray:
        """Block numbers at positions ``j`` of the split order (the first ``held`` are held out)."""
        return permute(j, self.blocks, seed_of("held-out", self.seed)) if self.held else np.asarray(j, dtype=np.int64)

    def block_ids(self, step: int) -> np.ndarray:
        """The block numbers of ``step``'s batch."""
        pos = np.arange(step * self.global_batch, (step + 1) * self.global_batch, dtype=np.int64)
        n = len(self)
        epochs, within = np.divmod(pos, n)
        out = np.empty_like(pos)
        for e in np.unique(epochs):
            sel = epochs == e
            out[sel] = permute(within[sel], n, seed_of("epoch", self.seed, int(e)))
        return self.split_order(self.held + out) if self.held else out

    def batch(self, step: int) -> "torch.Tensor":
        import torch

        return torch.from_numpy(self.read_blocks(self.block_ids(step)))

    def read_blocks(self, ids: np.ndarray) -> np.ndarray:
        """Rows ``ids`` as int64, one read each."""
        S = self.seq_len
        with TokenReader(self.root / self.index.token_file, self.dtype) as r:
            return np.stack([r.read(int(i) * S, S) for i in ids])

    def offsets(self) -> np.ndarray:
        """Document boundaries (memory-mapped int64, ``documents + 1`` values)."""
        return np.memmap(self.root / self.index.offsets_file, dtype="<i8", mode="r")


class HeldOut:
    """The held-out blocks (the first ``corpus.held`` of its split order), read in that order."""

    def __init__(self, corpus: TokenCorpus):
        self.corpus, self.seq_len, self.global_batch = corpus, corpus.seq_len, corpus.global_batch

    def __len__(self) -> int:
        return self.corpus.held

    def block_ids(self, step: int) -> np.ndarray:
        pos = np.arange(step * self.global_batch, (step + 1) * self.global_batch, dtype=np.int64)
        return self.corpus.split_order(pos % len(self))

    def batch(self, step: int) -> "torch.Tensor":
        import torch

        return torch.from_numpy(self.corpus.read_blocks(self.block_ids(step)))


def hold_out(corpus: TokenCorpus, fraction: float) -> tuple[TokenCorpus, HeldOut]:
    """(training, evaluation): ``round(fraction · blocks)`` blocks held out by the seeded split order."""
    held = round(fraction * corpus.blocks)
    if not 0 < held < corpus.blocks:
        raise DataError(f"--eval-fraction {fraction}: the corpus has {corpus.blocks} block(s) of {corpus.seq_len} "
                        f"tokens; holding out {held} leaves none for {'evaluation' if held == 0 else 'training'} "
                        "(change --eval-fraction or give --eval-data)")
    train = TokenCorpus(corpus.root, seq_len=corpus.seq_len, global_batch=corpus.global_batch, seed=corpus.seed,
                        index=corpus.index, held=held)
    return train, HeldOut(train)
