"""corpus/index.json: a tokenized corpus (a flat token file plus document offsets).

The token file holds every document's tokens back to back (with the end-of-sequence token
after each document when the tokenizer has one), as little-endian uint16 where the
vocabulary fits, else uint32; ``offsets`` (an int64 ``.npy``) holds each document's first
token and the total, so documents are found without reading the tokens. Both are read
through ``numpy.memmap``; this small index says what they are and where they came from.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .base import FormatError, Reader, _load, check_format, to_dict, write_json

TOKENS_KIND, TOKENS_VERSION = "tokens", 1
TOKEN_DTYPES = ("uint16", "uint32")


def token_dtype(vocab_size: int) -> str:
    """The narrowest dtype of ``TOKEN_DTYPES`` that holds every id below ``vocab_size``."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


@dataclass(kw_only=True)
class TokenizerInfo:
    """Which tokenizer made the ids: a hash of its files, so a corpus is never read with another."""

    name: str
    """The tokenizer directory's name, or ``bytes`` (UTF-8 bytes as ids)."""
    hash: str
    vocab_size: int
    eos_id: int | None
    """Appended after every document; None when the tokenizer has no EOS token (bytes)."""


@dataclass(kw_only=True)
class SourceFile:
    """One input file (or ``datasets`` folder) and what it contributed."""

    path: str
    bytes: int
    hash: str
    documents: int
    tokens: int


@dataclass(kw_only=True)
class TokensIndex:
    """index.json of a corpus directory (``torchpp data prepare``)."""

    tokenizer: TokenizerInfo
    dtype: str
    tokens: int
    documents: int
    token_file: str = "tokens.bin"
    offsets_file: str = "offsets.bin"
    """Little-endian int64, ``documents + 1`` token offsets (document i is ``[offsets[i], offsets[i+1])``)."""
    text_column: str = "text"
    split: str | None = None
    sources: list[SourceFile] = field(default_factory=list)
    key: str = ""
    """A hash of the sources' hashes, the text column, the split and the tokenizer's hash."""
    format: str = f"torchpp.{TOKENS_KIND}/{TOKENS_VERSION}"

    def to_json(self) -> dict[str, Any]:
        d = to_dict(self)
        return {"format": d.pop("format"), **d}

    def save(self, path: str | os.PathLike) -> Path:
        data = self.to_json()
        TokensIndex.parse(data, f"{path} (being written)")
        return write_json(path, data)

    @staticmethod
    def load(path: str | os.PathLike) -> "TokensIndex":
        return _load(path, TokensIndex.parse)

    @staticmethod
    def parse(data: Any, source: str) -> "TokensIndex":
        check_format(data, source, TOKENS_KIND, [TOKENS_VERSION])
        r = Reader(data, source)
        t = r.obj("tokenizer")
        eos = t.raw("eos_id", None)
        if eos is not None:
            eos = t.int("eos_id", min_value=0)
        tok = TokenizerInfo(name=t.str("name"), hash=t.str("hash"), vocab_size=t.int("vocab_size", min_value=1),
                            eos_id=eos)
        if eos is not None and eos >= tok.vocab_size:
            raise t.fail("eos_id", f"an id below vocab_size {tok.vocab_size}", eos)
        dtype = r.str("dtype", choices=TOKEN_DTYPES)
        if dtype == "uint16" and tok.vocab_size > 1 << 16:
            raise r.fail("dtype", f"uint32 for a vocabulary of {tok.vocab_size}", dtype)
        sources = [SourceFile(path=s.str("path"), bytes=s.int("bytes", min_value=0), hash=s.str("hash"),
                              documents=s.int("documents", min_value=0), tokens=s.int("tokens", min_value=0))
                   for s in r.objs("sources", [])]
        out = TokensIndex(tokenizer=tok, dtype=dtype, tokens=r.int("tokens", min_value=0),
                          documents=r.int("documents", min_value=0), token_file=_name(r, "token_file"),
                          offsets_file=_name(r, "offsets_file"), text_column=r.str("text_column", "text"),
                          split=r.raw("split", None), sources=sources, key=r.str("key", ""))
        if sources and sum(s.tokens for s in sources) != out.tokens:
            raise r.fail("tokens", f"the sum of the sources' tokens ({sum(s.tokens for s in sources)})", out.tokens)
        return out


def _name(r: Reader, key: str) -> str:
    """A file name inside the corpus directory (never a path out of it)."""
    v = r.str(key, TokensIndex.__dataclass_fields__[key].default)
    if not v or "/" in v or "\\" in v or v in (".", ".."):
        raise r.fail(key, "a file name inside the corpus directory", v)
    return v


def check_corpus_files(index: TokensIndex, root: Path, source: str) -> None:
    """The token and offsets files exist and have the sizes the index says."""
    width = 2 if index.dtype == "uint16" else 4
    tokens = root / index.token_file
    if not tokens.is_file() or tokens.stat().st_size != index.tokens * width:
        got = tokens.stat().st_size if tokens.is_file() else "no file"
        raise FormatError(source, "token_file", f"{tokens} of {index.tokens * width} bytes ({index.tokens} "
                          f"{index.dtype} tokens; prepare the corpus again)", got)
    if not (root / index.offsets_file).is_file():
        raise FormatError(source, "offsets_file", f"an existing file {root / index.offsets_file} (prepare the corpus "
                          "again)")
