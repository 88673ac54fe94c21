"""What makes the search fast keeps its answers: the exact stage DP solved for every device order
at once gives each order the stages the DP of that order alone gives (written apart below, as it
was before the orders shared their states); durations priced once per distinct action and stage
times kept across plans price every action as before."""
import random

import numpy as np
import pytest

from torchpp.cost import Links, MemoryEstimator, Profiles
from torchpp.planner.dp import dp_orders, suffix_in_flight
from torchpp.planner.single import device_orders
from torchpp.planner.synthetic import random_instance
from torchpp.planner.tables import StageCosts, Tables
from torchpp.planner.types import Problem


def searched(rng: random.Random, hosts: int, layers: int):
    """A random instance's problem (every kind) and its search; skipped where no plan fits."""
    from torchpp.planner.search import search
    from torchpp.planner.types import InfeasibleError

    files, bw, mem = random_instance(rng, hosts=hosts, layers=layers, batch=2)
    pb = Problem(profiles=Profiles.from_layers(files), links=Links(bw), hosts=[f.host for f in files], budget=mem,
                 memory=MemoryEstimator.analytic(), global_batch=4, schedule="auto")
    try:
        return pb, search(pb)
    except InfeasibleError:
        pytest.skip("no plan fits this instance")


def one_order(order, sc, max_stages, max_group):
    """The stage DP of one device order: {stages: (bottleneck, [(cut, (a, i)) per stage])}."""
    t, m, L, N = sc.t, sc.m, sc.t.L, len(order)
    K = min(max_group, N, sc.b)
    grp = {(a, i): tuple(sorted(order[a:i])) for a in range(N) for i in range(a + 1, min(N, a + K) + 1)}
    V = {k: sc.stage(g, None, *suffix_in_flight(t.pb.schedule, 0, m))[:, L] for k, g in grp.items()}
    ptr, best, S_max = [{}], {}, min(max_stages, L, N)
    for j in range(S_max):
        heads = [(V[(0, i)][0], i) for i in range(1, N + 1) if (0, i) in V]
        if heads:
            val, i = min(heads, key=lambda x: x[0])
            if np.isfinite(val):
                stages, c, a, jj = [], 0, 0, j
                while jj > 0:
                    c2, nxt = ptr[jj][(a, i)][int(c)]
                    stages.append(((c, c2), (a, i)))
                    c, a, i, jj = c2, i, nxt, jj - 1
                best[j + 1] = (float(val), stages + [((c, L), (a, i))])
        if j + 1 >= S_max:
            break
        n, w = suffix_in_flight(t.pb.schedule, j + 1, m)
        newV, newptr = {}, {}
        for (a2, a), g in grp.items():
            cands = [(i, V[(a, i)]) for i in range(a + 1, N + 1) if (a, i) in V and np.isfinite(V[(a, i)]).any()]
            if a >= N or not cands:
                continue
            tots = [np.maximum(sc.stage(g, grp[(a, i)], n, w), v[None, :]) for i, v in cands]
            args = [x.argmin(axis=1) for x in tots]
            vals = np.stack([x[np.arange(L + 1), arg] for x, arg in zip(tots, args)])
            which = vals.argmin(axis=0)
            newV[(a2, a)] = vals[which, np.arange(L + 1)]
            newptr[(a2, a)] = [(int(args[k][c]), cands[k][0]) for c, k in enumerate(which)]
        V = newV
        ptr.append(newptr)
    return best


@pytest.mark.parametrize("seed", range(8))
def test_dp_of_every_order_at_once_gives_each_order_its_own_stages(seed):
    rng = random.Random(seed)
    files, bw, mem = random_instance(rng, hosts=rng.randint(2, 5), layers=rng.randint(3, 9), batch=2)
    G = rng.choice([4, 8])
    pb = Problem(profiles=Profiles.from_layers(files), links=Links(bw), hosts=[f.host for f in files], budget=mem,
                 memory=MemoryEstimator.analytic(), global_batch=G, schedule=rng.choice(["1f1b", "gpipe"]))
    t = Tables(pb)
    orders, _ = device_orders(pb, t)
    N, shapes, found = len(pb.hosts), {}, 0
    for b in (1, 2, 4):
        sc = StageCosts(t, b, G // b, pb.allow_recompute)
        for order, got in zip(orders, dp_orders(orders, sc, N, N, shapes)):
            shaped = {S: (v, [(st.cut, st.hosts) for st in stages]) for S, (v, stages) in got.items()}
            assert shaped == one_order(order, sc, N, N), (b, order)
            found += len(got)
    assert shapes  # the states' shape was kept across sizes
    if not found:
        pytest.skip("no plan fits this instance")


@pytest.mark.parametrize("seed", range(4))
def test_durations_priced_once_per_distinct_action_equal_every_action_priced(seed):
    """planner/pricing.py's Distinct: every plan the search priced, one-chunk and chunked, groups and
    tied all-reduces included, gets the durations the simulator's generic path gives."""
    from torchpp.cost import MeasuredCost
    from torchpp.planner.pricing import Distinct, DistinctCost, schedule_key
    from torchpp.schedules import build
    from torchpp.sim.compiled import Compiled, durations_generic

    rng = random.Random(10 + seed)
    pb, res = searched(rng, rng.randint(3, 4), rng.randint(4, 6))
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
    from torchpp.schedules import build
    from torchpp.sim.compiled import Compiled, durations_generic

    pb, res = searched(random.Random(21), 3, 5)
    memo: dict = {}
    for _, plan in res.priced[:40]:
        c = Compiled(build(plan))
        kept = MeasuredCost(plan, pb.profiles, pb.links, pb.optimizer_s_per_byte, stage_times=memo)
        assert durations_generic(c, kept) == durations_generic(c, MeasuredCost(plan, pb.profiles, pb.links,
                                                                               pb.optimizer_s_per_byte))
    assert 0 < len(memo) < sum(len(s.devices) for _, p in res.priced[:40] for s in p.stages)  # shared spans


def test_chunks_held_counted_in_one_pass_equal_the_orders_profiles():
    """planner/chunks.py's chunk_in_flight (one pass over each group's order) equals the largest
    count of every profile ``schedules.in_flight_chunks`` reads off the same orders."""
    from torchpp.formats import MULTI_CHUNK
    from torchpp.planner.chunks import chunk_counts, chunk_in_flight, placement
    from torchpp.schedules import ScheduleError, in_flight_chunks

    checked = 0
    for kind in MULTI_CHUNK:
        for p in (2, 3, 5):
            for v in chunk_counts(kind, p, 24):
                pl = placement(kind, p, v)
                for m in (1, 2, 4, 6, 8, 12):
                    try:
                        profiles = [prof for pos in range(pl.p) for prof in in_flight_chunks(kind, pl, pos, m)]
                    except (ValueError, ScheduleError):
                        with pytest.raises((ValueError, ScheduleError)):
                            chunk_in_flight(kind, pl, m)
                        continue
                    want = [0] * len(pl.position)
                    for prof in profiles:
                        for c, n in prof:
                            want[c] = max(want[c], n)
                    assert chunk_in_flight(kind, pl, m) == tuple(want), (kind, p, v, m)
                    checked += 1
    assert checked > 50
