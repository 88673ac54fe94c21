"""A prepared corpus read row by row: a rank copies out only its step's rows.

The token stream (documents back to back) is cut into ``seq_len`` blocks; epoch e visits the
blocks in a seeded pseudo-random permutation (a Feistel network over the block numbers, a
pure function of (seed, epoch, position), so nothing of the corpus's size is held), and
step s's batch is positions ``[s·B, (s+1)·B)`` of that endless sequence. Each row is one
``pread`` of its bytes: mapping the file (as nanoGPT does, per batch) put 11–12 MiB of a 130 MB
token file into a rank's peak RSS for 8 rows (the kernel maps pages around each fault, and a
rank's peak counts them), where a read costs the row alone. Data memory is O(global batch),
not O(corpus).

Evaluation holds out whole documents, each chosen by a seeded draw of its own (not by file
name or position); training skips the blocks that touch a held-out document and keeps the
order of every other block exactly as without held-out data.
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
                 index: TokensIndex | None = None, flag: str = "--data"):
        self.root = Path(root)
        self.index = index or load_index(self.root, flag)
        self.seq_len, self.global_batch, self.seed = seq_len, global_batch, seed
        self.dtype = np.dtype(self.index.dtype).newbyteorder("<")
        self.blocks = self.index.tokens // seq_len
        if self.blocks < 1:
            raise DataError(f"{flag}: {self.root}: {self.index.tokens} tokens, expected at least seq_len={seq_len} to "
                            "make one training sequence")
        self.keep: np.ndarray | None = None
        """Block numbers training visits (None: all), when documents are held out."""
        self._order: tuple[int, np.ndarray] | None = None

    def __len__(self) -> int:
        return self.blocks if self.keep is None else len(self.keep)

    @property
    def documents(self) -> int:
        return self.index.documents

    def block_ids(self, step: int) -> np.ndarray:
        """The block numbers of ``step``'s batch."""
        pos = np.arange(step * self.global_batch, (step + 1) * self.global_batch, dtype=np.int64)
        n = len(self)
        epochs, within = np.divmod(pos, n)
        out = np.empty_like(pos)
        for e in np.unique(epochs):
            sel = epochs == e
            out[sel] = self._epoch_order(int(e), within[sel])
        return out

    def _epoch_order(self, epoch: int, within: np.ndarray) -> np.ndarray:
        key = seed_of("epoch", self.seed, epoch)
        if self.keep is None:
            return permute(within, self.blocks, key)
        if self._order is None or self._order[0] != epoch:  # the full order with the held-out blocks skipped
            order = permute(np.arange(self.blocks, dtype=np.int64), self.blocks, key)
            self._order = (epoch, order[np.isin(order, self.keep, assume_unique=True)].astype(np.int64))
        return self._order[1][within]

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
    """The held-out documents' tokens back to back, cut into ``seq_len`` blocks in document order."""

    def __init__(self, corpus: TokenCorpus, spans: np.ndarray):
        self.corpus, self.spans = corpus, spans  # (k, 2) token ranges
        self.cum = np.concatenate([[0], np.cumsum(spans[:, 1] - spans[:, 0])])
        self.seq_len, self.global_batch = corpus.seq_len, corpus.global_batch
        self.blocks = int(self.cum[-1]) // self.seq_len

    def __len__(self) -> int:
        return self.blocks

    def batch(self, step: int) -> "torch.Tensor":
        import torch

        S = self.seq_len
        with TokenReader(self.corpus.root / self.corpus.index.token_file, self.corpus.dtype) as r:
            rows = []
            for pos in range(step * self.global_batch, (step + 1) * self.global_batch):
                start = (pos % self.blocks) * S
                parts, need = [], S
                j = int(np.searchsorted(self.cum, start, side="right")) - 1
                off = start - int(self.cum[j])
                while need:
                    a, b = int(self.spans[j, 0]) + off, int(self.spans[j, 1])
                    take = min(need, b - a)
                    parts.append(r.read(a, take))
                    need -= take
                    j, off = j + 1, 0
                rows.append(np.concatenate(parts))
        return torch.from_numpy(np.stack(rows))


def hold_out(corpus: TokenCorpus, fraction: float) -> tuple[TokenCorpus, HeldOut]:
    """(training, evaluation): each document is held out when its seeded draw is below ``fraction``."""
    offs = corpus.offsets()
    n_docs = len(offs) - 1
    draw = _mix(np.arange(n_docs, dtype=np.uint64), seed_of("held-out", corpus.seed)) >> np.uint64(11)
    held = np.flatnonzero(draw.astype(np.float64) / float(1 << 53) < fraction)
    if len(held) == 0 or len(held) == n_docs:
        raise DataError(f"--eval-fraction {fraction}: the corpus has {n_docs} document(s); holding out whole "
                        f"documents leaves {'none' if len(held) == 0 else 'all'} for "
                        f"{'evaluation' if len(held) == 0 else 'training'} (change --eval-fraction or give "
                        "--eval-data)")
    spans = np.stack([np.asarray(offs[held]), np.asarray(offs[held + 1])], axis=1)
    ev = HeldOut(corpus, spans)
    if len(ev) < 1:
        raise DataError(f"--eval-fraction {fraction}: the {len(held)} held-out document(s) hold {int(ev.cum[-1])} "
                        f"tokens, fewer than one sequence of {corpus.seq_len}; raise --eval-fraction")
    S = corpus.seq_len
    touched = np.zeros(corpus.blocks, dtype=bool)
    for a, b in spans:
        if b > a:
            touched[int(a) // S: min(corpus.blocks, (int(b) - 1) // S + 1)] = True
    train = TokenCorpus(corpus.root, seq_len=S, global_batch=corpus.global_batch, seed=corpus.seed, index=corpus.index)
    train.keep = np.flatnonzero(~touched)
    if len(train.keep) == 0:
        raise DataError(f"--eval-fraction {fraction}: every training sequence touches a held-out document; "
                        "lower --eval-fraction or give --eval-data")
    return train, ev
