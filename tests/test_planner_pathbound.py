"""The longest path through a layout's order (planner/pathbound.py) is a lower bound on its replayed
step, for every layout of every kind on small random instances, and on sampled layouts of the
homelab's measured costs; where nothing but compute and rested links is on the path, it equals it."""
import itertools
import random
from dataclasses import replace

import numpy as np
import pytest

from torchpp.cost import Links, MemoryEstimator, Profiles
from torchpp.planner.build import build_plan
from torchpp.planner.chunks import ChunkLayout, chunk_counts, group_sequences, price_layout
from torchpp.planner.pathbound import PathBound
from torchpp.planner.pricing import price_plan
from torchpp.planner.synthetic import random_instance
from torchpp.planner.tables import Tables
from torchpp.planner.types import Problem, StageChoice

ONE = ("1f1b", "zb-h1", "gpipe")
KINDS = ONE + ("interleaved", "interleaved-zb", "v", "zbv")


def priced(pb, t, kind, groups, v, b, row):
    """The layout's replayed step (None where it does not fit or run)."""
    if v > 1:
        got = price_layout(pb, t, ChunkLayout(kind=kind, v=v, b=b, groups=groups, bounds=tuple(row)))
        return got[0] if got else None
    order = [d for g in groups for d in g]
    pos = list(itertools.accumulate([0] + [len(g) for g in groups]))
    stages = [StageChoice(cut=(row[s], row[s + 1]), hosts=(pos[s], pos[s + 1]), recompute_all=False, cost=0.0)
              for s in range(len(groups))]
    pk = replace(pb, schedule=kind)
    plan = build_plan(pk, t, order, stages, b, "brute")
    return None if plan is None else price_plan(pk, plan, keep=False)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_the_path_is_below_every_replayed_layout(seed):
    rng = random.Random(seed)
    N, L = rng.randint(2, 4), rng.randint(4, 6)
    files, bw, mem = random_instance(rng, hosts=N, layers=L, batch=2)
    G = rng.choice([2, 4])
    pb = Problem(profiles=Profiles.from_layers(files), links=Links(bw), hosts=[f.host for f in files],
                 budget={h: 10 * x for h, x in mem.items()}, memory=MemoryEstimator.analytic(), global_batch=G,
                 schedule="auto")
    pb.profiles.ensure(pb.hosts)
    t = Tables(pb)
    ratios = []
    for b in [x for x in range(1, G + 1) if G % x == 0]:
        for groups in group_sequences(N, b):
            for kind in KINDS:
                for v in [1] if kind in ONE else chunk_counts(kind, len(groups), L):
                    S = v * len(groups)
                    if S > L:
                        continue
                    try:
                        bound = PathBound(pb, t, kind, groups, v, b)
                    except ValueError:  # the order does not run this many micro-batches at this depth
                        continue
                    rows = np.array([(0, *c, L) for c in itertools.combinations(range(1, L), S - 1)])
                    for row, x in zip(rows, bound.bound(rows)):
                        step = priced(pb, t, kind, groups, v, b, [int(y) for y in row])
                        if step is not None:
                            assert x <= step * (1 + 1e-9), (kind, b, groups, row, x, step)
                            ratios.append(x / step)
    assert len(ratios) > 50
    assert np.median(ratios) > 0.8  # a bound worth pricing by: most layouts' path is most of their step


def test_the_path_is_below_sampled_layouts_on_measured_homelab_costs():
    """Measured profiles (a split backward's own factors, per-call runtime costs, links with bursts),
    budgets three times the homelab's so most layouts fit: 300 random layouts of every kind."""
    import json
    from pathlib import Path

    from torchpp.formats import Bandwidth, Capacities, LayersFile, MemoryModel

    data = Path(__file__).parent / "data" / "homelab_costs"
    est = MemoryEstimator.fitted(MemoryModel.load(data / "memory_model.json"))
    devices = json.loads((data / "devices.json").read_text())
    pb = Problem(profiles=Profiles.from_layers([LayersFile.load(data / "layers_laptop.json")],
                                               Capacities.load(data / "capacities.json")),
                 links=Links(Bandwidth.load(data / "bandwidth.json")), hosts=list(devices),
                 budget=est.budgets({h: 3 * v["memory_gb"] * 2**30 for h, v in devices.items()}), memory=est,
                 global_batch=32, schedule="auto")
    pb.profiles.ensure(pb.hosts)
    t = Tables(pb)
    rng = random.Random(1)
    seqs = {b: list(group_sequences(len(pb.hosts), b)) for b in (1, 2, 4, 8, 16, 32)}
    checked = exact = 0
    for _ in range(300):
        b = rng.choice(list(seqs))
        groups = rng.choice(seqs[b])
        kind = rng.choice(KINDS)
        vs = [1] if kind in ONE else chunk_counts(kind, len(groups), t.L)
        if not vs:
            continue
        v = rng.choice(vs)
        try:
            bound = PathBound(pb, t, kind, groups, v, b)
        except ValueError:
            continue
        row = [0, *sorted(rng.sample(range(1, t.L), v * len(groups) - 1)), t.L]
        x = float(bound.bound(np.array([row]))[0])
        step = priced(pb, t, kind, groups, v, b, row)
        if step is not None:
            assert x <= step * (1 + 1e-9), (kind, b, groups, row, x, step)
            checked += 1
            exact += x >= step * (1 - 1e-9)
    assert checked > 150 and exact > checked // 3
