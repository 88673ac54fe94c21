"""Input discovery: which files and ``datasets`` folders make a corpus, each checked up front
so a bad input is one line naming it before anything is tokenized.

Forms: ``.txt``/``.md`` (a file is one document), ``.json``/``.jsonl``/``.csv``/``.parquet``
tables and ``.arrow`` files (a row's text column is one document), and ``save_to_disk``
folders (a ``Dataset``, or a ``DatasetDict`` with ``split``). In a data folder, a ``.json``
without the text column is metadata (``dataset_info.json``, a config): it is skipped and said
so; given by name, it is an error. Files of other kinds in a folder are ignored and counted.
"""
from __future__ import annotations

import codecs
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from .base import DataError

TEXTS = (".txt", ".md")
TABLES = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".arrow": "arrow"}
"""Suffix -> the ``datasets`` reader of that table."""
SUFFIXES = (*TEXTS, *TABLES)
PIECE_BYTES = 1 << 20
"""A text file is tokenized in pieces of about this many bytes, cut after a newline (bounded memory)."""


@dataclass(kw_only=True)
class Source:
    """One input: a text file, a table file or a ``datasets`` folder."""

    path: Path
    kind: str
    """``text``, a ``TABLES`` reader, ``dataset`` or ``dataset_dict``."""
    bytes: int = 0
    hash: str = ""
    pieces: list[tuple[int, int]] = field(default_factory=list)
    """Text files: the byte ranges tokenized one by one (their tokens are joined: one document)."""


@dataclass(kw_only=True)
class Inputs:
    sources: list[Source]
    skipped: list[Path] = field(default_factory=list)
    """Metadata .json files of a data folder (no text column)."""
    ignored: int = 0
    """Files of other kinds in a data folder."""

    @property
    def bytes(self) -> int:
        return sum(s.bytes for s in self.sources)


def discover(paths: list[str | Path], *, text_column: str = "text", split: str | None = None,
             flag: str = "--data") -> Inputs:
    """The sources ``paths`` name, in a fixed order, hashed and checked (text decodes, tables
    have ``text_column``, a DatasetDict has ``split``)."""
    out = Inputs(sources=[])
    for p in map(Path, paths):
        if p.is_dir():
            _walk(p, out, text_column, split, flag)
        elif p.is_file():
            if p.suffix not in SUFFIXES:
                raise DataError(f"{flag}: {p}: expected {', '.join(SUFFIXES)} files, a datasets save_to_disk folder "
                                "or a directory of them")
            out.sources.append(_checked(p, text_column, flag, in_folder=False))
        else:
            raise DataError(f"{flag}: {p}: no such file or directory; expected text files, tables or a datasets "
                            "save_to_disk folder")
    out.sources = [s for s in out.sources if s is not None]
    if not out.sources:
        shown = ", ".join(map(str, paths))
        raise DataError(f"{flag}: {shown}: expected {', '.join(SUFFIXES)} files or a datasets save_to_disk folder, "
                        f"found none" + (f" (skipped metadata {', '.join(x.name for x in out.skipped)})"
                                         if out.skipped else ""))
    for s in out.sources:
        _hash(s, flag)
    return out


def saved_kind(d: Path) -> str | None:
    """``dataset``/``dataset_dict`` for a ``save_to_disk`` folder, else None."""
    if (d / "dataset_dict.json").is_file():
        return "dataset_dict"
    if (d / "state.json").is_file() and (d / "dataset_info.json").is_file():
        return "dataset"
    return None


def _walk(root: Path, out: Inputs, column: str, split: str | None, flag: str) -> None:
    kind = saved_kind(root)
    if kind is not None:
        out.sources.append(Source(path=root, kind=kind))
        _check_saved(out.sources[-1], column, split, flag)
        return
    for p in sorted(root.iterdir()):
        if p.name.startswith("."):
            continue
        if p.is_dir():
            _walk(p, out, column, split, flag)
        elif p.suffix not in SUFFIXES:
            out.ignored += 1
        else:
            s = _checked(p, column, flag, in_folder=True)
            if s is None:
                out.skipped.append(p)
            else:
                out.sources.append(s)


def _checked(p: Path, column: str, flag: str, *, in_folder: bool) -> Source | None:
    if p.suffix in TEXTS:
        return Source(path=p, kind="text")
    kind = TABLES[p.suffix]
    names = _columns(p, kind, flag)
    if column not in names:
        if in_folder and p.suffix == ".json":
            return None  # metadata beside the data
        raise DataError(f"{flag}: {p}: text column '{column}' not found; the table has columns {names} "
                        "(name the text column with --text-column)")
    return Source(path=p, kind=kind)


def _columns(p: Path, kind: str, flag: str) -> list[str]:
    """The column names of a table, read from its schema or first record only."""
    try:
        if kind == "parquet":
            import pyarrow.parquet as pq

            return list(pq.read_schema(p).names)
        if kind == "arrow":
            import pyarrow as pa

            with pa.memory_map(str(p)) as f:
                return list(pa.ipc.open_stream(f).schema.names)
        if kind == "csv":
            import csv

            with open(p, newline="", encoding="utf-8") as f:
                return next(csv.reader(f), [])
        return _json_columns(p)
    except (OSError, ValueError, UnicodeDecodeError, StopIteration) as e:
        reason = " ".join(str(e).split())[:160] or type(e).__name__
        what = "an arrow stream (as datasets writes)" if kind == "arrow" else f"a {kind} table"
        raise DataError(f"{flag}: {p}: cannot be read as {what} ({reason})") from None


def _json_columns(p: Path) -> list[str]:
    """Keys of the first record: JSON lines, a list of records, or ``{"data": [...]}`` is not a table."""
    with open(p, "rb") as f:
        head = f.read(1 << 16).lstrip()
    if head.startswith(b"["):
        obj = json.loads(p.read_bytes()) if p.stat().st_size <= 1 << 26 else None
        if isinstance(obj, list) and obj and isinstance(obj[0], dict):
            return list(obj[0])
        return []
    line = head.split(b"\n", 1)[0]
    try:
        rec = json.loads(line)
    except json.JSONDecodeError:  # one object over several lines: metadata, or a table datasets reads whole
        rec = json.loads(p.read_bytes()) if p.stat().st_size <= 1 << 26 else {}
    return list(rec) if isinstance(rec, dict) else []


def _check_saved(s: Source, column: str, split: str | None, flag: str) -> None:
    from datasets import load_from_disk

    try:
        ds = load_from_disk(str(s.path))
    except Exception as e:  # datasets raises many kinds; the user needs the folder and the reason
        raise DataError(f"{flag}: {s.path}: cannot be read as a datasets save_to_disk folder "
                        f"({' '.join(str(e).split())[:160]})") from None
    if s.kind == "dataset_dict":
        if split is None:
            if len(ds) != 1:
                raise DataError(f"{flag}: {s.path}: a DatasetDict with splits {list(ds)}; choose one with --split")
            split = next(iter(ds))
        if split not in ds:
            raise DataError(f"{flag}: {s.path}: split '{split}' not found; the DatasetDict has splits {list(ds)} "
                            "(--split)")
        ds = ds[split]
    if column not in ds.column_names:
        raise DataError(f"{flag}: {s.path}: text column '{column}' not found; the dataset has columns "
                        f"{ds.column_names} (name the text column with --text-column)")


def _hash(s: Source, flag: str) -> None:
    """sha256 and size of the source (a folder: its data files); text files are checked to be
    UTF-8 without NUL bytes and cut into pieces on the way."""
    h = hashlib.sha256()
    files = sorted(f for f in s.path.rglob("*") if f.is_file()) if s.path.is_dir() else [s.path]
    dec = codecs.getincrementaldecoder("utf-8")() if s.kind == "text" else None
    pos, start = 0, 0
    for f in files:
        if s.path.is_dir():
            h.update(f"{f.relative_to(s.path)}\n".encode())
        with open(f, "rb") as fh:
            while chunk := fh.read(PIECE_BYTES):
                h.update(chunk)
                if dec is not None:
                    _check_text(dec, chunk, s.path, pos, flag)
                    cut = chunk.rfind(b"\n")
                    if pos + len(chunk) - start >= PIECE_BYTES and cut >= 0:
                        s.pieces.append((start, pos + cut + 1))
                        start = pos + cut + 1
                pos += len(chunk)
    if dec is not None:
        _check_text(dec, b"", s.path, pos, flag, final=True)
        if pos > start or not s.pieces:
            s.pieces.append((start, pos))
    s.bytes, s.hash = pos, "sha256:" + h.hexdigest()[:16]


def _check_text(dec, chunk: bytes, path: Path, pos: int, flag: str, final: bool = False) -> None:
    try:
        dec.decode(chunk, final=final)
    except UnicodeDecodeError as e:
        raise DataError(f"{flag}: {path}: not UTF-8 text (undecodable byte at offset {pos + e.start}); expected a text "
                        f"file or a table ({', '.join(TABLES)})") from None
    if b"\x00" in chunk:
        raise DataError(f"{flag}: {path}: a binary file (NUL byte at offset {pos + chunk.index(0)}); expected a text "
                        f"file or a table ({', '.join(TABLES)})")
