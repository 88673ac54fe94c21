"""Measuring a host: the span timer, per-block hooks and ``torchpp profile``."""
from __future__ import annotations

from typing import Any

__all__ = ["SpanTimer", "backend", "now_ns"]


def __getattr__(name: str) -> Any:
    """The timer's names, imported on first use: the timer loads torch (its extension links against
    libtorch), and `torchpp profile --help` or another module of this package may need neither."""
    if name in __all__:
        from . import timer

        return getattr(timer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
