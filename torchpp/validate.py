"""One place that says which command-line values and file contents torchpp accepts.

Every check raises ``ValueError`` with one line that names the value, the accepted range and
what was given; argparse types (``argtypes``) and the file loaders (``formats``) both call these,
so a value refused on the command line is refused in a file too. The limits below are the sizes
the planner, the simulator and the runtime finish in seconds on one CPU: beyond them a command
would run for hours or exhaust memory, so it stops at once instead. A leaf: imports nothing of
torchpp.
"""
from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Any, Iterable

MAX_GLOBAL_BATCH = 4096
"""Samples per step: the planner prices every micro-batch size and count up to this (4096 takes
seconds; 65536 took 80 s on two devices)."""
MAX_PLAN_GLOBAL_BATCH = 1 << 20
"""Samples per step a plan file may hold: a simulated plan over thousands of replicas (8,192
devices at dp 128 take 16,384) is legitimate; the planner's own search stops at
``MAX_GLOBAL_BATCH`` and a real run is bounded by its micro-batch size and count."""
MAX_MICROBATCHES = 4096
"""Micro-batches per step (one schedule holds several actions per micro-batch and stage)."""
MAX_STAGES = 1024
"""Stages and devices of one plan."""
MAX_LAYERS = 100_000
"""Decoder layers of a model (far above any released model)."""
MAX_SEQ_LEN = 1 << 20
"""Tokens per sample before the model's own position limit is known."""
MAX_SIM_ACTIONS = 200_000
"""Actions (stages × micro-batches × actions each) one simulation may price (about 10 s;
2 million took 75 s)."""
MAX_SECONDS = 1e9
"""Any duration or length: about 30 years, far beyond a step; keeps products finite."""
MAX_WORKERS = 1024
MAX_THREADS = 1024
MAX_CPUS = 1 << 16
"""CPUs of one machine (a trace's ``cpus``, the cores it lost to steal)."""
HOST_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")
SHARE_TOLERANCE = 1e-3
"""How far a group's shares may sum from 1 (they are written with a few digits)."""


def _shown(value: Any) -> str:
    s = repr(value)
    return s if len(s) <= 60 else s[:57] + "..."


def integer(value: Any, what: str, lo: int | None = None, hi: int | None = None) -> int:
    """``value`` (an int or its decimal text) within ``[lo, hi]``."""
    if isinstance(value, str):
        try:
            value = int(value.strip())
        except ValueError:
            raise ValueError(f"{what}: expected an integer{_range(lo, hi)}, got {_shown(value)}") from None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{what}: expected an integer{_range(lo, hi)}, got {_shown(value)}")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise ValueError(f"{what}: expected an integer{_range(lo, hi)}, got {value}")
    return value


def number(value: Any, what: str, lo: float | None = None, hi: float | None = MAX_SECONDS,
           lo_open: bool = False) -> float:
    """A finite number within ``[lo, hi]`` (``(lo, hi]`` with ``lo_open``); NaN and inf refused."""
    rng = _range(lo, hi, lo_open)
    if isinstance(value, str):
        try:
            value = float(value.strip())
        except ValueError:
            raise ValueError(f"{what}: expected a finite number{rng}, got {_shown(value)}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{what}: expected a finite number{rng}, got {_shown(value)}")
    try:
        v = float(value)
    except OverflowError:
        raise ValueError(f"{what}: expected a finite number{rng}, got {_shown(value)}") from None
    bad_lo = lo is not None and (v <= lo if lo_open else v < lo)
    if not math.isfinite(v) or bad_lo or (hi is not None and v > hi):
        raise ValueError(f"{what}: expected a finite number{rng}, got {value!r}")
    return v


def _range(lo: float | None, hi: float | None, lo_open: bool = False) -> str:
    if lo is not None and hi is not None:
        return f" in {'(' if lo_open else '['}{lo:g}, {hi:g}]"
    if lo is not None:
        return f" {'>' if lo_open else '>='} {lo:g}"
    if hi is not None:
        return f" <= {hi:g}"
    return ""


def host_name(value: Any, what: str = "host") -> str:
    """A host name safe in file names and link keys: letters, digits, ``.``, ``_``, ``-``; no ``..``."""
    if not isinstance(value, str) or not HOST_RE.fullmatch(value) or ".." in value:
        raise ValueError(f"{what}: expected a host name of letters, digits, '.', '_' or '-' (at most 63, "
                         f"starting with a letter or digit, no '..'), got {_shown(value)}")
    return value


def distinct(items: Iterable[Any], what: str) -> None:
    seen: set[Any] = set()
    for x in items:
        if x in seen:
            raise ValueError(f"{what}: expected distinct names, got {_shown(x)} twice")
        seen.add(x)


def link_key(key: Any, what: str = "link") -> tuple[str, str]:
    """``"src|dst"`` between two different, safe host names."""
    if not isinstance(key, str) or key.count("|") != 1:
        raise ValueError(f"{what}: expected a key 'src|dst', got {_shown(key)}")
    src, dst = key.split("|")
    host_name(src, f"{what} {key!r} source")
    host_name(dst, f"{what} {key!r} destination")
    if src == dst:
        raise ValueError(f"{what}: expected two different hosts, got the self-link {key!r}")
    return src, dst


def shares(values: list[float], what: str) -> None:
    """A group's shares: each in (0, 1] and together 1 (each device's fraction of a micro-batch)."""
    for v in values:
        number(v, what, 0.0, 1.0, lo_open=True)
    total = sum(values)
    if abs(total - 1.0) > SHARE_TOLERANCE:
        raise ValueError(f"{what}: expected shares that add up to 1, got {' + '.join(f'{v:g}' for v in values)} "
                         f"= {total:g}")


def input_file(path: str | os.PathLike, what: str, max_bytes: int) -> Path:
    """A regular file of at most ``max_bytes``, checked before it is opened: a device
    (``/dev/zero`` reads forever), a FIFO (waits for a writer) or a huge file is refused in one line."""
    import stat

    p = Path(path)
    try:
        st = p.stat()
    except OSError as e:
        raise ValueError(f"{what} {str(p)!r}: {e.strerror or e}") from None
    if not stat.S_ISREG(st.st_mode):
        kind = "a directory" if stat.S_ISDIR(st.st_mode) else "a FIFO" if stat.S_ISFIFO(st.st_mode) else \
            "a device or socket"
        raise ValueError(f"{what} {str(p)!r}: expected a regular file, got {kind}")
    if st.st_size > max_bytes:
        raise ValueError(f"{what} {str(p)!r}: {st.st_size:,} bytes, expected at most {max_bytes:,}")
    return p


def output_file(path: str | os.PathLike, what: str = "output") -> Path:
    """A file torchpp may create or replace: not a directory, no file among its parents, not a
    symbolic link (writing through one would change a file elsewhere)."""
    p = Path(path)
    if p.is_symlink():
        raise ValueError(f"{what}: {str(p)!r} is a symbolic link (to {os.readlink(p)!r}); torchpp never writes "
                         "through one: remove it or choose another path")
    if p.is_dir():
        raise ValueError(f"{what}: expected a file name, got the directory {str(p)!r}")
    _no_file_above(p, what)
    return p


def open_output(path: str | os.PathLike, mode: str = "w", what: str = "output", **kwargs):
    """``open(path, mode)`` for writing or appending, refusing a symbolic link at ``path`` (checked
    by :func:`output_file`, and by ``O_NOFOLLOW`` when the file is opened, so a link planted in
    between is refused too)."""
    p = output_file(path, what)
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | (os.O_APPEND if "a" in mode else os.O_TRUNC)
    try:
        fd = os.open(p, flags, 0o666)
    except OSError as e:
        if os.path.islink(p):
            raise ValueError(f"{what}: {str(p)!r} is a symbolic link; torchpp never writes through one") from None
        raise
    return os.fdopen(fd, mode, **kwargs)


def output_dir(path: str | os.PathLike, what: str = "output directory") -> Path:
    """A directory torchpp may create or fill: not a file, no file among its parents."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise ValueError(f"{what}: expected a directory, got the file {str(p)!r}")
    _no_file_above(p, what)
    return p


def _no_file_above(p: Path, what: str) -> None:
    for parent in p.absolute().parents:
        if parent.exists():
            if not parent.is_dir():
                raise ValueError(f"{what}: {str(p)!r} lies under the file {str(parent)!r}")
            if not os.access(parent, os.W_OK | os.X_OK) and not (parent / p.name).exists():
                raise ValueError(f"{what}: cannot write into {str(parent)!r} (permission denied)")
            return


def sim_actions(stages: int, microbatches: int, what: str = "simulation") -> None:
    """Refuse a simulation whose action lists would not fit in memory or finish in seconds."""
    n = stages * microbatches * 6
    if n > MAX_SIM_ACTIONS:
        raise ValueError(f"{what}: {stages} stage(s) × {microbatches} micro-batch(es) is about {n:,} actions; "
                         f"expected at most {MAX_SIM_ACTIONS:,} (fewer micro-batches or stages)")


MAX_BYTES = 1 << 50
"""Bytes of one block's parameters or activations, or a memory-model term (1 PiB)."""
MAX_MEMORY_GB = float(1 << 20)
"""A device's memory in GiB (1 PiB)."""
MAX_RATE = 1e15
"""A link's bytes per second (8 Pbit/s)."""
MAX_NUMBER = 1e18
"""Any number in a file without a tighter bound (FLOP/s, bytes, factors): sums and products of a
few such numbers stay finite, so no NaN or inf reaches a printed result."""
