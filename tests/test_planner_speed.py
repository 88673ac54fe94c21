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
