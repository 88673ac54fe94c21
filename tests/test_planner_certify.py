"""The certificate (planner/certify.py): its bound is never above the priced step of any plan of
the space, checked against brute force (every plan of every kind of small instances, priced by the
planner's own replay), and `plan --certify` reports it."""
from __future__ import annotations

import itertools
import json
import random
from dataclasses import replace

import numpy as np
import pytest

from torchpp.cost import Links, MemoryEstimator, Profiles
from torchpp.formats import MULTI_CHUNK, ONE_CHUNK
from torchpp.planner import api
from torchpp.planner.build import build_plan
from torchpp.planner.certify import certify, space_bound
from torchpp.planner.chunks import ChunkLayout, build_chunk_plan, chunk_counts, group_sequences
from torchpp.planner.search import search
from torchpp.planner.synthetic import random_instance, seed000_8host_instance
from torchpp.planner.tables import Tables
from torchpp.planner.types import InfeasibleError, Problem, StageChoice
from torchpp.schedules import ScheduleError
from torchpp.sim.measured import price

def every_plan(pb: Problem) -> dict[str, float]:
    """The least priced step of each kind over every micro-batch size, sequence of device groups and
    layer cut (Algorithm 1 shares and the recompute MILP per plan, as the planner builds them)."""
    best: dict[str, float] = {}
    for kind, _b, _groups, _v, _cuts, step in _order_cases(pb):
        best[kind] = min(best.get(kind, float("inf")), step)
    return best


def small_instances(count: int, seed: int):
    rng = random.Random(seed)
    while count:
        N, L = rng.randint(2, 3), rng.randint(3, 5)
        if count == 1:
            N, L = 4, 3
        files, bw, mem = random_instance(rng, hosts=N, layers=L, batch=2)
        pb = Problem(profiles=Profiles.from_layers(files), links=Links(bw), hosts=[f.host for f in files], budget=mem,
                     memory=MemoryEstimator.analytic(), global_batch=rng.choice([2, 4]), schedule="auto")
        try:
            res = search(pb)
        except InfeasibleError:
            continue
        count -= 1
        yield pb, res


@pytest.mark.parametrize("seed", [1, 2])
def test_bound_is_below_every_plan_of_the_space(seed):
    """bound <= the best of every plan of every kind (brute force) <= the planner's plan, and each
    family's bound <= the best plan of its kinds."""
    for pb, res in small_instances(4, seed):
        bound, families = space_bound(pb)
        best = every_plan(pb)
        floor = min(best.values())
        assert bound <= floor * (1 + 1e-9) <= res.step_time_s * (1 + 1e-9), (bound, floor, res.step_time_s)
        for fam in families:  # named by their kinds: "1f1b/gpipe", "zb-h1", ...
            got = [best[k] for k in fam.split("/") if k in best]
            if got:
                assert families[fam] <= min(got) * (1 + 1e-9), (fam, families[fam], min(got))
        # one kind asked: its own space, its own bound
        pb1 = replace(pb, schedule="1f1b")
        assert space_bound(pb1)[0] <= best["1f1b"] * (1 + 1e-9)
        assert space_bound(pb1)[0] >= bound * (1 - 1e-9)


@pytest.mark.parametrize("seed", [3, 4])
def test_on_small_clusters_the_bound_is_the_optimum_of_the_space(seed):
    """Up to 5 devices every family is enumerated exactly (planner/exact.py, planner/exactchunks.py):
    the certificate's bound is the least priced step of every plan of every kind (brute force), so
    a plan the search found at the optimum is certified within 0%."""
    for pb, res in small_instances(3, seed):
        cert = certify(pb, res.step_time_s)
        floor = min(every_plan(pb).values())
        assert "enumerated exactly" in cert.method
        assert cert.bound_s == pytest.approx(floor, rel=1e-9), (cert.bound_s, floor, res.step_time_s)


def test_plan_certify_takes_a_faster_plan_the_enumeration_found(monkeypatch):
    """A 4-host Qwen-like cluster whose best plan is a ZBV headed by a group of three devices (88.9 s):
    the search's V seeds never put a group at a V's head, and without its own enumeration (as past
    its budget) it chose 1F1B at 105.2 s; `plan --certify` enumerates every family, finds the ZBV and
    returns it, certified the best of the space. With its enumeration the search finds it itself."""
    from torchpp.planner import kinds
    from torchpp.planner.synthetic import qwen_like

    files, bw, mem = qwen_like(random.Random(0.8584684590486795), 4, 5)
    pb = Problem(profiles=Profiles.from_layers(files), links=Links(bw), hosts=[f.host for f in files], budget=mem,
                 memory=MemoryEstimator.analytic(), global_batch=16, schedule="auto")
    found = search(pb)
    assert found.plan.schedule == "zbv" and found.step_time_s == pytest.approx(88.896, abs=0.01)
    monkeypatch.setattr(kinds, "EXACT_DEVICES", 0)
    costs = api.Costs(profiles=Profiles.from_layers(files), links=Links(bw), hosts=[f.host for f in files],
                      budget=mem, memory=MemoryEstimator.analytic())
    plain = api.plan(costs, api.PlanOptions(global_batch=16))
    said: list[str] = []
    res = api.plan(costs, api.PlanOptions(global_batch=16, certify=True), progress=said.append)
    cert = res.meta["certificate"]
    assert res.plan.predicted["step_time_s"] < 0.9 * plain.plan.predicted["step_time_s"]
    assert res.plan.schedule == "zbv" and cert["step_s"] == pytest.approx(res.plan.predicted["step_time_s"])
    assert cert["searched_step_s"] == pytest.approx(plain.plan.predicted["step_time_s"])
    assert cert["gap"] == 0 and any("a faster plan found while certifying" in s for s in said)


def test_certificate_of_seed000_eight_hosts():
    """Seed 000's 8 hosts under 1F1B at 8 micro-batches of 4 (the whole space, every kind and size, is
    `bench_planner.py --certify`'s: about a minute of CPU): a bound below the plan is proven."""
    files, bw, mem, memory = seed000_8host_instance()
    pb = Problem(profiles=Profiles.from_layers(files), links=Links(bw), hosts=list(mem), budget=mem, memory=memory,
                 global_batch=32, micro_batch_sizes=[4], schedule="1f1b")
    res = search(pb)
    cert = certify(pb, res.step_time_s)
    assert 0 < cert.bound_s <= res.step_time_s
    assert cert.gap == pytest.approx(res.step_time_s / cert.bound_s - 1)
    assert "of optimal in this space" in cert.line()


def test_plan_certify_writes_the_certificate(tmp_path):
    rng = random.Random(3)
    files, bw, mem = random_instance(rng, hosts=3, layers=4, batch=2)
    costs = api.Costs(profiles=Profiles.from_layers(files), links=Links(bw), hosts=[f.host for f in files],
                      budget={h: 10 * m for h, m in mem.items()}, memory=MemoryEstimator.analytic())
    said: list[str] = []
    res = api.plan(costs, api.PlanOptions(global_batch=4, certify=True), progress=said.append)
    cert = res.meta["certificate"]
    assert cert["bound_s"] <= cert["step_s"] == pytest.approx(res.plan.predicted["step_time_s"])
    assert any("of optimal in this space" in s for s in said)
    api.write(res, tmp_path)
    assert json.loads((tmp_path / "plan_meta.json").read_text())["certificate"]["method"]
    plain = api.plan(costs, api.PlanOptions(global_batch=4))
    assert "certificate" not in plain.meta


def _order_cases(pb: Problem):
    """Every plan of every kind of ``pb`` (as :func:`every_plan`) with its priced step, kind, micro-batch
    size, groups and layer cuts."""
    t = Tables(pb)
    N, L = len(pb.hosts), t.L
    for b in [x for x in range(1, pb.global_batch + 1) if pb.global_batch % x == 0]:
        for groups in group_sequences(N, b):
            S = len(groups)
            order = [d for g in groups for d in g]
            spans = list(itertools.accumulate([0] + [len(g) for g in groups]))
            for kind in ONE_CHUNK:
                for cuts in itertools.combinations(range(1, L), S - 1):
                    bd = (0, *cuts, L)
                    stages = [StageChoice(cut=(bd[i], bd[i + 1]), hosts=(spans[i], spans[i + 1]), recompute_all=False,
                                          cost=0.0) for i in range(S)]
                    try:
                        plan = build_plan(replace(pb, schedule=kind), t, order, stages, b, "brute")
                        step = price(plan, pb.profiles, pb.links)[0] if plan is not None else None
                    except (ValueError, ScheduleError):
                        continue
                    if step is not None:
                        yield kind, b, groups, 1, bd, step
            for kind in MULTI_CHUNK:
                for v in chunk_counts(kind, S, L):
                    for cuts in itertools.combinations(range(1, L), S * v - 1):
                        bd = (0, *cuts, L)
                        plan = build_chunk_plan(pb, t, ChunkLayout(kind=kind, v=v, b=b, groups=groups, bounds=bd))
                        if plan is None:
                            continue
                        try:
                            step = price(plan, pb.profiles, pb.links)[0]
                        except (ValueError, ScheduleError):
                            continue
                        yield kind, b, groups, v, bd, step


@pytest.mark.parametrize("seed", [1, 2, 4])
def test_order_bound_is_below_every_plan(seed):
    """The order's bound on one position (its fill, its steps between, its drain: planner/orderbound.py;
    a group's devices on their shares of the samples) is at most the priced step of every plan of every
    kind, at every position of the plan: brute force over small instances, plan by plan."""
    from torchpp.formats import placement_of
    from torchpp.planner.certify import _Family
    from torchpp.schedules import REGISTRY

    checked = 0
    for pb, _ in small_instances(3, seed):
        t = Tables(pb)
        fams: dict = {}
        for kind, b, groups, v, bd, step in _order_cases(pb):
            spec = REGISTRY[kind]
            key = (kind, b)
            if key not in fams:
                fams[key] = _Family(pb, t, [kind], b, spec.placement)
            fam = fams[key]
            S = len(groups)
            pl = placement_of(kind, S * v, v) if spec.placement != "single" else None
            # without a group every other position runs b samples, whatever the depth
            for fam.one_sample in {True, not all(len(g) == 1 for g in groups)}:
                for q, g in enumerate(groups):
                    val = fam._path_value(tuple(g), kind, S, q, v)
                    if val is None:
                        continue
                    if pl is None:
                        cell = (bd[q], bd[q + 1])
                    else:
                        count = sum(bd[c + 1] - bd[c] for c in pl.chunks[q])
                        cell = (0, count) if q == 0 else (1, 1 + count)
                    assert val[cell] <= step * (1 + 1e-9), (kind, b, groups, bd, q, float(val[cell]), step)
                    checked += 1
    assert checked > 50


def test_the_tied_all_reduce_follows_the_last_stage_work():
    """Three hosts on slow links (1/100 of random_instance's), a tied embedding, ZB-H1 alone: the
    best plan all-reduces the tied weight after its last stage's work, which the bound counted
    only after the head's (9.15 s against a best plan of 15.25 s). With the last stage's work, from
    the first forward's arrival, then the all-reduce, it is within 4%, and still below every plan."""
    rng = random.Random(5)
    for _ in range(7):
        files, bw, mem = random_instance(rng, hosts=3, layers=4, batch=2, tied=True)
    bw.bytes_per_sec = {k: v * 0.01 for k, v in bw.bytes_per_sec.items()}
    pb = Problem(profiles=Profiles.from_layers(files), links=Links(bw), hosts=[f.host for f in files], budget=mem,
                 memory=MemoryEstimator.analytic(), global_batch=2, schedule="zb-h1")
    best = min(step for kind, *_, step in _order_cases(pb) if kind == "zb-h1")
    bound, _ = space_bound(pb)
    assert best == pytest.approx(15.248, abs=1e-3)
    assert best / 1.04 <= bound <= best * (1 + 1e-9), (bound, best)


def test_the_fill_before_the_last_chunk_is_capped_by_memory():
    """Five Qwen-like hosts, 17 layers (the instance of test_planner_chunks' V head seeds): the fill
    before a V head's last chunk runs every other layer's forward, each device holding no more
    layers than its memory has room for. The fastest host (cpu0) holds only a few: the rest run on
    slower ones. Each count of layers is priced greedily, cheapest device first up to its room; the
    bound rises from 15.11 s to 17.29 s and stays below the plan the search finds (21.85 s)."""
    from torchpp.planner.certify import _Family
    from torchpp.planner.synthetic import qwen_like
    from torchpp.planner.tables import Tables

    files, bw, mem = qwen_like(random.Random(0.5406858855321425), 5, 17)
    pb = Problem(profiles=Profiles.from_layers(files), links=Links(bw), hosts=[f.host for f in files], budget=mem,
                 memory=MemoryEstimator.analytic(), global_batch=4, schedule="auto")
    pb.profiles.ensure(pb.hosts)
    fam = _Family(pb, Tables(pb), ["zbv"], 1, "v")
    head = frozenset({pb.hosts.index("cpu4")})
    capped = fam._capped_forward(head)
    per = {h: float(np.min(fam.fwd_ps[pb.hosts.index(h)][1:18])) for h in ("cpu0", "cpu1")}
    room = next(k for k in range(1, 18) if capped[k] - capped[k - 1] > per["cpu0"] * 1.5) - 1
    assert 1 <= room < 17 and capped[room] == pytest.approx(room * per["cpu0"])
    assert capped[room + 1] - capped[room] == pytest.approx(min(float(np.min(fam.fwd_ps[pb.hosts.index(h)][1:18]))
                                                                for h in ("cpu1", "cpu2", "cpu3")))
    assert capped[15] > np.sort(np.minimum.reduce([fam.fwd_ps[h] for h in range(5) if h not in head])[1:18])[:15].sum()
    bound, _ = space_bound(pb)
    assert 17.2 <= bound <= search(pb).step_time_s
