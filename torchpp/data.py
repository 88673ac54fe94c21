"""Token batches for training: local text, JSON, CSV or Parquet files (via ``datasets``) or a synthetic source.

Tables (``.json``/``.jsonl``/``.csv``/``.parquet``) are read by column: the text column
(``text`` unless named) is the training text, every other column is ignored. Anything else is
read as UTF-8 text; a file that does not decode (a binary file) is refused, naming it.

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


TABLES = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}
"""Suffix -> the ``datasets`` builder that reads it as a table."""
TEXTS = (".txt", ".md")
SUFFIXES = (*TEXTS, *TABLES)


class PackedText:
    """Local text files and tables, tokenised, concatenated and cut into ``seq_len`` blocks.

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
        files = sorted(p for p in path.rglob("*") if p.suffix in SUFFIXES and p.is_file())
        if not files:
            raise DataError(f"--data: {path}: expected {', '.join(SUFFIXES)} files in the directory, found none")
        return files
    if not path.is_file():
        raise DataError(f"--data: {path}: expected 'synthetic', a text/JSON/CSV/Parquet file or a directory of them")
    return [path]


def _read_texts(paths: list[Path], field: str) -> list[str]:
    import datasets

    datasets.disable_progress_bars()
    texts: list[str] = []
    for p in paths:
        texts += _read_table(p, field) if p.suffix in TABLES else _read_text(p)
    return texts


def _read_table(path: Path, column: str) -> list[str]:
    """The ``column`` of a JSON/CSV/Parquet table; non-string cells (missing values) are skipped."""
    from datasets import Dataset

    reader = {"json": Dataset.from_json, "csv": Dataset.from_csv, "parquet": Dataset.from_parquet}[TABLES[path.suffix]]
    try:
        ds = reader(str(path), keep_in_memory=True)
    except Exception as e:  # datasets/pyarrow raise many kinds; the user needs the file and the reason
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DataError(f"--data: {path}: cannot be read as a {TABLES[path.suffix]} table ({reason[:200]})") from None
    if column not in ds.column_names:
        raise DataError(f"--data: {path}: text column '{column}' not found; the table has columns {ds.column_names} "
                        "(name the text column with --text-column)")
    return [t for t in ds[column] if isinstance(t, str)]


def _read_text(path: Path) -> list[str]:
    """The whole file as one document; refused when it is not UTF-8 text (a binary file)."""
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"--data: {path}: not UTF-8 text (undecodable byte at offset {e.start}); expected a text file "
                        f"or a table ({', '.join(TABLES)})") from None
    if "\x00" in text:
        raise DataError(f"--data: {path}: a binary file (NUL bytes); expected a text file or a table "
                        f"({', '.join(TABLES)})")
    return [text]


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
                tokenizer_dir: str | Path | None = None, text_column: str = "text") -> TokenSource:
    """``--data synthetic`` or a local path (a file or a directory of text files and tables);
    ``text_column`` names the text column of tables."""
    if data == "synthetic":
        return SyntheticTokens(vocab_size=vocab_size, seq_len=seq_len, global_batch=global_batch, seed=seed)
    return PackedText(_files(Path(data)), seq_len=seq_len, global_batch=global_batch, vocab_size=vocab_size,
                      seed=seed, tokenizer_dir=tokenizer_dir, text_field=text_column)


def held_out(source: TokenSource, fraction: float) -> tuple[TokenSource, TokenSource]:
    """(training, evaluation) sources: the last ``fraction`` of a text source's blocks are held
    out of training; synthetic tokens get an independent evaluation stream."""
    if not 0 < fraction < 1:
        raise DataError(f"--eval-fraction: expected a fraction in (0, 1), got {fraction}")
    if isinstance(source, SyntheticTokens):
        return source, SyntheticTokens(vocab_size=source.vocab_size, seq_len=source.seq_len,
                                       global_batch=source.global_batch, seed=_seed("eval", source.seed) & 0xFFFFFFFF)
    if not isinstance(source, PackedText):
        raise DataError(f"--eval-fraction: cannot split a {type(source).__name__}; pass --eval-data")
    n = len(source)
    k = max(1, round(n * fraction))
    if n - k < 1:
        raise DataError(f"--eval-fraction {fraction}: the data has {n} sequences, too few to hold {k} out")
    return _with_blocks(source, source.blocks[: n - k]), _with_blocks(source, source.blocks[n - k:])


def _with_blocks(source: PackedText, blocks: torch.Tensor) -> PackedText:
    out = PackedText.__new__(PackedText)
    out.seq_len, out.global_batch, out.seed = source.seq_len, source.global_batch, source.seed
    out.blocks, out._perms = blocks, {}
    return out
