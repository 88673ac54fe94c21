"""Raw ``--data`` at train time: prepared once per host into a cache keyed by the corpus's and
the tokenizer's hashes, by one process (an exclusive file lock; the others wait, bounded, and
then read the same corpus or the same error). The preparing runs in a child process, so the
rank's own memory never holds the tokenizer's or ``datasets``' working set."""
from __future__ import annotations

import logging
import fcntl
import os
import subprocess
import sys
import time
from pathlib import Path

from .base import DataError
from .prepare import INDEX, corpus_key
from .sources import Inputs


def default_cache() -> Path:
    """``$TORCHPP_CACHE/corpus`` or ``~/.cache/torchpp/corpus``."""
    xdg = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    root = os.environ.get("TORCHPP_CACHE") or xdg / "torchpp"
    return Path(root) / "corpus"


def cached_corpus(inputs: Inputs, *, info, tokenizer: str, text_column: str, split: str | None, cache: Path,
                  timeout_s: float, num_proc: int | None = None, flag: str = "--data") -> Path:
    """The cache directory holding ``inputs`` prepared with ``tokenizer`` (prepared now if missing)."""
    key = corpus_key(inputs, info, text_column, split)
    out = cache / key
    if (out / INDEX).is_file():
        return out
    cache.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    with open(cache / f"{key}.lock", "w") as lock:
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.time() - t0 > timeout_s:
                    raise DataError(f"{flag}: waited {timeout_s:.0f} s for another process preparing {out}; prepare "
                                    f"it first with `torchpp data prepare` or raise --data-timeout-s") from None
                time.sleep(0.2)
        try:
            if (out / INDEX).is_file():
                return out
            err = cache / f"{key}.error"
            if err.is_file() and err.stat().st_mtime >= t0:  # it failed while this process waited
                raise DataError(err.read_text().strip())
            _run_prepare(inputs, out, err, tokenizer, text_column, split, num_proc, flag)
            return out
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _run_prepare(inputs: Inputs, out: Path, err: Path, tokenizer: str, text_column: str, split: str | None,
                 num_proc: int | None, flag: str) -> None:
    cmd = [sys.executable, "-m", "torchpp.cli", "data", "prepare", "--data", *[str(s.path) for s in inputs.sources],
           "--tokenizer", tokenizer, "--out", str(out), "--text-column", text_column]
    cmd += ["--split", split] if split else []
    cmd += ["--num-proc", str(num_proc)] if num_proc else []
    logging.getLogger("torchpp.train").info(f"torchpp.train: preparing {flag} into {out} (once; later runs reuse it)")
    res = subprocess.run(cmd, stdout=sys.stdout, stderr=subprocess.PIPE, text=True)
    if res.returncode != 0:
        lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
        msg = lines[-1] if lines else f"torchpp data prepare exited with {res.returncode}"
        msg = msg.split(": error: ", 1)[-1] if ": error: " in msg else msg
        err.write_text(msg + "\n")
        raise DataError(msg)
    err.unlink(missing_ok=True)
