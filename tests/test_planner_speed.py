"""What makes the search fast keeps its answers: the exact stage DP's states shared across device
orders give every order the result it gets alone."""
import random

import pytest

from torchpp.cost import Links, MemoryEstimator, Profiles
from torchpp.planner.dp import dp_order
from torchpp.planner.single import device_orders
from torchpp.planner.synthetic import random_instance
from torchpp.planner.tables import StageCosts, Tables
from torchpp.planner.types import Problem


def _shape(found):
    return {S: (v, [(st.cut, st.hosts) for st in stages]) for S, (v, stages) in found.items()}


@pytest.mark.parametrize("seed", range(6))
def test_dp_states_shared_across_orders_give_each_order_its_own_result(seed):
    rng = random.Random(seed)
    files, bw, mem = random_instance(rng, hosts=rng.randint(3, 5), layers=rng.randint(3, 7), batch=2)
    pb = Problem(profiles=Profiles.from_layers(files), links=Links(bw), hosts=[f.host for f in files], budget=mem,
                 memory=MemoryEstimator.analytic(), global_batch=4, schedule=rng.choice(["1f1b", "gpipe"]))
    t = Tables(pb)
    orders, _ = device_orders(pb, t)
    N = len(pb.hosts)
    for b in (1, 2, 4):
        shared: dict = {}
        sc = StageCosts(t, b, 4 // b, pb.allow_recompute)
        for order in orders:
            alone = dp_order(order, sc, N, N)  # states kept for this order only
            assert _shape(dp_order(order, sc, N, N, shared)) == _shape(alone), (b, order)
        assert shared  # the states were kept


@pytest.mark.parametrize("seed", range(4))
def test_durations_priced_once_per_distinct_action_equal_every_action_priced(seed):
    """planner/pricing.py's Distinct: every plan the search priced, one-chunk and chunked, groups and
    tied all-reduces included, gets the durations the simulator's generic path gives."""
    from torchpp.cost import MeasuredCost
    from torchpp.planner.pricing import Distinct, DistinctCost, schedule_key
    from torchpp.planner.search import search
    from torchpp.planner.types import InfeasibleError
    from torchpp.schedules import build
    from torchpp.sim.compiled import Compiled, durations_generic

    rng = random.Random(10 + seed)
    files, bw, mem = random_instance(rng, hosts=rng.randint(3, 4), layers=rng.randint(4, 6), batch=2)
    pb = Problem(profiles=Profiles.from_layers(files), links=Links(bw), hosts=[f.host for f in files], budget=mem,
                 memory=MemoryEstimator.analytic(), global_batch=4, schedule="auto")
    try:
        res = search(pb)
    except InfeasibleError:
        pytest.skip("no plan fits this instance")
    shapes = {}
    for _, plan in res.priced:
        shapes.setdefault(schedule_key(plan), plan)
    assert len({p.schedule for p in shapes.values()}) > 1
    fewer = 0
    for plan in shapes.values():
        c = Compiled(build(plan))
        cost = MeasuredCost(plan, pb.profiles, pb.links, pb.optimizer_s_per_byte)
        distinct = Distinct.of(c)
        fewer += len(distinct.first) < len(c.acts)
        assert DistinctCost(cost, distinct).durations(c) == durations_generic(c, cost), plan.schedule
    assert fewer


def test_stage_times_kept_across_plans_price_as_worked_out_anew():
    """cost.MeasuredCost's ``stage_times`` memo (a search's ledger keeps one): every action priced
    the same as without it, for plans sharing hosts and spans."""
    from torchpp.cost import MeasuredCost
    from torchpp.planner.search import search
    from torchpp.planner.types import InfeasibleError
    from torchpp.schedules import build
    from torchpp.sim.compiled import Compiled, durations_generic

    rng = random.Random(21)
    files, bw, mem = random_instance(rng, hosts=3, layers=5, batch=2)
    pb = Problem(profiles=Profiles.from_layers(files), links=Links(bw), hosts=[f.host for f in files], budget=mem,
                 memory=MemoryEstimator.analytic(), global_batch=4, schedule="auto")
    try:
        res = search(pb)
    except InfeasibleError:
        pytest.skip("no plan fits this instance")
    memo: dict = {}
    for _, plan in res.priced[:40]:
        c = Compiled(build(plan))
        kept = MeasuredCost(plan, pb.profiles, pb.links, pb.optimizer_s_per_byte, stage_times=memo)
        assert durations_generic(c, kept) == durations_generic(c, MeasuredCost(plan, pb.profiles, pb.links,
                                                                               pb.optimizer_s_per_byte))
    assert 0 < len(memo) < sum(len(s.devices) for _, p in res.priced[:40] for s in p.stages)  # shared spans
