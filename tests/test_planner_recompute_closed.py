"""The recompute MILP's closed form (planner/recompute.py) returns the programme's optimum: checked
against every flag set of small random programmes, and against HiGHS where the optimum is unique
by more than HiGHS's gap; programmes outside its case go to HiGHS."""
import itertools
import random

import numpy as np
import pytest

from torchpp.planner.recompute import NOT_CLOSED, _closed_form, _milp, _solve


def programme(rng: random.Random, nl: int, k: int, states: int, comonotone: bool = True):
    """(terms, tau, f, budget, samples) shaped like choose_recompute's: equal layer activations,
    a group of ``k`` devices whose forward times are one table over their speeds (``comonotone``)."""
    A = rng.uniform(1e6, 4e6)
    terms = []
    for _ in range(states):
        n, kp = rng.randint(1, 4), rng.uniform(2.0, 16.0)
        terms.append((n * kp * A * (nl + rng.uniform(0, 3)), np.full(nl, n * (1 - kp) * A), kp * A))
    base = np.array([rng.uniform(0.1, 0.3) for _ in range(nl)])
    f = [base / rng.uniform(0.5, 3.0) if comonotone else np.array([rng.uniform(0.1, 0.3) for _ in range(nl)])
         for _ in range(k)]
    tau = [3 * float(x.sum()) for x in f]
    samples = [rng.randint(1, 4) for _ in range(k)]
    worst = max(s * c for s in samples for c, _, _ in terms)
    budget = [worst * rng.uniform(0.3, 1.1) for _ in range(k)]
    return terms, tau, f, budget, samples


def brute(terms, tau, f, budget, samples):
    """Every flag set: (objective, flags) of the feasible ones."""
    nl = len(terms[0][1])
    out = []
    for flags in itertools.product((False, True), repeat=nl):
        r = np.array(flags, dtype=float)
        y = 1.0 if any(flags) else 0.0
        if all(s * (c + float(coef @ r) + y * cy) <= bu for s, bu in zip(samples, budget) for c, coef, cy in terms):
            out.append((max(s * (t + float(fd @ r)) for s, t, fd in zip(samples, tau, f)), list(flags)))
    return out


@pytest.mark.parametrize("seed", range(60))
def test_closed_form_is_the_optimum_of_every_flag_set(seed):
    rng = random.Random(seed)
    prog = programme(rng, nl=rng.randint(1, 9), k=rng.randint(1, 3), states=rng.randint(1, 3))
    got = _closed_form(*prog)
    assert got is not NOT_CLOSED
    every = brute(*prog)
    if not every:
        assert got is None
        return
    best = min(v for v, _ in every)
    value = {tuple(fl): v for v, fl in every}
    assert tuple(got) in value, "the closed form's flags do not fit"
    assert value[tuple(got)] <= best * (1 + 1e-12)


@pytest.mark.parametrize("seed", range(40))
def test_closed_form_equals_highs_where_the_optimum_is_unique_beyond_its_gap(seed):
    rng = random.Random(1000 + seed)
    prog = programme(rng, nl=rng.randint(2, 9), k=rng.randint(1, 3), states=rng.randint(1, 2))
    every = sorted(brute(*prog), key=lambda x: x[0])
    if len(every) < 2 or every[1][0] - every[0][0] <= 2e-4 * every[1][0]:
        pytest.skip("no feasible set, or a runner-up within HiGHS's relative gap")
    assert _closed_form(*prog) == _milp(*prog) == every[0][1]


def test_outside_its_case_the_programme_goes_to_highs_once():
    rng = random.Random(3)
    terms, tau, f, budget, samples = programme(rng, nl=6, k=2, states=1, comonotone=False)
    f = [np.array([0.1, 0.2, 0.3, 0.4, 0.5, 0.6]), np.array([0.6, 0.5, 0.4, 0.3, 0.2, 0.1])]  # ranked apart
    assert _closed_form(terms, tau, f, budget, samples) is NOT_CLOSED
    uneven = [(c, coef * np.linspace(0.5, 1.5, len(coef)), y) for c, coef, y in terms]  # layers' activations differ
    assert _closed_form(uneven, tau, [f[0], f[0]], budget, samples) is NOT_CLOSED
    memo: dict = {}
    first = _solve(memo, terms, tau, f, budget, samples)
    assert len(memo) == 1 and first == _milp(terms, tau, f, budget, samples)
    assert _solve(memo, terms, tau, f, budget, samples) == first and len(memo) == 1
