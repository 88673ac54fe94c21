"""The search over schedule kinds: equals brute force over every kind on small instances, beats
seed 000's plan by 2x on its instance through the V placement, and stays above a proven bound."""
import itertools
import random
from dataclasses import replace

import pytest

from torchpp.cost import Links, MemoryEstimator, Profiles
from torchpp.planner import api
from torchpp.planner.bound import lower_bound
from torchpp.formats import KIND_NAMES as KINDS, MULTI_CHUNK, parse_kinds as schedule_kinds
from torchpp.planner.chunks import ChunkLayout, build_chunk_plan, chunk_counts
from torchpp.planner.types import Problem, StageChoice
from torchpp.planner.tables import Tables
from torchpp.planner.build import build_plan
from torchpp.planner.search import search
from torchpp.planner.synthetic import layers_file, random_instance, seed000_instance, seed000_plan, uniform_links
from torchpp.sim.measured import price


def problem(files, bw, budget, G, **kw):
    return Problem(profiles=Profiles.from_layers(files), links=Links(bw), hosts=[f.host for f in files],
                   budget=budget, memory=kw.pop("memory", MemoryEstimator.analytic()), global_batch=G, **kw)


# ----------------------------------------------------------------------------- brute force, written apart
def ordered_groups(n, p):
    for labels in itertools.product(range(p + 1), repeat=n):  # label p = idle
        groups = tuple(tuple(d for d in range(n) if labels[d] == s) for s in range(p))
        if all(groups):
            yield groups


def compositions(L, S):
    for cuts in itertools.combinations(range(1, L), S - 1):
        yield (0, *cuts, L)


def brute_force(pb):
    """Lowest priced step over every kind, micro-batch size, device-group sequence, chunk count and cut."""
    t = Tables(pb)
    N, L, G = len(pb.hosts), t.L, pb.global_batch
    best = float("inf")
    for b in [x for x in range(1, G + 1) if G % x == 0]:
        for p in range(1, N + 1):
            for groups in ordered_groups(N, p):
                if any(len(g) > b for g in groups):
                    continue
                for kind in ("1f1b", "zb-h1", "gpipe"):
                    pk = replace(pb, schedule=kind)
                    order = [d for g in groups for d in g]
                    pos = list(itertools.accumulate([0] + [len(g) for g in groups]))
                    for bounds in compositions(L, p) if p <= L else ():
                        stages = [StageChoice(cut=(bounds[s], bounds[s + 1]), hosts=(pos[s], pos[s + 1]),
                                              recompute_all=False, cost=0.0) for s in range(p)]
                        plan = build_plan(pk, t, order, stages, b, "brute")
                        if plan is not None:
                            best = min(best, price(plan, pk.profiles, pk.links)[0])
                for kind in MULTI_CHUNK:
                    for v in chunk_counts(kind, p, L):
                        for bounds in compositions(L, v * p):
                            plan = build_chunk_plan(pb, t, ChunkLayout(kind=kind, v=v, b=b, groups=groups,
                                                                       bounds=bounds))
                            if plan is not None:
                                best = min(best, price(plan, pb.profiles, pb.links)[0])
    return best


@pytest.mark.parametrize("seed,hosts,layers,G", [(15, 3, 4, 2), (21, 3, 5, 4), (12, 2, 6, 4), (3, 3, 6, 2)])
def test_auto_equals_brute_force_over_every_kind(seed, hosts, layers, G):
    files, bw, mem = random_instance(random.Random(seed), hosts=hosts, layers=layers, batch=2)
    pb = problem(files, bw, mem, G, schedule="auto")
    best = brute_force(pb)
    assert best < float("inf")
    res = search(pb)
    assert res.step_time_s == pytest.approx(best, rel=1e-9)
    assert res.step_time_s == pytest.approx(price(res.plan, pb.profiles, pb.links)[0], rel=1e-12)


def seed000_problem(**kw):
    files, bw, mem, memory = seed000_instance()
    return problem(files, bw, mem, 20, memory=memory, micro_batch_sizes=[4], **kw)


def test_seed000_instance_plan_is_at_most_half_of_seed000s_own_plan():
    pb = seed000_problem(schedule="auto")
    theirs = price(seed000_plan(pb.profiles.model), pb.profiles, pb.links)[0]
    assert theirs == pytest.approx(88.08, abs=0.05)  # the figure on record for seed 000's plan
    ours = search(replace(pb, schedule="1f1b"))
    assert ours.step_time_s == pytest.approx(84.30, abs=0.05)  # 1F1B alone pays the tied all-reduce
    res = search(pb)
    assert res.step_time_s <= 0.5 * theirs, (res.step_time_s, theirs)
    assert res.plan.schedule in ("v", "zbv")
    first, last = res.plan.stages[0], res.plan.stages[-1]
    assert first.ranks == last.ranks  # one device holds the embedding and the tail: no tied all-reduce
    assert lower_bound(pb.profiles, pb.hosts, pb.budget, pb.memory, 20) <= res.step_time_s


def test_a_v_is_seeded_with_the_head_that_can_hold_its_ends():
    """Five qwen-like hosts, 17 layers, a 594 MB tied lm_head that only the slow 8 GB host and one
    fast 4 GB host can hold with its optimizer state: a one-chunk plan all-reduces the tied weight
    between its ends over slow links, so no one-chunk plan seeds a V headed by the fast host, and
    the usual half of a device per chunk rejects that head. A V on the five hosts built by hand,
    the fast host at its head and the others by speed, prices 23.3 s; the search's plan was 58.2 s
    (the slow host at the head) and now beats the hand-built one."""
    from torchpp.planner.synthetic import qwen_like

    files, bw, mem = qwen_like(random.Random(0.5406858855321425), 5, 17)
    pb = problem(files, bw, mem, 4, schedule="auto")
    idx = {h: i for i, h in enumerate(pb.hosts)}
    by_hand = ChunkLayout(kind="zbv", v=2, b=1, groups=tuple((idx[h],) for h in ("cpu4", "cpu0", "cpu1", "cpu2", "cpu3")),
                          bounds=(0, 1, 4, 6, 8, 10, 11, 12, 13, 16, 17))
    plan = build_chunk_plan(pb, Tables(pb), by_hand)
    hand, _ = price(plan, pb.profiles, pb.links)
    assert hand == pytest.approx(23.32, abs=0.01)
    res = search(pb)
    assert res.plan.schedule in ("v", "zbv") and res.step_time_s <= hand
    assert res.plan.stages[0].devices[0].host == "cpu4"


def _eight_hosts() -> Problem:
    """The certificate benchmark's random 8-host cluster 3: 37 qwen-like layers, G = 8."""
    from torchpp.planner.synthetic import qwen_like

    files, bw, mem = qwen_like(random.Random(0.8403481205226678), 8, 37)
    return problem(files, bw, mem, 8, schedule="auto")


def test_a_layout_priced_before_its_memory_is_never_above_its_price():
    """The chunked local search rejects a layout on its replay without recomputation before working
    out its memory: that replay must be a bound on the layout's price (recomputation only adds).
    Around the planner's former V on 8 hosts, 13 of the 74 neighbours that fit recompute."""
    from torchpp.planner.chunks import neighbours, price_layout

    pb = _eight_hosts()
    t = Tables(pb)
    lay = ChunkLayout(kind="zbv", v=2, b=1, groups=((2,), (4,), (5,), (1,), (0,), (7,), (6,), (3,)),
                      bounds=(0, 1, 2, 3, 4, 5, 6, 7, 10, 12, 15, 21, 24, 27, 31, 36, 37))
    recomputing = 0
    for nb in [lay] + neighbours(lay, ["zbv", "v"]):
        full, early = price_layout(pb, t, nb), price_layout(pb, t, nb, above=0.0)
        if full is None:
            continue
        assert early[1] is None and early[0] <= full[0]
        assert price_layout(pb, t, nb, above=full[0] * 1.001) == full  # a plan that may beat it: fully priced
        recomputing += any(any(s.recompute) for s in full[1].stages)
    assert recomputing >= 10


def test_the_chunked_local_search_goes_past_its_first_step_on_eight_hosts():
    """On 8 hosts a V has ~75 neighbours: a steepest descent pricing 8 of them stopped the search
    at 31.31 s on this cluster; taking first improvements, 32 layouts each, finds 29.66 s."""
    res = search(_eight_hosts())
    assert res.plan.schedule in ("v", "zbv") and res.step_time_s < 30.0


def test_the_search_is_the_same_in_every_process():
    """The chunked local search shuffles its neighbours (a fixed seed): the plan must not depend on
    the process's string hashing, which orders sets and dicts of names."""
    import json
    import os
    import subprocess
    import sys

    code = ("import json, random; from dataclasses import asdict; "
            "from torchpp.cost import Links, MemoryEstimator, Profiles; from torchpp.planner.types import Problem; "
            "from torchpp.planner.search import search; from torchpp.planner.synthetic import qwen_like; "
            "f, bw, mem = qwen_like(random.Random(0.8403481205226678), 8, 37); "
            "pb = Problem(profiles=Profiles.from_layers(f), links=Links(bw), hosts=[x.host for x in f], budget=mem, "
            "memory=MemoryEstimator.analytic(), global_batch=8, schedule='auto'); r = search(pb); "
            "print(json.dumps([r.step_time_s, [asdict(s) for s in r.plan.stages]]))")
    outs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300,
                           env={**os.environ, "PYTHONHASHSEED": seed}).stdout for seed in ("1", "2")]
    assert json.loads(outs[0]) == json.loads(outs[1])


def test_plan_compare_with_a_plan_file_prices_it_the_same_way(tmp_path):
    pb = seed000_problem()
    theirs = seed000_plan(pb.profiles.model)
    theirs.save(tmp_path / "seed000.json")
    costs = api.Costs(profiles=pb.profiles, links=pb.links, hosts=pb.hosts, budget=pb.budget, memory=pb.memory)
    res = api.plan(costs, api.PlanOptions(global_batch=20, micro_batch_sizes=[4],
                                          compare=[str(tmp_path / "seed000.json")]))
    row = res.compare[1]
    assert row["step_time_s"] == pytest.approx(price(theirs, pb.profiles, pb.links)[0])
    assert row["ratio"] >= 2.0
    assert res.meta["chosen_schedule"] == res.plan.schedule
    assert set(res.meta["search"]["best_per_schedule"]) <= set(KINDS)


def test_schedule_kinds_parse_and_reject():
    assert schedule_kinds("auto") == list(KINDS)
    assert schedule_kinds("v, 1f1b") == ["v", "1f1b"]
    with pytest.raises(ValueError, match="schedule"):
        schedule_kinds("zb")
    with pytest.raises(ValueError, match="schedule"):
        api.PlanOptions(schedule="1f1b,dualpipe")


def test_one_kind_searches_only_that_kind():
    files, bw, mem = random_instance(random.Random(21), hosts=3, layers=5, batch=2)
    for kind in ("interleaved", "zbv", "zb-h1"):
        res = search(problem(files, bw, mem, 4, schedule=kind))
        assert res.plan.schedule == kind and set(res.kinds) == {kind}


def test_lower_bound_is_work_over_capacity_without_memory_limits_and_below_every_plan():
    files = [layers_file(h, num_layers=6, speed=s, batch=4) for h, s in (("a", 1.0), ("b", 3.0))]
    pb = problem(files, uniform_links(["a", "b"], 1e12), {"a": 1e12, "b": 1e12}, 8, schedule="auto")
    prof = pb.profiles
    per = {h: float(sum(prof.table(h)[0]) + sum(prof.table(h)[1])) for h in pb.hosts}
    assert lower_bound(prof, pb.hosts, pb.budget, pb.memory, 8) == pytest.approx(8 / sum(1 / x for x in per.values()))
    for seed in (1, 2):
        files, bw, mem = random_instance(random.Random(seed), hosts=3, layers=5, batch=2)
        pb = problem(files, bw, mem, 4, schedule="auto")
        assert lower_bound(pb.profiles, pb.hosts, pb.budget, pb.memory, 4) <= search(pb).step_time_s * (1 + 1e-9)


def test_lower_bound_counts_every_weight_update_once_and_stays_below_plans_priced_with_the_optimizer():
    """Identical devices without memory limits: (G · τ + o · P) / D, the forward, backward and one
    optimizer update of every parameter spread evenly; with a rate the bound still lies below the
    replayed step of the searched plan and of every single-device plan."""
    files = [layers_file(h, num_layers=6, speed=1.0, batch=4) for h in ("a", "b", "c")]
    pb = problem(files, uniform_links(["a", "b", "c"], 1e12), {h: 1e12 for h in "abc"}, 8, schedule="auto")
    prof, rate = pb.profiles, 2e-9
    tau = float(sum(prof.table("a")[0]) + sum(prof.table("a")[1]))
    P = float(sum(prof.param_bytes))
    assert lower_bound(prof, pb.hosts, pb.budget, pb.memory, 8, {h: rate for h in "abc"}) == pytest.approx(
        (8 * tau + rate * P) / 3, rel=1e-6)
    for seed in (3, 4):
        files, bw, mem = random_instance(random.Random(seed), hosts=3, layers=5, batch=2)
        pb = replace(problem(files, bw, mem, 4, schedule="auto"), optimizer_s_per_byte=1e-8)
        lb = lower_bound(pb.profiles, pb.hosts, pb.budget, pb.memory, 4, 1e-8)
        assert lb > lower_bound(pb.profiles, pb.hosts, pb.budget, pb.memory, 4)
        assert lb <= search(pb).step_time_s * (1 + 1e-9)


def test_one_device_is_never_given_several_chunks():
    """Chunks of one device run one after another: the one-chunk plan's work plus a call and a held
    activation set per chunk, so the search never offers it (a demo run once chose 4 chunks on pi3)."""
    files, bw, mem = random_instance(random.Random(5), hosts=1, layers=4, batch=2)
    res = search(problem(files, bw, mem, 4, schedule="auto"))
    assert all(len(res.plan.stages_of_rank(r)) == 1 for r in res.plan.ranks), res.plan.schedule
    assert all(chunk_counts(kind, 1, 8) == [] for kind in MULTI_CHUNK)
