"""argparse value types shared by the verbs' parsers (a leaf: the verbs' modules import it, not each other).

Each type calls ``torchpp.validate`` so a flag and the same field in a file accept the same
values; argparse turns the ``ArgumentTypeError`` into one line naming the flag.
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Callable

from . import validate as V


def _typed(check: Callable[[str], object], name: str) -> Callable[[str], object]:
    def parse(text: str) -> object:
        try:
            return check(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e).partition(": ")[2] or str(e)) from None
    parse.__name__ = name  # argparse names the type in "invalid <name> value" only without a message
    return parse


def int_in(lo: int | None = None, hi: int | None = None) -> Callable[[str], object]:
    """An integer in ``[lo, hi]`` (``--global-batch 0`` or ``1e12`` refused with the range)."""
    return _typed(lambda t: V.integer(t, "value", lo, hi), "integer")


def float_in(lo: float | None = None, hi: float | None = V.MAX_SECONDS, lo_open: bool = False
             ) -> Callable[[str], object]:
    """A finite number in ``[lo, hi]`` (``(lo, hi]`` with ``lo_open``): ``inf`` and ``nan`` refused."""
    return _typed(lambda t: V.number(t, "value", lo, hi, lo_open), "number")


positive_int = int_in(1)
positive_float = float_in(0.0, lo_open=True)
host = _typed(lambda t: V.host_name(t, "value"), "host")
out_file = _typed(lambda t: V.output_file(t, "value"), "path")
out_dir = _typed(lambda t: V.output_dir(t, "value"), "path")


_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def size(text: str) -> int:
    """``"2G"``, ``"512M"``, ``"1.5g"`` or a byte count: bytes (binary units, as cgroups count)."""
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    unit = t[-1:] if t[-1:] in _UNITS and t[-1:] else ""
    try:
        value = float(t[: len(t) - len(unit)])
    except ValueError:
        value = -1.0
    if not (value > 0 and value * _UNITS[unit] < 2**60):
        raise argparse.ArgumentTypeError(f"expected a size such as 2G, 512M or a byte count, got {text!r}")
    return int(value * _UNITS[unit])


def hosts(text: str) -> list[str]:
    """``"a,b,c"``: distinct safe host names."""
    try:
        names = [V.host_name(x.strip(), "value") for x in text.split(",") if x.strip()]
        V.distinct(names, "value")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).partition(": ")[2]) from None
    if not names:
        raise argparse.ArgumentTypeError(f"expected comma-separated host names, got {text!r}")
    return names


def int_list(lo: int = 1, hi: int = 2**31 - 1) -> Callable[[str], list[int]]:
    """Comma-separated integers, each in ``[lo, hi]``."""
    return lambda text: ints(text, lo, hi)


def ints(text: str, lo: int = 1, hi: int = 2**31 - 1) -> list[int]:
    """``"1,2,4"`` -> ``[1, 2, 4]`` (empty items skipped), each in ``[lo, hi]``."""
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not out:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    bad = [x for x in out if not lo <= x <= hi]
    if bad:
        raise argparse.ArgumentTypeError(f"expected integers in [{lo}, {hi}], got {bad[0]}")
    return out


def boolean(text: str) -> bool:
    if text.lower() in ("true", "1", "yes"):
        return True
    if text.lower() in ("false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def existing_path(text: str) -> Path:
    """An input path (file or folder) that exists; the loader checks what it holds."""
    p = Path(text)
    if not p.exists():
        raise argparse.ArgumentTypeError(f"no such file or directory: {text!r}")
    return p
