"""Pruning before pricing: the bound of planner/prune.py never exceeds a layout's priced step, so a
layout it skips could not have won."""
import random

import pytest

from torchpp.cost import Links, MemoryEstimator, Profiles
from torchpp.formats import SPLIT_BACKWARD
from torchpp.planner.prune import chunk_bound, layout_bound
from torchpp.planner.search import search
from torchpp.planner.synthetic import random_instance
from torchpp.planner.tables import Tables
from torchpp.planner.types import InfeasibleError, Problem


def bound_of(t: Tables, idx: dict, plan) -> float:
    m, b = plan.num_microbatches, plan.micro_batch_size
    pl = plan.placement()
    if pl.kind == "single":
        split = plan.schedule in SPLIT_BACKWARD
        return layout_bound(t, [(s.layers, [idx[d.host] for d in s.devices]) for s in plan.stages], b, m, split)

    groups = [[idx[d.host] for d in plan.stages[pl.chunks[g][0]].devices] for g in range(pl.p)]
    bounds = [s.layers[0] for s in plan.stages] + [plan.stages[-1].layers[1]]
    return chunk_bound(t, groups, bounds, pl.position, b, m, plan.schedule in SPLIT_BACKWARD)


@pytest.mark.parametrize("seed", range(4))
def test_the_bound_is_below_every_priced_step(seed):
    rng = random.Random(seed)
    files, bw, mem = random_instance(rng, hosts=rng.randint(2, 4), layers=rng.randint(4, 6), batch=2)
    pb = Problem(profiles=Profiles.from_layers(files), links=Links(bw), hosts=[f.host for f in files], budget=mem,
                 memory=MemoryEstimator.analytic(), global_batch=4, schedule="auto")
    try:
        res = search(pb)
    except InfeasibleError:
        pytest.skip("no plan fits this instance")
    t, idx = Tables(pb), {h: i for i, h in enumerate(pb.hosts)}
    kinds = {p.schedule for _, p in res.priced}
    assert len(kinds) > 1 and res.priced
    for step, plan in res.priced:
        assert bound_of(t, idx, plan) <= step * (1 + 1e-9), (plan.schedule, step)


def test_a_zero_per_sample_time_bounds_that_part_by_zero():
    """A tiny model's blocks can read 0 s per sample (all per-call): the bound stays finite and is
    the per-call part alone (the quick demo's plan divided by zero here)."""
    from types import SimpleNamespace

    from torchpp.planner.prune import group_bound

    c = (0, 2)
    t = SimpleNamespace(memo={}, tau={(0, 0): {c: 0.0}, (1, 0): {c: 0.5}}, tau0={(0, 0): {c: 0.01}, (1, 0): {c: 0.02}})
    assert group_bound(t, [0, 1], [c], b=4, m=3) == 3 * 0.01
    t.memo.clear()
    t.tau[(0, 0)][c] = 0.25
    assert abs(group_bound(t, [0, 1], [c], b=4, m=3) - 3 * (4 / (1 / 0.25 + 1 / 0.5) + 0.01)) < 1e-12
