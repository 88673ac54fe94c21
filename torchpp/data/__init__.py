"""Token sources: ``synthetic`` tokens, or a corpus tokenized once (``torchpp data prepare``)
and read through ``numpy.memmap``; raw text and ``datasets`` forms are prepared into a cache.

Every rank that needs tokens (the first stage for inputs, the last stage for labels) computes
the same global batch for a given step: the order is a pure function of (seed, step), so a run
resumed from a checkpoint at step k sees exactly the batches an uninterrupted run would have
seen. Nothing is downloaded.
"""
from __future__ import annotations

from pathlib import Path

from .base import DataError, SyntheticTokens, TokenSource, seed_of
from .corpus import HeldOut, TokenCorpus, hold_out, is_corpus, load_index
from .sources import SUFFIXES, TABLES, TEXTS, discover
from .tokenizer import BYTES, check_fits, has_tokenizer, load_tokenizer

__all__ = ["DataError", "SyntheticTokens", "TokenSource", "TokenCorpus", "HeldOut", "BYTES", "SUFFIXES", "TABLES",
           "TEXTS", "open_source", "held_out", "resolve_data", "resolve_tokenizer", "describe", "data_id",
           "discover", "is_corpus", "load_index", "prepare_corpus", "seed_of"]


def prepare_corpus(*args, **kw):
    """``torchpp.data.prepare.prepare_corpus`` (imported on use: it needs ``datasets``)."""
    from .prepare import prepare_corpus as run

    return run(*args, **kw)


def resolve_tokenizer(tokenizer: str | None, model: str) -> str | None:
    """``--tokenizer`` as given, else the model directory when it holds a tokenizer, else None."""
    if tokenizer is not None:
        return tokenizer
    return model if has_tokenizer(model) else None


def resolve_data(data: str | None, *, flag: str, tokenizer: str | None, model: str, model_vocab: int,
                 text_column: str = "text", split: str | None = None, cache: Path | None = None,
                 timeout_s: float = 3600.0, num_proc: int | None = None) -> str | None:
    """``synthetic``, or the prepared corpus directory ``data`` names (raw data is prepared into
    ``cache`` once); refuses text without a tokenizer, a tokenizer larger than the model's
    vocabulary and a corpus made by another tokenizer. Local only: every rank calls it before
    any collective, so every rank gives the same error."""
    if data is None or data == "synthetic":
        return data
    p = Path(data)
    if not p.exists():
        raise DataError(f"{flag}: {data}: no such file or directory; expected 'synthetic', a corpus from `torchpp data "
                        f"prepare`, text files, tables or a datasets save_to_disk folder")
    if is_corpus(p):
        index = load_index(p, flag)
        check_fits(index.tokenizer, model_vocab, f"{flag} {data}", model)
        if tokenizer is not None:
            _, info = load_tokenizer(tokenizer)
            if info.hash != index.tokenizer.hash:
                raise DataError(f"{flag}: {data}: tokenized with '{index.tokenizer.name}' ({index.tokenizer.hash}), "
                                f"but the tokenizer of this run is '{info.name}' ({info.hash}); prepare the corpus "
                                f"again with --tokenizer {tokenizer}, or pass the tokenizer it was made with")
        return str(p)
    if tokenizer is None:
        raise DataError(f"{flag}: {data} is text and --model {model} has no tokenizer; pass --tokenizer DIR (a HF "
                        f"tokenizer directory, saved with save_pretrained) or --tokenizer {BYTES} (UTF-8 bytes as ids)")
    _, info = load_tokenizer(tokenizer)
    check_fits(info, model_vocab, "--tokenizer", model)
    from .cache import cached_corpus, default_cache

    inputs = discover([p], text_column=text_column, split=split, flag=flag)
    return str(cached_corpus(inputs, info=info, tokenizer=tokenizer, text_column=text_column, split=split,
                             cache=cache or default_cache(), timeout_s=timeout_s, num_proc=num_proc, flag=flag))


def open_source(data: str, *, seq_len: int, global_batch: int, vocab_size: int, seed: int) -> TokenSource:
    """``synthetic`` tokens, or the prepared corpus ``data`` (see :func:`resolve_data`)."""
    if data == "synthetic":
        return SyntheticTokens(vocab_size=vocab_size, seq_len=seq_len, global_batch=global_batch, seed=seed)
    return TokenCorpus(data, seq_len=seq_len, global_batch=global_batch, seed=seed)


def held_out(source: TokenSource, fraction: float) -> tuple[TokenSource, TokenSource]:
    """(training, evaluation): held-out whole documents of a corpus; synthetic tokens get an
    independent evaluation stream."""
    if not 0 < fraction < 1:
        raise DataError(f"--eval-fraction: expected a fraction in (0, 1), got {fraction}")
    if isinstance(source, SyntheticTokens):
        return source, SyntheticTokens(vocab_size=source.vocab_size, seq_len=source.seq_len,
                                       global_batch=source.global_batch, seed=seed_of("eval", source.seed) & 0xFFFFFFFF)
    if not isinstance(source, TokenCorpus):
        raise DataError(f"--eval-fraction: cannot split a {type(source).__name__}; pass --eval-data")
    return hold_out(source, fraction)


def describe(data: str, *, seq_len: int, global_batch: int, steps: int) -> str:
    """One line: documents, tokens, blocks and the epochs ``steps`` cover."""
    if data == "synthetic":
        return "data: synthetic tokens"
    index = load_index(data)
    blocks = index.tokens // seq_len
    epochs = steps * global_batch / blocks if blocks else float("inf")
    return (f"data: {data}: {index.documents:,} documents, {index.tokens:,} tokens ({index.tokenizer.name}), "
            f"{blocks:,} blocks of {seq_len}; {steps} steps x {global_batch} = {epochs:.3g} epoch(s)")


def data_id(data: str) -> str:
    """What every rank must agree on: ``synthetic`` or the corpus key and size."""
    if data == "synthetic":
        return data
    index = load_index(data)
    return f"{Path(data).name} {index.tokens} tokens key {index.key} tokenizer {index.tokenizer.hash}"
