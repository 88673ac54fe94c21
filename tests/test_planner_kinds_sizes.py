"""The search prices every one-chunk kind at every micro-batch size the DP found good layouts
for: on measured homelab costs (bench_prove's run 14, kept in tests/data/homelab_costs) the 1F1B
DP's best three layouts all use 16 micro-batches of 2, and ZB-H1 is fastest at 8 of 4."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from torchpp.cost import Links, MemoryEstimator, Profiles
from torchpp.formats import Bandwidth, Capacities, LayersFile, MemoryModel
from torchpp.planner.kinds import best_per_size
from torchpp.planner.types import InfeasibleError, Problem, micro_batch_sizes
from torchpp.planner.search import search

DATA = Path(__file__).parent / "data" / "homelab_costs"


def _problem() -> Problem:
    mm = MemoryModel.load(DATA / "memory_model.json")
    est = MemoryEstimator.fitted(mm)
    devices = json.loads((DATA / "devices.json").read_text())
    hosts = list(devices)
    budget = est.budgets({h: float(v["memory_gb"] if isinstance(v, dict) else v) * 2**30 for h, v in devices.items()})
    return Problem(profiles=Profiles.from_layers([LayersFile.load(DATA / "layers_laptop.json")],
                                                 Capacities.load(DATA / "capacities.json")),
                   links=Links(Bandwidth.load(DATA / "bandwidth.json")), hosts=hosts, budget=budget, memory=est,
                   global_batch=32, schedule="auto")


def test_the_search_is_as_good_as_any_single_micro_batch_size():
    pb = _problem()
    got = search(pb)
    by_size = {}
    for b in micro_batch_sizes(pb):
        try:
            by_size[b] = search(replace(pb, micro_batch_sizes=[b])).step_time_s
        except InfeasibleError:
            pass
    assert got.step_time_s <= min(by_size.values()) * 1.01, (got.plan.schedule, got.plan.micro_batch_size, by_size)


def test_best_per_size_keeps_the_best_few_of_each_size():
    class P:
        def __init__(self, b):
            self.micro_batch_size = b

    plans = [(3.0, P(2)), (1.0, P(2)), (2.0, P(2)), (5.0, P(4)), (4.0, P(4)), (0.5, P(2))]
    got = best_per_size(plans, 2)
    assert [(s, p.micro_batch_size) for s, p in got] == [(0.5, 2), (1.0, 2), (4.0, 4), (5.0, 4)]


def test_only_chunked_kinds_that_do_not_fit_are_named_as_such():
    """With 60% of the budgets no V layout fits while one chunk per device does: the error says so
    (it used to blame the one-chunk split and suggest --max-stages). (At 90% the search now finds a
    V at one sample per micro-batch, trying every size on each seed's device groups.)"""
    pb = _problem()
    pb = replace(pb, budget={h: v * 0.6 for h, v in pb.budget.items()}, schedule="v")
    with pytest.raises(InfeasibleError) as e:
        search(pb)
    msg = str(e.value)
    assert "no plan of v fits" in msg and "both the embedding and the lm_head" in msg
    assert "try --schedule auto" in msg and "--max-stages" not in msg
    assert search(replace(pb, schedule="1f1b")).step_time_s > 0
