"""Sample allocation inside a stage's group (Asteroid Algorithm 1) and its continuous form.

Each device of a group computes a share of every micro-batch. Shares start proportional to
speed (1 / seconds per sample), capped by what fits in each device's memory; then samples move
off the slowest device (the straggler) to the device that would finish them soonest, while
that lowers the group's time.
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np


def allocate(total: int, sec_per_sample: Sequence[float], cap: Sequence[float]) -> list[int] | None:
    """Integer samples per device (each >= 1, <= cap) minimising max(samples·time); None if impossible."""
    k = len(sec_per_sample)
    caps = [int(math.floor(c + 1e-9)) for c in cap]
    if total < k or any(c < 1 for c in caps) or sum(caps) < total:
        return None
    speed = [1.0 / max(t, 1e-30) for t in sec_per_sample]
    tot = sum(speed)
    exact = [total * s / tot for s in speed]
    n = [max(1, min(caps[i], int(math.floor(exact[i])))) for i in range(k)]
    # fill or trim to the total, always moving to/from the device that gains/loses least
    while sum(n) < total:
        i = min((j for j in range(k) if n[j] < caps[j]), key=lambda j: ((n[j] + 1) * sec_per_sample[j], j))
        n[i] += 1
    while sum(n) > total:
        i = max((j for j in range(k) if n[j] > 1), key=lambda j: (n[j] * sec_per_sample[j], -j))
        n[i] -= 1
    # move samples off the straggler while it helps
    while True:
        times = [n[j] * sec_per_sample[j] for j in range(k)]
        s = max(range(k), key=lambda j: times[j])
        if n[s] <= 1:
            break
        best = min((j for j in range(k) if j != s and n[j] < caps[j]),
                   key=lambda j: (n[j] + 1) * sec_per_sample[j], default=None)
        if best is None or (n[best] + 1) * sec_per_sample[best] >= times[s] - 1e-15:
            break
        n[s] -= 1
        n[best] += 1
    return n


def waterfill(total: float, tau: np.ndarray, cap: np.ndarray) -> np.ndarray:
    """Continuous group time: the t with Σ_d min(t / tau_d, cap_d) = total, elementwise.

    ``tau`` and ``cap`` have shape (k, ...) (one row per device); the result has shape (...),
    +inf where the group cannot hold ``total`` samples or a device cannot hold one.
    """
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        return _waterfill(total, tau, cap)


def _waterfill(total: float, tau: np.ndarray, cap: np.ndarray) -> np.ndarray:
    k = tau.shape[0]
    inv = 1.0 / tau
    free = np.ones_like(tau, dtype=bool)
    rem = np.full(tau.shape[1:], float(total))
    t = rem / inv.sum(axis=0)
    for _ in range(k):
        over = free & (t[None] * inv > cap)
        if not over.any():
            break
        rem = rem - np.where(over, cap, 0.0).sum(axis=0)
        free &= ~over
        s = np.where(free, inv, 0.0).sum(axis=0)
        t = np.where(s > 0, rem / s, np.where(rem <= 1e-9, (cap * tau).max(axis=0), np.inf))
    bad = (cap < 1.0).any(axis=0) | (cap.sum(axis=0) < total - 1e-9) | ~np.isfinite(tau).all(axis=0)
    return np.where(bad, np.inf, t)
