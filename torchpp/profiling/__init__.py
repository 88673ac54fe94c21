"""Measuring a host: the span timer, per-block hooks and ``torchpp profile``."""
from .timer import SpanTimer, backend, now_ns

__all__ = ["SpanTimer", "backend", "now_ns"]
