"""Token batches for training: local text/JSON files (via ``datasets``) or a synthetic source.

Every rank that needs tokens (the first stage for inputs, the last stage for labels) computes
the same global batch for a given step, so the data order is a pure function of
(seed, step): a run resumed from a checkpoint at step k sees exactly the batches an
uninterrupted run would have seen. Nothing is downloaded.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch


class DataError(ValueError):
    pass


class TokenSource(Protocol):
    def batch(self, step: int) -> torch.Tensor:
        """The global batch of ``step``: int64 token ids of shape (global_batch, seq_len)."""
        ...


def _seed(*parts: object) -> int:
    return int.from_bytes(hashlib.sha256(":".join(map(str, parts)).encode()).digest()[:8], "little") & ((1 << 63) - 1)


@dataclass(frozen=True, slots=True)
class SyntheticTokens:
    """Uniform random tokens, a function of (seed, step) only; for speed runs and tests."""

    vocab_size: int
    seq_len: int
    global_batch: int
    seed: int = 0

    def batch(self, step: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(_seed("synthetic", self.seed, step))
        return torch.randint(0, self.vocab_size, (self.global_batch, self.seq_len), generator=g, dtype=torch.int64)


class PackedText:
    """Local ``.txt``/``.json``/``.jsonl`` files, tokenised, concatenated and cut into ``seq_len`` blocks.

    Blocks are visited in a seeded permutation per epoch; the step's batch is the next
    ``global_batch`` blocks of that endless sequence. Presets have no tokenizer, so their
    text is tokenised as UTF-8 bytes (vocabularies of at least 256 tokens); a local model
    directory with a tokenizer uses it.
    """

    def __init__(self, paths: list[Path], *, seq_len: int, global_batch: int, vocab_size: int, seed: int = 0,
                 tokenizer_dir: str | Path | None = None, text_field: str = "text"):
        self.seq_len, self.global_batch, self.seed = seq_len, global_batch, seed
        texts = _read_texts(paths, text_field)
        ids = _tokenize(texts, vocab_size, tokenizer_dir)
        n = len(ids) // seq_len
        if n < 1:
            raise DataError(f"--data: {', '.join(map(str, paths))}: {len(ids)} tokens, expected at least "
                            f"seq_len={seq_len} to make one training sequence")
        self.blocks = torch.tensor(ids[: n * seq_len], dtype=torch.int64).view(n, seq_len)
        self._perms: dict[int, torch.Tensor] = {}

    def __len__(self) -> int:
        return self.blocks.shape[0]

    def _perm(self, epoch: int) -> torch.Tensor:
        if epoch not in self._perms:
            g = torch.Generator().manual_seed(_seed("epoch", self.seed, epoch))
            self._perms = {epoch: torch.randperm(len(self), generator=g)}
        return self._perms[epoch]

    def batch(self, step: int) -> torch.Tensor:
        rows = []
        for pos in range(step * self.global_batch, (step + 1) * self.global_batch):
            epoch, i = divmod(pos, len(self))
            rows.append(self.blocks[self._perm(epoch)[i]])
        return torch.stack(rows)


def _files(path: Path) -> list[Path]:
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix in (".txt", ".json", ".jsonl") and p.is_file())
        if not files:
            raise DataError(f"--data: {path}: expected .txt, .json or .jsonl files in the directory, found none")
        return files
    if not path.is_file():
        raise DataError(f"--data: {path}: expected 'synthetic', a text/JSON file or a directory of them")
    return [path]


def _read_texts(paths: list[Path], field: str) -> list[str]:
    import datasets
    from datasets import Dataset

    datasets.disable_progress_bars()
    texts: list[str] = []
    for p in paths:
        if p.suffix in (".json", ".jsonl"):
            ds = Dataset.from_json(str(p), keep_in_memory=True)
            if field not in ds.column_names:
                raise DataError(f"{p}: field '{field}': expected a text column, found columns {ds.column_names}")
            texts += [t for t in ds[field] if isinstance(t, str)]
        else:
            ds = Dataset.from_text(str(p), keep_in_memory=True, sample_by="document")
            texts += list(ds["text"])
    return texts


def _tokenize(texts: list[str], vocab_size: int, tokenizer_dir: str | Path | None) -> list[int]:
    if tokenizer_dir is not None and any((Path(tokenizer_dir) / f).is_file()
                                         for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json")):
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True, trust_remote_code=False)
        eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
        out: list[int] = []
        for t in texts:
            out += tok(t, add_special_tokens=False)["input_ids"] + eos
        return out
    if vocab_size < 256:
        raise DataError(f"--data: byte tokenisation needs a vocabulary of at least 256 tokens, the model has {vocab_size}")
    out = []
    for t in texts:
        out += list(t.encode("utf-8"))
    return out


def open_source(data: str, *, seq_len: int, global_batch: int, vocab_size: int, seed: int,
                tokenizer_dir: str | Path | None = None) -> TokenSource:
    """``--data synthetic`` or a local path (file or directory of .txt/.json/.jsonl)."""
    if data == "synthetic":
        return SyntheticTokens(vocab_size=vocab_size, seq_len=seq_len, global_batch=global_batch, seed=seed)
    return PackedText(_files(Path(data)), seq_len=seq_len, global_batch=global_batch, vocab_size=vocab_size,
                      seed=seed, tokenizer_dir=tokenizer_dir)
