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
    """A tiny model's blocks can read 0 s per sample (all per-call): the bound stays finite; every
    device still computes a whole sample, so the slow one bounds it (the quick demo's plan divided
    by zero here)."""
    from types import SimpleNamespace

    from torchpp.planner.prune import group_bound

    c = (0, 2)
    t = SimpleNamespace(memo={}, tau={(0, 0): {c: 0.0}, (1, 0): {c: 0.5}}, tau0={(0, 0): {c: 0.01}, (1, 0): {c: 0.02}})
    assert group_bound(t, [0, 1], [c], b=4, m=3) == pytest.approx(3 * (0.5 + 0.02))


@pytest.mark.parametrize("seed", range(6))
def test_the_busiest_device_bound_is_the_best_integer_shares(seed):
    """The group's compute bound equals the least busiest device over every split of b samples into
    whole shares of at least one each (brute force), as the allocation (planner/allocate.py) gives."""
    from types import SimpleNamespace

    from torchpp.planner.prune import group_bound

    rng = random.Random(seed)
    k, b, m = rng.randint(1, 4), rng.randint(4, 9), rng.randint(1, 5)
    c = (0, 1)
    tau = {(h, 0): {c: rng.choice([0.0, rng.uniform(0.1, 2.0)])} for h in range(k)}
    tau0 = {(h, 0): {c: rng.uniform(0.0, 0.3)} for h in range(k)}
    t = SimpleNamespace(memo={}, tau=tau, tau0=tau0)

    def splits(n, parts):
        if parts == 1:
            yield (n,)
            return
        for first in range(1, n - parts + 2):
            for rest in splits(n - first, parts - 1):
                yield (first, *rest)

    brute = min(max(s * tau[(h, 0)][c] + tau0[(h, 0)][c] for h, s in enumerate(sh)) for sh in splits(b, k))
    assert group_bound(t, list(range(k)), [c], b=b, m=m) == pytest.approx(m * brute)


@pytest.mark.parametrize("seed", range(3))
def test_the_bound_is_below_every_layout_priced_without_pruning(seed):
    """Every layout of small instances (every device group sequence, cut, micro-batch size and
    kind), built and priced with no bound skipping any: the bound never exceeds its step, with
    bursts and latencies on the links, tied and untied embeddings, Qwen-like all-reduces."""
    import dataclasses
    import itertools
    from dataclasses import replace

    from torchpp.formats import MULTI_CHUNK, ONE_CHUNK
    from torchpp.planner.build import build_plan
    from torchpp.planner.chunks import every_cut, group_sequences, layout_bound_of, price_layout
    from torchpp.planner.pricing import price_plan
    from torchpp.planner.synthetic import qwen_like
    from torchpp.planner.types import StageChoice, micro_batch_sizes
    from torchpp.schedules import REGISTRY

    rng = random.Random(100 + seed)
    if seed == 2:
        files, bw, mem = qwen_like(rng, 3, 5)
    else:
        files, bw, mem = random_instance(rng, hosts=3, layers=5, batch=2, tied=seed == 0)
    bw = dataclasses.replace(bw, burst_bytes={k: rng.choice([0, 1e3, 1e7]) for k in bw.bytes_per_sec},
                             latency_s={k: rng.choice([0, 1e-3, 0.1]) for k in bw.bytes_per_sec})
    pb = Problem(profiles=Profiles.from_layers(files), links=Links(bw), hosts=[f.host for f in files], budget=mem,
                 memory=MemoryEstimator.analytic(), global_batch=4, schedule="1f1b")
    t = Tables(pb)
    priced = 0
    for b in micro_batch_sizes(pb):
        m = pb.global_batch // b
        for groups in group_sequences(3, b):
            for lay in every_cut(list(MULTI_CHUNK), b, groups, t.L, 40):
                got = price_layout(pb, t, lay)
                if got:
                    priced += 1
                    assert layout_bound_of(t, lay, m) <= got[0] * (1 + 1e-9), lay
            order = [h for g in groups for h in g]
            for kind in ONE_CHUNK:
                pbk = replace(pb, schedule=kind)
                for cuts in itertools.combinations(range(1, t.L), len(groups) - 1):
                    bd = (0, *cuts, t.L)
                    pos, stages = 0, []
                    for i, g in enumerate(groups):
                        stages.append(StageChoice(cut=(bd[i], bd[i + 1]), hosts=(pos, pos + len(g)),
                                                  recompute_all=False, cost=0.0))
                        pos += len(g)
                    try:
                        plan = build_plan(pbk, t, order, stages, b, "optimal")
                        step = None if plan is None else price_plan(pbk, plan)
                    except ValueError:  # the kind's order cannot run this many micro-batches here
                        continue
                    if step is None:
                        continue
                    priced += 1
                    bound = layout_bound(t, [((bd[i], bd[i + 1]), list(g)) for i, g in enumerate(groups)], b, m,
                                         REGISTRY[kind].split_backward)
                    assert bound <= step * (1 + 1e-9), (kind, groups, bd, b)
    assert priced > 100


def test_the_bound_is_the_closed_form_of_a_uniform_1f1b_pipeline():
    """p equal stages on equal devices over free links: 1F1B's step is (m + p - 1)(F + B), and so is
    the bound (the last stage's fill, its m micro-batches, the first stage's drain)."""
    from torchpp.planner.pricing import price_plan
    from torchpp.planner.synthetic import layers_file, uniform_links

    hosts = ["a", "b", "c", "d"]
    files = [layers_file(h, num_layers=8, layer_fwd_s=0.1, layer_bwd_s=0.2, embed_fwd_s=0.0, tail_fwd_s=0.0)
             for h in hosts]
    pb = Problem(profiles=Profiles.from_layers(files), links=Links(uniform_links(hosts, 1e15)), hosts=hosts,
                 budget={h: 10**12 for h in hosts}, memory=MemoryEstimator.analytic(), global_batch=24,
                 schedule="1f1b")
    t = Tables(pb)
    from torchpp.planner.build import build_plan
    from torchpp.planner.types import StageChoice

    stages = [StageChoice(cut=(2 * i, 2 * i + 2), hosts=(i, i + 1), recompute_all=False, cost=0.0) for i in range(4)]
    for b in (1, 2, 4):
        m = 24 // b
        step = price_plan(pb, build_plan(pb, t, [0, 1, 2, 3], stages, b, "optimal"))
        per = 2 * (0.1 + 0.2) * b / 4  # two layers, per sample of the 4-sample profile
        assert step == pytest.approx((m + 3) * per, rel=1e-9)
        bound = layout_bound(t, [((2 * i, 2 * i + 2), [i]) for i in range(4)], b, m, split=False)
        assert bound == pytest.approx(step, rel=1e-9)
