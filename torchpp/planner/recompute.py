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

from typing import Sequence

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp

from ..cost import Span, layer_forward, stage_time
from .allocate import allocate

from ..schedules import PeakState
from .tables import Tables
from .types import Problem


def choose_recompute(pb: Problem, t: Tables, hosts: Sequence[int], cut: tuple[int, int], b: int,
                     states: Sequence[PeakState]) -> tuple[list[bool], list[int]] | None:
    """(recompute flag per layer, samples per device) minimising the stage time; None if nothing fits.
    ``states``: the stage's order's (``schedules.peak_states``); every one must fit."""
    c, c2 = cut
    names = [pb.hosts[h] for h in hosts]
    budget = [pb.budget[nm] - float(t.static[c, c2]) for nm in names]
    nl = c2 - c

    def alloc(flags):
        span = Span.of_cut(c, c2, t.L, flags)
        ps = max(float(t.mem.peak_per_sample(span, states)), 1e-30)  # Kp may be 0 in a fitted model
        caps = [max(0.0, bu) / ps for bu in budget]
        secs = [float(stage_time(pb.profiles, nm, span).per_sample) for nm in names]
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
    A_l = t.mem.layer_activations(c, c2)
    A_fixed = float(t.mem.activations(Span.of_cut(c, c2, t.L, recompute=True)).kept)  # embed / tail outputs
    whole = Span.of_cut(c, c2, t.L)
    acts = t.mem.activations(whole)
    terms = [pb.memory.recompute_terms(A_l, A_fixed, n, int(t.mem.split_of(whole, w)), float(acts.body),
                                       float(acts.tail), float(acts.layer), heap) for n, w, heap in states]
    tau = [float(t.tau[(h, 0)][c, c2]) for h in hosts]
    f = [layer_forward(pb.profiles, nm, c, c2) for nm in names]
    for _ in range(4):
        new = _milp(terms, tau, f, budget, samples)
        if new is None or new == flags:
            break
        s2 = alloc(new)
        if s2 is None:
            break
        flags, samples = new, s2
    return flags, samples


def _milp(terms: Sequence[tuple[float, np.ndarray, float]], tau, f, budget, samples) -> list[bool] | None:
    """Variables [r_0..r_{nl-1}, y, z]; minimise z. ``terms``: the memory per sample as a linear
    form in the flags (``MemoryEstimator.recompute_terms``), one per state of the stage's order;
    each must fit every device's budget."""
    nl, k = len(terms[0][1]), len(tau)
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
        # memory, at every state: s·(const + Σ r·coef_l + y·coef_y) ≤ budget
        scale_m = max(abs(budget[d]), 1.0)
        for const_ps, coef_l, coef_y in terms:
            row = np.zeros(nv)
            row[:nl] = s * coef_l / scale_m
            row[nl] = s * coef_y / scale_m
            const = s * const_ps
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
