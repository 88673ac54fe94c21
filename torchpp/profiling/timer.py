"""One span-timer API over two backends: the C++ extension ``torchpp._timer`` and pure Python.

Both record ``(id, start_ns, end_ns)`` rows from a monotonic nanosecond clock into a
preallocated buffer, reserve each row atomically (the forward runs on the Python thread,
the backward on autograd's), report overflow as a count of dropped records, and read back
in bulk as an ``int64`` array of shape ``[n, 3]``. The C++ clock is ``steady_clock``, the
Python one ``time.perf_counter_ns`` (also ``CLOCK_MONOTONIC`` on Linux), so the two agree.

If the extension cannot be imported, the Python timer is used and ONE warning says so;
:func:`backend` names the one in use ("cpp" or "python") so every output file can record it.
"""
from __future__ import annotations

import os
import threading
import time
import warnings

import numpy as np
import torch  # noqa: F401  (loads libc10/libtorch that the extension links against)

BACKENDS = ("cpp", "python")
OPEN = -1
"""End time of a span whose ``end()`` has not run yet."""

try:
    from .. import _timer as _ext  # type: ignore[attr-defined]
    _IMPORT_ERROR: str | None = None
except ImportError as e:  # not compiled (TORCHPP_NO_EXT=1, no compiler) or built for another torch
    _ext = None
    _IMPORT_ERROR = f"{type(e).__name__}: {e}"

_warned = False
_warn_lock = threading.Lock()


class PySpanTimer:
    """Pure-Python twin of ``torchpp._timer.SpanTimer`` (same methods, same results)."""

    def __init__(self, capacity: int):
        if capacity <= 0:
            raise ValueError(f"SpanTimer: capacity must be > 0, got {capacity}")
        self._cap = int(capacity)
        self._rows = np.zeros((self._cap, 3), dtype=np.int64)
        self._n = 0
        self._lock = threading.Lock()  # the Python fallback trades speed for simplicity here

    def _reserve(self) -> int:
        with self._lock:
            slot = self._n
            self._n += 1
        return slot if slot < self._cap else -1

    def begin(self, id: int) -> int:
        t = time.perf_counter_ns()
        slot = self._reserve()
        if slot >= 0:
            self._rows[slot] = (id, t, OPEN)
        return slot

    def end(self, slot: int) -> int:
        t = time.perf_counter_ns()
        if slot < 0:
            return 0
        if slot >= self._cap:
            raise IndexError(f"SpanTimer.end: slot {slot} out of range")
        self._rows[slot, 2] = t
        return t

    def record(self, id: int, start_ns: int, end_ns: int) -> int:
        slot = self._reserve()
        if slot >= 0:
            self._rows[slot] = (id, start_ns, end_ns)
        return slot

    def mark(self, id: int) -> int:
        t = time.perf_counter_ns()
        slot = self._reserve()
        if slot >= 0:
            self._rows[slot] = (id, t, t)
        return t

    def count(self) -> int:
        return min(self._n, self._cap)

    def dropped(self) -> int:
        return max(0, self._n - self._cap)

    def capacity(self) -> int:
        return self._cap

    def reset(self) -> None:
        with self._lock:
            self._n = 0

    def read(self) -> np.ndarray:
        return self._rows[: self.count()].copy()


def backend(prefer: str | None = None) -> str:
    """The backend that :func:`SpanTimer` will use: "cpp" if the extension loads, else "python".

    ``prefer="python"`` (or env ``TORCHPP_TIMER=python``) forces the Python timer.
    """
    want = prefer or os.environ.get("TORCHPP_TIMER") or "cpp"
    if want not in BACKENDS:
        raise ValueError(f"timer backend: expected one of {BACKENDS}, got {want!r}")
    if want == "python":
        return "python"
    if _ext is None:
        _warn_fallback()
        return "python"
    return "cpp"


def _warn_fallback() -> None:
    global _warned
    with _warn_lock:
        if _warned:
            return
        _warned = True
    warnings.warn(f"torchpp: the C++ span timer (torchpp._timer) is not available ({_IMPORT_ERROR}); using the "
                  "pure-Python timer. Times stay correct but each span costs more; output files record "
                  "timer=\"python\". Rebuild with: pip install --no-build-isolation -e .",
                  RuntimeWarning, stacklevel=3)


def SpanTimer(capacity: int = 1 << 16, prefer: str | None = None):
    """A span timer of the best available backend; ``.backend`` says which."""
    b = backend(prefer)
    t = _ext.SpanTimer(capacity) if b == "cpp" else PySpanTimer(capacity)
    try:
        t.backend = b
    except AttributeError:  # pybind class without dynamic attributes
        return _Named(t, b)
    return t


class _Named:
    """Adds ``.backend`` to an extension timer without a per-call Python layer on the hot path."""

    __slots__ = ("backend", "begin", "end", "record", "mark", "count", "dropped", "capacity", "reset", "read")

    def __init__(self, t, b: str):
        self.backend = b
        for name in self.__slots__[1:]:
            setattr(self, name, getattr(t, name))


def now_ns(prefer: str | None = None) -> int:
    """Monotonic nanoseconds on the clock the timer of ``backend(prefer)`` uses."""
    return _ext.now_ns() if backend(prefer) == "cpp" else time.perf_counter_ns()
