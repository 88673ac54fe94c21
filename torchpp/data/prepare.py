"""Tokenize once: sources -> ``corpus/`` (a flat token file, document offsets, ``index.json``).

Tokenizing runs through ``datasets.map(batched=True, num_proc=...)`` with the fast tokenizer,
shard by shard (about ``SHARD_BYTES`` of input each): every shard's ids are appended to the
token file and its arrow cache deleted before the next, so memory and scratch disk stay
bounded whatever the corpus size, and progress (tokens/s) is reported between shards.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from ..formats import SourceFile, TokenizerInfo, TokensIndex, token_dtype
from .base import DataError
from .docsplit import DocSplitter
from .sources import Inputs, Source, discover

SHARD_BYTES = 32 << 20
"""Input bytes tokenized per ``datasets.map`` call (its arrow cache is deleted after it)."""
BATCH_BYTES = 256 << 10
"""Input bytes per ``map`` batch (rows of about this much text together): the fast tokenizer holds
~450 bytes a token while it encodes a batch (offsets, token strings, words) and a worker keeps its
high-water mark, so 1,000 rows of 200 kB source files — the ``datasets`` default — would hold
~2 GB in each worker; 256 kB holds ~30 MB (measured on a 40 MB JSONL of Python sources: the
whole prepare's peak PSS 1,067 MiB with 4 MB, 671 with 1 MB, 598 with 256 kB). A document larger
than ``docsplit.SPLIT_CHARS`` is encoded in pieces cut where the ids provably do not change (a 4.4 MB
file held ~600 MB encoded whole)."""
INDEX = "index.json"


@dataclass
class Progress:
    tokens: int
    bytes_done: int
    bytes_total: int
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def corpus_key(inputs: Inputs, info: TokenizerInfo, text_column: str, split: str | None) -> str:
    """What a prepared corpus is a function of: the sources' contents, the column, the split, the tokenizer."""
    h = hashlib.sha256(f"{info.hash}\n{text_column}\n{split}\n".encode())
    for s in inputs.sources:
        h.update(f"{s.kind}:{s.hash}:{s.bytes}\n".encode())
    return h.hexdigest()[:20]


def prepare_corpus(data: list[str | Path], out: str | Path, *, tokenizer: str | Path, text_column: str = "text",
                   split: str | None = None, num_proc: int | None = None,
                   progress: Callable[[Progress], None] | None = None, inputs: Inputs | None = None) -> TokensIndex:
    """Tokenize ``data`` into ``out`` (created, or a previous corpus there replaced); returns its index."""
    from .tokenizer import load_encoder

    inputs = inputs or discover(data, text_column=text_column, split=split)
    tok, info = load_encoder(tokenizer)
    out = _out_dir(Path(out))
    dtype = token_dtype(info.vocab_size)
    scratch = out / ".prepare"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir()
    w = _Writer(out, dtype)
    t0, done = time.perf_counter(), 0
    try:
        for s in inputs.sources:
            w.source_start()
            for shard in _shards(s, text_column, split, scratch, tok):
                w.write(_tokenize(shard.ds, tok, info, dtype, num_proc, scratch, shard.bytes))
                done += shard.bytes
                if progress is not None:
                    progress(Progress(w.tokens, done, inputs.bytes, time.perf_counter() - t0))
            docs, toks = w.source_end()
            if docs == 0:
                raise DataError(f"--data: {s.path}: no text documents (the column '{text_column}' holds no strings)")
            w.sources.append(SourceFile(path=str(s.path), bytes=s.bytes, hash=s.hash, documents=docs, tokens=toks))
        w.close()
    finally:
        w.abort()
        shutil.rmtree(scratch, ignore_errors=True)
    index = TokensIndex(tokenizer=info, dtype=dtype, tokens=w.tokens, documents=w.documents, text_column=text_column,
                        split=split, sources=w.sources, key=corpus_key(inputs, info, text_column, split))
    index.save(out / INDEX)
    return index


def _out_dir(out: Path) -> Path:
    if out.exists() and not out.is_dir():
        raise DataError(f"--out: {out}: expected a directory for the corpus, found a file")
    if out.is_dir() and any(p.name != ".prepare" for p in out.iterdir()) and not (out / INDEX).is_file():
        raise DataError(f"--out: {out}: expected an empty directory or a previous corpus (index.json) to replace; "
                        "it holds other files")
    out.mkdir(parents=True, exist_ok=True)
    (out / INDEX).unlink(missing_ok=True)  # the index comes last: no index, no corpus
    return out


class _Writer:
    """Appends each shard's ids to the token file and document ends to the offsets file."""

    def __init__(self, out: Path, dtype: str):
        self.out, self.dtype = out, dtype
        self.tok_f = open(out / ".tokens.bin.tmp", "wb")
        self.off_f = open(out / ".offsets.bin.tmp", "wb")
        np.zeros(1, dtype="<i8").tofile(self.off_f)
        self.tokens = self.documents = 0
        self.sources: list[SourceFile] = []
        self._mark = (0, 0)

    def write(self, batches: Iterator[Any]) -> None:
        import pyarrow.compute as pc

        for table in batches:
            col = table.column("ids").combine_chunks()
            flat = pc.list_flatten(col).to_numpy(zero_copy_only=False)
            np.asarray(flat, dtype=self.dtype).tofile(self.tok_f)
            lens = pc.list_value_length(col).to_numpy(zero_copy_only=False).astype(np.int64)
            ends = self.tokens + np.cumsum(lens)
            doc = table.column("doc").to_numpy(zero_copy_only=False).astype(bool)
            ends[doc].astype("<i8").tofile(self.off_f)
            self.tokens = int(ends[-1]) if len(ends) else self.tokens
            self.documents += int(doc.sum())

    def source_start(self) -> None:
        self._mark = (self.documents, self.tokens)

    def source_end(self) -> tuple[int, int]:
        return self.documents - self._mark[0], self.tokens - self._mark[1]

    def close(self) -> None:
        for f in (self.tok_f, self.off_f):
            f.flush()
            os.fsync(f.fileno())
            f.close()
        os.replace(self.out / ".tokens.bin.tmp", self.out / "tokens.bin")
        os.replace(self.out / ".offsets.bin.tmp", self.out / "offsets.bin")

    def abort(self) -> None:
        for f in (self.tok_f, self.off_f):
            f.close()
        for name in (".tokens.bin.tmp", ".offsets.bin.tmp"):
            (self.out / name).unlink(missing_ok=True)


@dataclass
class _Shard:
    ds: Any
    bytes: int


def _shards(s: Source, column: str, split: str | None, scratch: Path, tok: Any = None) -> Iterator[_Shard]:
    """The source as ``datasets`` shards of about ``SHARD_BYTES`` input bytes, columns ``text`` (+ ``end``)."""
    if s.kind == "text":
        group: list[tuple[int, int, bool]] = []
        size, shards = 0, 0
        for row in _text_rows(s, tok):
            group.append(row)
            size += row[1] - row[0]
            if size >= SHARD_BYTES:
                yield _Shard(_text_dataset(s.path, group, scratch), size)
                group, size, shards = [], 0, shards + 1
        if group or not shards:
            yield _Shard(_text_dataset(s.path, group, scratch), size)
        return
    ds = _table(s, column, split, scratch)
    n = len(ds)
    per = max(1, int(n * SHARD_BYTES / max(1, s.bytes)))
    for a in range(0, max(n, 1), per):
        b = min(n, a + per)
        yield _Shard(ds.select(range(a, b)), s.bytes * (b - a) // max(1, n))


def _text_rows(s: Source, tok: Any) -> Iterator[tuple[int, int, bool]]:
    """A text file's rows (byte ranges, and whether the file ends there): its pieces (read to bound
    memory) cut again where the tokenizer's ids do not change (``DocSplitter.cuts``), so the rows
    encoded apart give the ids of the file encoded whole.
    UTF-8 bytes cut anywhere; a tokenizer that cannot be proven is cut at the pieces' newlines, said once."""
    last = len(s.pieces) - 1
    if not isinstance(tok, DocSplitter) or tok.reason is not None:
        if isinstance(tok, DocSplitter) and last > 0:
            warnings.warn(f"{s.path}: read in {last + 1} pieces cut after a newline: the ids beside each cut may "
                          f"differ from the file's encoded whole ({tok.reason})", stacklevel=2)
        yield from ((a, b, i == last) for i, (a, b) in enumerate(s.pieces))
        return
    start = s.pieces[0][0]
    with open(s.path, "rb") as f:
        for i, (_, b) in enumerate(s.pieces):
            f.seek(start)
            text = f.read(b - start).decode("utf-8")
            cuts = list(tok.cuts(text, final=i == last))
            for x, y in zip(cuts, cuts[1:]):
                n = len(text[x:y].encode("utf-8"))
                yield start, start + n, i == last and y == len(text)
                start += n


def _rows(path: str, rows: list[tuple[int, int, bool]]) -> Iterator[dict]:
    with open(path, "rb") as f:
        for a, b, end in rows:
            f.seek(a)
            yield {"text": f.read(b - a).decode("utf-8"), "end": end}


def _text_dataset(path: Path, rows: list[tuple[int, int, bool]], scratch: Path) -> Any:
    from datasets import Dataset, Features, Value

    return Dataset.from_generator(_rows, features=Features({"text": Value("string"), "end": Value("bool")}),
                                  gen_kwargs={"path": str(path), "rows": rows},
                                  cache_dir=str(scratch / "cache"), keep_in_memory=False)


def _table(s: Source, column: str, split: str | None, scratch: Path) -> Any:
    import datasets

    cache = str(scratch / "cache")
    try:
        if s.kind in ("dataset", "dataset_dict"):
            ds = datasets.load_from_disk(str(s.path))
            if s.kind == "dataset_dict":
                ds = ds[split] if split is not None else next(iter(ds.values()))
        elif s.kind == "arrow":
            ds = datasets.Dataset.from_file(str(s.path))
        else:
            reader = {"json": datasets.Dataset.from_json, "csv": datasets.Dataset.from_csv,
                      "parquet": datasets.Dataset.from_parquet}[s.kind]
            ds = reader(str(s.path), cache_dir=cache)
    except Exception as e:  # datasets/pyarrow raise many kinds; the user needs the file and the reason
        reason = " ".join(str(e).split())[:200] or type(e).__name__
        raise DataError(f"--data: {s.path}: cannot be read as a {s.kind} table ({reason})") from None
    ds = ds.select_columns([column])
    return ds.rename_column(column, "text") if column != "text" else ds


def _encode(batch: dict, *, tok: Any, eos: int | None, dtype: str) -> dict:
    """Ids of a batch of rows (the EOS after each row that ends a document); non-strings give none."""
    texts = batch["text"]
    ok = [isinstance(t, str) for t in texts]
    ends = [o and e for o, e in zip(ok, batch.get("end") or [True] * len(texts))]
    if tok is None:
        ids = [list(t.encode("utf-8")) if o else [] for t, o in zip(texts, ok)]
    elif isinstance(tok, DocSplitter):  # the fast tokenizer's backend (``load_encoder``)
        ids = [x if o else [] for x, o in zip(tok.ids_batch([t if o else "" for t, o in zip(texts, ok)]), ok)]
    else:
        ids = tok([t if o else "" for t, o in zip(texts, ok)], add_special_tokens=False,
                  return_attention_mask=False)["input_ids"]
        ids = [x if o else [] for x, o in zip(ids, ok)]
    out = [np.asarray(x, dtype=dtype) for x in ids]
    if eos is not None:
        out = [np.append(x, np.asarray([eos], dtype=dtype)) if e else x for x, e in zip(out, ends)]
    return {"ids": out, "doc": ends}


def _tokenize(ds: Any, tok: Any, info: TokenizerInfo, dtype: str, num_proc: int | None, scratch: Path,
              nbytes: int) -> Iterator[Any]:
    """``datasets.map`` over one shard of ``nbytes`` input bytes; yields arrow tables of ``ids`` and ``doc``."""
    from datasets import Features, Sequence, Value

    procs = max(1, min(num_proc or os.cpu_count() or 1, len(ds)))
    rows = max(1, min(1000, BATCH_BYTES * max(1, len(ds)) // max(1, nbytes)))
    feats = Features({"ids": Sequence(Value(dtype)), "doc": Value("bool")})
    fp = hashlib.sha256(f"{ds._fingerprint}:{info.hash}:{dtype}".encode()).hexdigest()[:16]
    mapped = ds.map(_encode, batched=True, batch_size=rows, writer_batch_size=rows,
                    num_proc=procs if procs > 1 else None, features=feats, remove_columns=ds.column_names,
                    fn_kwargs={"tok": tok, "eos": info.eos_id, "dtype": dtype}, new_fingerprint=fp,
                    cache_file_name=str(scratch / f"map-{fp}.arrow"), desc="tokenizing")
    yield from mapped.with_format("arrow").iter(batch_size=8192)
    for f in mapped.cache_files:  # ours, in the scratch folder: the disk stays bounded too
        Path(f["filename"]).unlink(missing_ok=True)
