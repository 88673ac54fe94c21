"""The gap to the lower bound: a plan's predicted step split into the bound and what each thing
the bound leaves out adds, checked against closed forms."""
import math
import random

import pytest

from torchpp.cost import FreeLinks, Links, MemoryEstimator, Profiles
from torchpp.planner.bound import lower_bound
from torchpp.planner.gap import Gap, gap_to_bound
from torchpp.planner.simple import make_plan
from torchpp.planner.synthetic import layers_file, random_instance, uniform_links
from torchpp.sim.measured import price


def plan_for(lf, ranges, hosts, gb, m, schedule="1f1b"):
    return make_plan(lf.model, seq_len=lf.run.seq_len, global_batch=gb, num_microbatches=m, layer_ranges=ranges,
                     group_sizes=[1] * len(ranges), hosts=hosts, schedule=schedule)


def bound(prof, hosts, gb):
    return lower_bound(prof, hosts, {h: math.inf for h in hosts}, MemoryEstimator.analytic(), gb)


def parts_sum(g: Gap) -> float:
    return g.bound_s + sum(g.part_s(p) for p in Gap.PARTS)


def test_balanced_pipeline_gap_is_its_fill_and_drain():
    """p identical one-layer stages, m micro-batches, no per-call cost, free links: the step is
    (m + p - 1)(F + B), the bound m(F + B), so the whole gap is fill/drain, (p - 1)(F + B)."""
    p, m = 3, 5
    files = [layers_file(h, num_layers=p, batch=1, layer_fwd_s=1.0, embed_fwd_s=1e-9, tail_fwd_s=1e-9) for h in "abc"]
    plan = plan_for(files[0], [(i, i + 1) for i in range(p)], list("abc"), gb=m, m=m)
    prof = Profiles.from_layers(files)
    g = gap_to_bound(plan, prof, Links(uniform_links(list("abc"), 1e30)), bound(prof, list("abc"), m))
    assert g.step_s == pytest.approx((m + p - 1) * 3.0, rel=1e-6)
    assert g.bound_s == pytest.approx(m * 3.0, rel=1e-6)
    assert g.fill_drain_s == pytest.approx((p - 1) * 3.0, rel=1e-6)
    assert g.placement_s == pytest.approx(0.0, abs=1e-6)
    assert g.per_call_s == pytest.approx(0.0, abs=1e-9) and g.recompute_s == 0.0
    assert g.communication_s == pytest.approx(0.0, abs=1e-6)
    assert g.largest() == "fill_drain"


def test_one_device_gap_is_its_per_call_cost():
    """One host, m calls of n samples, half of each block's time paid per call: the bound is the
    per-sample work, and the step exceeds it by m calls' fixed seconds, nothing else."""
    m, n = 4, 2
    lf = layers_file("a", num_layers=2, batch=4, layer_fwd_s=1.0, embed_fwd_s=0.4, tail_fwd_s=0.8, fixed_fraction=0.5)
    prof = Profiles.from_layers([lf])
    plan = plan_for(lf, [(0, 2)], ["a"], gb=m * n, m=m)
    g = gap_to_bound(plan, prof, Links(uniform_links(["a"])), bound(prof, ["a"], m * n))
    fwd, bwd = 0.4 + 1 + 1 + 0.8, 2 * (0.4 + 1 + 1 + 0.8)   # per call of 4 samples; half fixed
    assert g.step_s == pytest.approx(m * (fwd + bwd) * (0.5 + 0.5 * n / 4))
    assert g.bound_s == pytest.approx(m * n * (fwd + bwd) * 0.5 / 4)
    assert g.per_call_s == pytest.approx(m * (fwd + bwd) * 0.5)
    assert g.fill_drain_s == pytest.approx(0.0, abs=1e-9) and g.placement_s == pytest.approx(0.0, abs=1e-9)
    assert g.communication_s == 0.0
    assert g.runtime_call_s == pytest.approx(0.0, abs=1e-9)  # the file measured no runtime cost per call


def test_runtime_calls_are_said_apart_from_the_blocks_fixed_seconds():
    """The same host with the runtime's own cost per call (the call probe's): two calls per
    micro-batch (forward, backward) add 2 m c to the step, said as the runtime's part; the blocks'
    fixed seconds stay in per-call. A plan priced before the split (no runtime part) still reads."""
    m, n, c = 4, 2, 0.05
    lf = layers_file("a", num_layers=2, batch=4, layer_fwd_s=1.0, embed_fwd_s=0.4, tail_fwd_s=0.8, fixed_fraction=0.5)
    lf.call_overhead_s = c
    prof = Profiles.from_layers([lf])
    plan = plan_for(lf, [(0, 2)], ["a"], gb=m * n, m=m)
    g = gap_to_bound(plan, prof, Links(uniform_links(["a"])), bound(prof, ["a"], m * n))
    fwd, bwd = 0.4 + 1 + 1 + 0.8, 2 * (0.4 + 1 + 1 + 0.8)
    assert g.per_call_s == pytest.approx(m * (fwd + bwd) * 0.5)
    assert g.runtime_call_s == pytest.approx(2 * m * c)
    assert parts_sum(g) == pytest.approx(g.step_s)
    assert f"{2 * m * c:.3g} runtime per call" in g.line()
    old = Gap(**{k: v for k, v in g.as_dict().items() if k != "runtime_call_s"})
    assert "runtime" not in old.line() and old.largest() == "per_call"


def test_uneven_hosts_gap_shows_placement_and_slow_links_show_communication():
    """A fast and a slow host given equal halves: the slow one's surplus is placement; slow
    links add communication; the parts always add up to the replayed step."""
    files = [layers_file(h, num_layers=4, speed=s, batch=1, embed_fwd_s=1e-9, tail_fwd_s=1e-9)
             for h, s in (("a", 1.0), ("b", 3.0))]
    prof = Profiles.from_layers(files)
    plan = plan_for(files[0], [(0, 2), (2, 4)], ["a", "b"], gb=4, m=4)
    slow = Links(uniform_links(["a", "b"], 1e3, latency_s=0.05))
    g = gap_to_bound(plan, prof, slow, bound(prof, ["a", "b"], 4))
    # each host has 2 layers x 4 samples x (1 + 2) s / speed; the bound spreads 4 layers' work by speed
    assert g.bound_s == pytest.approx(4 * 4 * 3.0 / (1 + 3))
    assert g.placement_s == pytest.approx(4 * 2 * 3.0 - g.bound_s)
    assert g.communication_s == pytest.approx(g.step_s - price(plan, prof, FreeLinks())[0])
    assert g.communication_s > 0.1
    assert parts_sum(g) == pytest.approx(g.step_s)


def test_parts_add_up_on_random_instances_with_recompute_and_zero_bubble():
    recomputed = []
    for seed in range(4):
        files, bw, _ = random_instance(random.Random(seed), hosts=3, layers=6, batch=2)
        prof = Profiles.from_layers(files)
        hosts = [f.host for f in files]
        for schedule in ("1f1b", "zb-h1", "gpipe"):
            plan = plan_for(files[0], [(0, 2), (2, 4), (4, 6)], hosts, gb=8, m=4, schedule=schedule)
            plan.stages[1].recompute = [True, False]
            g = gap_to_bound(plan, prof, Links(bw), bound(prof, hosts, 8))
            assert parts_sum(g) == pytest.approx(g.step_s)
            assert g.step_s == pytest.approx(price(plan, prof, Links(bw))[0])
            assert g.per_call_s >= -1e-9 and g.fill_drain_s >= -1e-9 and g.placement_s >= -1e-9
            assert g.recompute_s >= 0.0
            assert g.line().startswith(f"{g.step_s:.4g} s = {g.bound_s:.4g} bound + ")
            recomputed.append(g.recompute_s)
    assert any(r > 0 for r in recomputed)  # where the recomputing stage is the busiest, its recompute shows
