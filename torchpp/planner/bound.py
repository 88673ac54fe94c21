"""A proven lower bound on any plan's step time: the LP relaxation of the work assignment.

Every sample must pass forward and backward through every block on some device, and a device
can only run blocks whose weights it holds. Variables ``x[d,k]`` (share of block k's samples
run on device d) and ``y[d,k]`` (device d holds block k's weights), both relaxed to [0, 1]:

    minimise T  subject to   Σ_d x[d,k] = 1,   x[d,k] ≤ y[d,k],
                             G · Σ_k x[d,k] · τ[d,k] + Σ_k y[d,k] · o_d · P_k ≤ T   (device d's busy time)
                             Σ_k y[d,k] · alpha · W_k ≤ budget_d − base (weights with gradients, optimizer state)

``τ[d,k]`` is block k's forward + backward seconds per sample on device d, ``o_d · P_k`` the
optimizer step over block k's parameter bytes on device d (every device holding a block's
weights updates them, and some device must: Σ_d y[d,k] ≥ 1). A tied weight is counted in the
embedding's block only: a device holding both ends holds and updates it once. Activations, transfers,
all-reduces, per-call costs, recomputation and the pipeline's fill are left out, each of which
can only add time, so every plan's replayed step is at least T. Without the memory rows, the
optimizer and with uniform speeds this is the total work over the total capacity.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np
from scipy.optimize import linprog
from scipy.sparse import coo_matrix

from ..cost import MemoryEstimator, Profiles
from ..cost.actions import optimizer_rate


def lower_bound(profiles: Profiles, hosts: Sequence[str], budget: Mapping[str, float], memory: MemoryEstimator,
                global_batch: int, optimizer_s_per_byte: Mapping[str, float] | float | None = None) -> float:
    """Seconds per step no plan of ``global_batch`` samples on ``hosts`` can beat (LP above)."""
    profiles.ensure(hosts)
    D, K = len(hosts), profiles.num_blocks
    tau = np.stack([profiles.table(h)[0] + profiles.table(h)[1] for h in hosts])  # (D, K) s per sample
    rate = np.array([optimizer_rate(optimizer_s_per_byte, h) for h in hosts])
    held = np.asarray(profiles.param_bytes, dtype=float).copy()
    held[-1] = max(0.0, held[-1] - profiles.tied_bytes)  # a device holding both ends holds the tied weight once
    opt = rate[:, None] * held[None, :]                                            # (D, K) s per update
    w = memory.alpha * held                                                        # (K,) bytes held per block
    nx = D * K                                                                     # x, then y, then T
    n = 2 * nx + 1
    rows, cols, vals, lo, hi = [], [], [], [], []

    def row(cs: Sequence[int], vs: Sequence[float], lb: float, ub: float) -> None:
        r = len(lo)
        rows.extend([r] * len(cs)), cols.extend(cs), vals.extend(vs)
        lo.append(lb), hi.append(ub)

    for k in range(K):
        row([d * K + k for d in range(D)], [1.0] * D, 1.0, 1.0)
    for d in range(D):
        for k in range(K):
            row([d * K + k, nx + d * K + k], [1.0, -1.0], -np.inf, 0.0)
        scale = max(float(tau[d].sum()) * global_batch + float(opt[d].sum()), 1e-30)
        row([d * K + k for k in range(K)] + [nx + d * K + k for k in range(K)] + [2 * nx],
            list(global_batch * tau[d] / scale) + list(opt[d] / scale) + [-1.0 / scale], -np.inf, 0.0)
        room = max(0.0, budget[hosts[d]] - memory.base)
        if not np.isfinite(room):
            continue  # no memory limit given for this device
        big = max(float(w.sum()), 1.0)
        row([nx + d * K + k for k in range(K)], list(w / big), -np.inf, room / big)
    A = coo_matrix((vals, (rows, cols)), shape=(len(lo), n)).tocsr()
    c = np.zeros(n)
    c[-1] = 1.0
    lo_a, hi_a = np.array(lo), np.array(hi)
    eq = lo_a == hi_a
    res = linprog(c, A_ub=A[~eq], b_ub=hi_a[~eq], A_eq=A[eq], b_eq=hi_a[eq],
                  bounds=[(0.0, 1.0)] * (2 * nx) + [(0.0, None)], method="highs")
    if res.status == 2:
        return float("inf")  # not even fractionally do the weights fit: no plan exists
    if not res.success:
        raise RuntimeError(f"lower bound LP: {res.message}")
    return float(res.x[-1])
