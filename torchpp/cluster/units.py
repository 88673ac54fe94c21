"""Parsing of the quantities emulated clusters are described in: rates, sizes, durations.

Rates follow tc's decimal bit units (``50mbit`` = 50e6 bit/s). tc's own ``mbps`` means
mega*bytes* per second, a classic source of 8x mistakes, so byte-rate spellings are refused
with a hint rather than guessed.
"""
from __future__ import annotations

import re

_RATE = {"bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
_SIZE = {"": 1, "b": 1, "k": 2**10, "kb": 2**10, "kib": 2**10, "m": 2**20, "mb": 2**20, "mib": 2**20,
         "g": 2**30, "gb": 2**30, "gib": 2**30}
_TIME = {"s": 1.0, "ms": 1e-3, "us": 1e-6}
_NUM = r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([a-zA-Z]*)\s*"


def parse_rate(text: str | int | float) -> float:
    """``"50mbit"`` -> 5e7 bits per second. A bare number is bits per second."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        if text <= 0:
            raise ValueError(f"expected a positive rate, got {text!r}")
        return float(text)
    m = re.fullmatch(_NUM, str(text))
    unit = m.group(2).lower() if m else ""
    if m and unit in ("mbps", "kbps", "gbps", "bps"):
        raise ValueError(f"expected a rate like '50mbit' (bits/s), got {text!r}: '{unit}' is ambiguous "
                         f"(tc reads it as bytes/s); write {unit[0] if unit != 'bps' else ''}bit")
    if not m or (unit or "bit") not in _RATE or float(m.group(1)) <= 0:
        raise ValueError(f"expected a positive rate like '10mbit', '500kbit' or '1gbit', got {text!r}")
    return float(m.group(1)) * _RATE[unit or "bit"]


def parse_size(text: str | int) -> int:
    """``"2G"`` -> 2 GiB in bytes (binary units, as cgroups and free(1) count)."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text <= 0:
            raise ValueError(f"expected a positive size, got {text!r}")
        return text
    m = re.fullmatch(_NUM, str(text))
    if not m or m.group(2).lower() not in _SIZE or float(m.group(1)) <= 0:
        raise ValueError(f"expected a size like '512M', '1.5G' or a byte count, got {text!r}")
    return int(float(m.group(1)) * _SIZE[m.group(2).lower()])


def parse_duration(text: str | int | float) -> float:
    """``"2ms"`` -> 0.002 seconds. A bare number is seconds."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        if text < 0:
            raise ValueError(f"expected a non-negative duration, got {text!r}")
        return float(text)
    m = re.fullmatch(_NUM, str(text))
    if not m or (m.group(2).lower() or "s") not in _TIME:
        raise ValueError(f"expected a duration like '2ms', '500us' or '0.1s', got {text!r}")
    return float(m.group(1)) * _TIME[m.group(2).lower() or "s"]


def parse_fraction(text: str | int | float) -> float:
    """``"1%"`` or ``0.01`` -> 0.01 (packet loss probability)."""
    s = str(text).strip()
    try:
        v = float(s[:-1]) / 100 if s.endswith("%") else float(s)
    except ValueError:
        raise ValueError(f"expected a loss like '1%' or 0.01, got {text!r}") from None
    if not 0 <= v < 1:
        raise ValueError(f"expected a loss between 0 and 1 (or 0%..100%), got {text!r}")
    return v


def format_rate(bits_per_s: float) -> str:
    """tc spelling of a rate (integer kbit avoids float formatting in tc arguments)."""
    return f"{max(1, round(bits_per_s / 1e3))}kbit"
