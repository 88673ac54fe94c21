"""Which tokenizer turns text into ids, and the checks that keep a model from training on the
wrong ids: a tokenizer is a HF tokenizer directory or ``bytes`` (UTF-8 bytes as ids, asked for
by name, never a silent fallback), known by a hash of its files."""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from ..formats import TokenizerInfo
from .base import DataError

BYTES = "bytes"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "tokenizer.model", "added_tokens.json", "vocab.txt", "spiece.model")
"""The files that decide the ids (chat templates do not)."""


def has_tokenizer(d: str | Path) -> bool:
    return Path(d).is_dir() and any((Path(d) / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json",
                                                                        "vocab.json", "tokenizer.model"))


def tokenizer_hash(d: str | Path) -> str:
    """sha256 of the tokenizer files' names and contents."""
    h = hashlib.sha256()
    for name in TOKENIZER_FILES:
        f = Path(d) / name
        if f.is_file():
            h.update(f"{name}:{f.stat().st_size}\n".encode())
            h.update(f.read_bytes())
    return "sha256:" + h.hexdigest()[:16]


def load_tokenizer(spec: str | Path, flag: str = "--tokenizer") -> tuple[Any, TokenizerInfo]:
    """(HF tokenizer or None for bytes, its info); a directory without tokenizer files is refused."""
    if str(spec) == BYTES:
        return None, TokenizerInfo(name=BYTES, hash=BYTES, vocab_size=256, eos_id=None)
    d = Path(spec)
    if not has_tokenizer(d):
        raise DataError(f"{flag}: {d}: expected a HF tokenizer directory (tokenizer.json or tokenizer_config.json), "
                        f"found none; pass the directory your tokenizer was saved to (save_pretrained), or "
                        f"{flag} {BYTES} for UTF-8 bytes as token ids")
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(d), local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError) as e:
        reason = " ".join(str(e).split())[:200]
        raise DataError(f"{flag}: {d}: cannot be loaded as a HF tokenizer ({reason})") from None
    return tok, TokenizerInfo(name=d.resolve().name, hash=tokenizer_hash(d), vocab_size=len(tok),
                              eos_id=tok.eos_token_id)


def check_fits(info: TokenizerInfo, model_vocab: int, what: str, model: str) -> None:
    """Ids at or above the model's vocabulary would index past its embedding."""
    if info.vocab_size > model_vocab:
        raise DataError(f"{what}: the tokenizer '{info.name}' has {info.vocab_size} tokens, more than the "
                        f"vocab_size {model_vocab} of --model {model}; use the model's own tokenizer (--tokenizer) "
                        f"or a model whose vocab_size is at least {info.vocab_size}")


LOAD_TIMEOUT_S = 600.0
"""The longest the child that loads a tokenizer may take (imports included, on a slow host)."""
_ENCODER = r"""
import dataclasses, json, sys
from torchpp.data.base import DataError
from torchpp.data.tokenizer import load_tokenizer
try:
    tok, info = load_tokenizer(sys.argv[1], sys.argv[2])
except DataError as e:
    print(json.dumps({"error": str(e)}))
    sys.exit(0)
backend = tok.backend_tokenizer.to_str() if getattr(tok, "is_fast", False) else None
print(json.dumps({"backend": backend, "info": dataclasses.asdict(info)}))
"""


def load_encoder(spec: str | Path, flag: str = "--tokenizer") -> tuple[Any, TokenizerInfo]:
    """What ``prepare`` encodes with: the HF tokenizer's own ``tokenizers.Tokenizer`` backend, as
    ``AutoTokenizer`` configures it (its ``__call__`` encodes through exactly this object, special
    tokens, truncation and padding off), in a :class:`DocSplitter` (long documents in proven pieces),
    else the HF tokenizer itself (slow ones; None for bytes). Where transformers is not
    imported yet, a child process loads it and hands the backend over as JSON: importing
    transformers imports torch, ~190 MiB that every tokenizing worker forked from this process
    would share for nothing."""
    if str(spec) == BYTES or "transformers" in sys.modules:
        tok, info = load_tokenizer(spec, flag)
        return (_splitter(tok.backend_tokenizer) if getattr(tok, "is_fast", False) else tok), info
    if not has_tokenizer(Path(spec)):
        return load_tokenizer(spec, flag)  # the one-line refusal, without a child
    try:
        r = subprocess.run([sys.executable, "-c", _ENCODER, str(spec), flag], capture_output=True, text=True,
                           timeout=LOAD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise DataError(f"{flag}: {spec}: loading the tokenizer took over {LOAD_TIMEOUT_S:.0f} s") from None
    try:
        got = json.loads(r.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        tail = (r.stderr.strip().splitlines() or ["no output"])[-1][:200]
        raise DataError(f"{flag}: {spec}: loading the tokenizer failed ({tail})") from None
    if "error" in got:
        raise DataError(got["error"])
    info = TokenizerInfo(**got["info"])
    if got["backend"] is None:
        return load_tokenizer(spec, flag)[0], info
    from tokenizers import Tokenizer

    return _splitter(Tokenizer.from_str(got["backend"])), info


def _splitter(backend: Any) -> Any:
    from .docsplit import DocSplitter

    backend.no_truncation()
    backend.no_padding()
    return DocSplitter(backend)
