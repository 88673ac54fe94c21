"""Which layers of a stage to recompute: a mixed-integer programme under each device's memory cap.

Given the group's sample counts s_d, choose r_l ∈ {0, 1} per decoder layer to minimise the
stage's time z subject to, for every device d,

    z ≥ s_d · (τ_d + Σ_l r_l · f_{d,l})                       (recompute adds the layer's forward)
    base + alpha·W + s_d · (n·(Kp·Σ_l (1 − r_l)·A_l + Σ_l r_l·A_l + Kp·A_fixed) + Kp·A_max·y) ≤ budget_d
    y ≥ r_l                                                    (one layer's activations while recomputing)

as seed 004 trades recomputation time for memory (there with a linear programme over stages,
here per stage once the split is fixed). Samples and flags are alternated: Algorithm 1 shares
for the current flags, then the MILP for those shares, until they agree.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp

from .allocate import allocate

if TYPE_CHECKING:
    from .search import Problem, Tables


def _stage_terms(pb: "Problem", t: "Tables", hosts: Sequence[int], cut: tuple[int, int]):
    c, c2 = cut
    L = t.L
    p = pb.profiles
    A_l = p.act_bytes[c + 1:c2 + 1]                        # decoder layers of the stage
    A_fixed = float(t.A[c, c2] - t.Alay[c, c2])             # embed / tail outputs (never recomputed)
    W = float(t.W[c, c2])
    tau = [float(t.tau[(h, 0)][c, c2]) for h in hosts]
    f = [p.table(pb.hosts[h])[0][c + 1:c2 + 1] for h in hosts]
    return A_l, A_fixed, W, tau, f, L


def memory_per_sample(pb: "Problem", A_l: np.ndarray, A_fixed: float, flags: Sequence[bool], n: int) -> float:
    r = np.asarray(flags, dtype=bool)
    kept = float(A_l[~r].sum()) + A_fixed
    rec = float(A_l[r].sum())
    amax = float(A_l[r].max()) if r.any() else 0.0
    return pb.memory.per_sample(kept, rec, n, amax)


def choose_recompute(pb: "Problem", t: "Tables", hosts: Sequence[int], cut: tuple[int, int], b: int, n: int
                     ) -> tuple[list[bool], list[int]] | None:
    """(recompute flag per layer, samples per device) minimising the stage time; None if nothing fits."""
    A_l, A_fixed, W, tau, f, _ = _stage_terms(pb, t, hosts, cut)
    budget = [pb.budget[pb.hosts[h]] - pb.memory.static(W) for h in hosts]
    nl = len(A_l)

    def alloc(flags):
        ps = max(memory_per_sample(pb, A_l, A_fixed, flags, n), 1e-30)  # Kp may be 0 in a fitted model
        caps = [max(0.0, bu) / ps for bu in budget]
        secs = [tau[j] + float(np.dot(f[j], np.asarray(flags, dtype=float))) for j in range(len(hosts))]
        return allocate(b, secs, caps)

    flags = [False] * nl
    samples = alloc(flags)
    if samples is not None:
        return flags, samples
    if not pb.allow_recompute or nl == 0:
        return None
    flags = [True] * nl
    samples = alloc(flags)
    if samples is None:
        return None
    for _ in range(4):
        new = _milp(pb, A_l, A_fixed, tau, f, budget, samples, n)
        if new is None or new == flags:
            break
        s2 = alloc(new)
        if s2 is None:
            break
        flags, samples = new, s2
    return flags, samples


def _milp(pb, A_l, A_fixed, tau, f, budget, samples, n) -> list[bool] | None:
    """Variables [r_0..r_{nl-1}, y, z]; minimise z."""
    nl, k = len(A_l), len(tau)
    kp = pb.memory.kp
    amax = float(A_l.max()) if nl else 0.0
    nv = nl + 2
    rows, lo, hi = [], [], []
    scale_t = max(max(s * t for s, t in zip(samples, tau)), 1e-12)
    for d in range(k):
        s = samples[d]
        # time: s·(τ + Σ r f) − z ≤ 0   (scaled)
        row = np.zeros(nv)
        row[:nl] = s * f[d] / scale_t
        row[nl + 1] = -1.0
        rows.append(row); lo.append(-np.inf); hi.append(-s * tau[d] / scale_t)
        # memory: s·n·(kp·Σ(1−r)A + Σ r A + kp·A_fixed) + s·kp·amax·y ≤ budget
        scale_m = max(abs(budget[d]), 1.0)
        row = np.zeros(nv)
        row[:nl] = s * n * (1.0 - kp) * A_l / scale_m
        row[nl] = s * kp * amax / scale_m
        const = s * n * kp * (float(A_l.sum()) + A_fixed)
        rows.append(row); lo.append(-np.inf); hi.append((budget[d] - const) / scale_m)
    for l in range(nl):  # y ≥ r_l
        row = np.zeros(nv)
        row[l], row[nl] = 1.0, -1.0
        rows.append(row); lo.append(-np.inf); hi.append(0.0)
    c = np.zeros(nv)
    c[nl + 1] = 1.0
    integrality = np.ones(nv)
    integrality[nl + 1] = 0
    res = milp(c, constraints=LinearConstraint(np.array(rows), lo, hi), integrality=integrality,
               bounds=Bounds(np.r_[np.zeros(nl + 1), -np.inf], np.r_[np.ones(nl + 1), np.inf]))
    if not res.success or res.x is None:
        return None
    return [bool(round(x)) for x in res.x[:nl]]
