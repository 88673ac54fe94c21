"""Which layers of a stage to recompute: a mixed-integer programme under each device's memory cap.

Given the group's sample counts s_d, choose r_l ∈ {0, 1} per decoder layer to minimise the
stage's time z subject to, for every device d,

    z ≥ s_d · (τ_d + Σ_l r_l · f_{d,l})                       (recompute adds the layer's forward)
    base + alpha·W + s_d · (n·(Kp·Σ_l (1 − r_l)·A_l + Σ_l r_l·A_l + Kp·A_fixed) + Kp·A_max·y) ≤ budget_d
    y ≥ r_l                                                    (one layer's activations while recomputing)

as seed 004 trades recomputation time for memory (there with a linear programme over stages,
here per stage once the split is fixed). Samples and flags are alternated: Algorithm 1 shares
for the current flags, then the MILP for those shares, until they agree.

The common case has a closed form (:func:`_closed_form`): every decoder layer keeps the same
activation bytes (a model's layers share their output shape) and the group's devices rank the
layers' forward times alike (one device, or hosts priced from one table at their capacities). Each
state's memory row then only counts the flagged layers, so the fewest layers that fit are needed,
and those with the smallest forward times are each device's cheapest set at once: that set is the
MILP's optimum. HiGHS stops within its default relative gap (1e-4), so where two flag sets differ
by less (8 of 330 programmes of one 2-host search, 1e-8 of the stage time apart) it may return either; the closed
form returns the optimum. Everything else goes to HiGHS, each distinct programme solved once per
search (``Tables.memo``).
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
        ps, secs = _span_costs(pb, t, names, cut, tuple(flags), tuple(states))
        caps = [max(0.0, bu) / ps for bu in budget]
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
        new = _solve(t.memo, terms, tau, f, budget, samples)
        if new is None or new == flags:
            break
        s2 = alloc(new)
        if s2 is None:
            break
        flags, samples = new, s2
    return flags, samples


def _span_costs(pb: Problem, t: Tables, names: Sequence[str], cut: tuple[int, int], flags: tuple[bool, ...],
                states: tuple[PeakState, ...]) -> tuple[float, list[float]]:
    """The stage's peak bytes per sample over ``states`` and each host's seconds per sample, with
    these flags (kept in ``t.memo``: neither depends on the micro-batch size or the group, which
    the search varies around the same cuts)."""
    key = ("peak per sample", cut, flags, states)
    ps = t.memo.get(key)
    if ps is None:
        span = Span.of_cut(cut[0], cut[1], t.L, flags)
        ps = t.memo[key] = max(float(t.mem.peak_per_sample(span, states)), 1e-30)  # Kp may be 0 in a fitted model
    secs = []
    for nm in names:
        k2 = ("seconds per sample", nm, cut, flags)
        got = t.memo.get(k2)
        if got is None:
            got = t.memo[k2] = float(stage_time(pb.profiles, nm, Span.of_cut(cut[0], cut[1], t.L, flags)).per_sample)
        secs.append(got)
    return ps, secs


def _solve(memo: dict, terms: Sequence[tuple[float, np.ndarray, float]], tau, f, budget, samples
           ) -> list[bool] | None:
    """The MILP's flags: the closed form where it applies, else HiGHS (each programme once)."""
    got = _closed_form(terms, tau, f, budget, samples)
    if got is not NOT_CLOSED:
        return got
    key = ("milp", tuple((c, a.tobytes(), y) for c, a, y in terms), tuple(tau), tuple(x.tobytes() for x in f),
           tuple(budget), tuple(samples))
    if key not in memo:
        memo[key] = _milp(terms, tau, f, budget, samples)
    got = memo[key]
    return None if got is None else list(got)


NOT_CLOSED = object()
""":func:`_closed_form`'s answer where the programme is not of its case."""


def _closed_form(terms: Sequence[tuple[float, np.ndarray, float]], tau, f, budget, samples):
    """The MILP's optimum where every layer's memory coefficient is the same in each state and the
    devices order the layers' forward times alike (see the module docstring): the fewest layers
    that fit every device in every state, those with the smallest forward times (ties: the
    earlier layer); None when no count fits; :data:`NOT_CLOSED` outside this case."""
    nl = len(terms[0][1])
    if nl == 0 or any(y < 0 or not np.all(coef == coef[0]) for _, coef, y in terms):
        return NOT_CLOSED
    F = np.asarray(f, dtype=float).reshape(len(tau), nl)
    if not np.all(F > 0):
        return NOT_CLOSED  # a free layer: a larger set may tie the optimum
    order = np.lexsort((np.arange(nl), *F[::-1]))  # by device 0's times, then device 1's, ..., then index
    if not np.all(np.diff(F[:, order], axis=1) >= 0):
        return NOT_CLOSED  # the devices rank the layers differently
    rows = [(float(s), float(bu)) for s, bu in zip(samples, budget)]

    def fits(n: int) -> bool:
        return all(s * const + s * n * float(coef[0]) + s * (y if n else 0.0) <= bu
                   for s, bu in rows for const, coef, y in terms)

    n = next((n for n in range(nl + 1) if fits(n)), None)
    if n is None:
        return None
    flags = [False] * nl
    for l in order[:n]:
        flags[int(l)] = True
    return flags


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
