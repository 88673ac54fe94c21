"""Measured costs: block tables, capacity scaling, links, ring all-reduce and plan pricing."""
import pytest

from torchpp.formats import Bandwidth, Capacities, FormatError
from torchpp.cost import Links, MeasuredCost, Profiles, stage_blocks
from torchpp.sim.measured import price
from torchpp.planner.simple import make_plan
from torchpp.planner.synthetic import layers_file, uniform_links
from torchpp.schedules import Action, Kind


def plan_for(lf, ranges, groups, hosts, gb=8, m=2, recompute=None, shares=None):
    p = make_plan(lf.model, seq_len=lf.run.seq_len, global_batch=gb, num_microbatches=m, layer_ranges=ranges,
                  group_sizes=groups, hosts=hosts, shares=shares)
    if recompute:
        for s, flags in zip(p.stages, recompute):
            s.recompute = flags
    return p


def test_stage_blocks_are_contiguous():
    assert stage_blocks((0, 2), True, False) == (0, 3)
    assert stage_blocks((2, 4), False, True) == (3, 6)
    assert stage_blocks((0, 4), True, True) == (0, 6)


def test_compute_scales_by_samples_and_includes_embed_tail_and_recompute():
    lf = layers_file("a", num_layers=4, batch=4, layer_fwd_s=[1, 2, 3, 4], embed_fwd_s=0.4, tail_fwd_s=0.8)
    lf2 = layers_file("b", num_layers=4, batch=4, layer_fwd_s=[1, 2, 3, 4], embed_fwd_s=0.4, tail_fwd_s=0.8, speed=2)
    prof = Profiles.from_layers([lf, lf2])
    plan = plan_for(lf, [(0, 2), (2, 4)], [1, 1], ["a", "b"], gb=8, m=2, recompute=[[False, True], [False, False]])
    c = MeasuredCost(plan, prof, uniform_links(["a", "b"]))
    # stage 0 on a: embed + layers 0,1 forward = 0.4 + 1 + 2 per 4 samples; 4 samples per micro-batch
    assert c.compute_s(0, Action(Kind.FORWARD, 0, 0, samples=(0, 4))) == pytest.approx(3.4)
    assert c.compute_s(0, Action(Kind.FORWARD, 0, 0, samples=(0, 2))) == pytest.approx(1.7)
    # backward = 2x forward, plus recomputed layer 1's forward (2)
    assert c.compute_s(0, Action(Kind.BACKWARD, 0, 0, samples=(0, 4))) == pytest.approx(6.8 + 2)
    # stage 1 on b (speed 2): layers 2,3 + tail = (3 + 4 + 0.8) / 2
    assert c.compute_s(1, Action(Kind.FORWARD, 1, 0, samples=(0, 4))) == pytest.approx(3.9)


def test_capacity_scales_reference_table_for_unprofiled_host():
    lf = layers_file("ref", num_layers=2, batch=2, layer_fwd_s=1.0)
    cap = Capacities(ref_host="ref", capacity={"ref": 1.0, "slow": 0.5})
    prof = Profiles.from_layers([lf], cap)
    f_ref, _ = prof.table("ref")
    f_slow, b_slow = prof.table("slow")
    assert list(f_slow) == pytest.approx(list(2 * f_ref))
    with pytest.raises(FormatError, match="capacity.nobody"):
        prof.table("nobody")


def test_own_profile_beats_scaled_reference():
    ref = layers_file("ref", num_layers=2, layer_fwd_s=1.0)
    own = layers_file("x", num_layers=2, layer_fwd_s=[5.0, 0.1])
    cap = Capacities(ref_host="ref", capacity={"ref": 1.0, "x": 0.5})
    prof = Profiles.from_layers([ref, own], cap)
    assert prof.table("x")[0][1] == pytest.approx(5.0 / 4)  # own measured layer 0, per sample


def test_transfer_is_latency_plus_bytes_over_rate():
    lf = layers_file("a", num_layers=2, act_bytes_per_sample=1000)
    bw = Bandwidth(bytes_per_sec={"a|b": 1e4, "b|a": 2e4}, latency_s={"a|b": 0.01, "b|a": 0.02})
    plan = plan_for(lf, [(0, 1), (1, 2)], [1, 1], ["a", "b"], gb=8, m=2)
    c = MeasuredCost(plan, Profiles.from_layers([lf, layers_file("b", num_layers=2, act_bytes_per_sample=1000)]), bw)
    assert c.transfer_s(0, 1, Action(Kind.SEND_ACT, 0, 0, peer=1, samples=(0, 4))) == pytest.approx(0.01 + 4000 / 1e4)
    assert c.transfer_s(1, 0, Action(Kind.SEND_GRAD, 1, 0, peer=0, samples=(0, 4))) == pytest.approx(0.02 + 4000 / 2e4)


def test_ring_allreduce_uses_slowest_link_and_tied_bytes():
    hosts = ["a", "b", "c"]
    lf = layers_file("a", num_layers=3, layer_param_bytes=[100, 200, 300], embed_param_bytes=600, tail_param_bytes=700)
    files = [lf] + [layers_file(h, num_layers=3, layer_param_bytes=[100, 200, 300], embed_param_bytes=600,
                                tail_param_bytes=700) for h in hosts[1:]]
    rates = {f"{x}|{y}": 1000.0 for x in hosts for y in hosts if x != y}
    rates["c|a"] = 100.0
    plan = plan_for(lf, [(0, 2), (2, 3)], [2, 1], hosts, gb=8, m=2)
    c = MeasuredCost(plan, Profiles.from_layers(files), Bandwidth(bytes_per_sec=rates))
    # group {a, b}: bytes of embed + layers 0,1 = 900; ring over 2: 2*(1)/2 * 900 / 1000
    assert c.allreduce_s(Action(Kind.ALLREDUCE, 0, group=(0, 1))) == pytest.approx(0.9)
    # tied group {a, b, c}: embedding bytes 600 over slowest link 100: 2*2/3 * 600/100
    assert c.allreduce_s(Action(Kind.ALLREDUCE, 0, group=(0, 1, 2), tied=True)) == pytest.approx(8.0)


def test_price_matches_closed_form_for_balanced_pipeline():
    # p identical stages of one layer each (embed and tail negligible), m micro-batches, no comm
    p, m = 3, 5
    files = [layers_file(h, num_layers=p, batch=1, layer_fwd_s=1.0, embed_fwd_s=1e-9, tail_fwd_s=1e-9)
             for h in "abc"]
    plan = plan_for(files[0], [(i, i + 1) for i in range(p)], [1] * p, list("abc"), gb=m, m=m)
    step, tl = price(plan, Profiles.from_layers(files), Bandwidth(bytes_per_sec={f"{x}|{y}": 1e30 for x in "abc"
                                                                                for y in "abc" if x != y}))
    assert step == pytest.approx((m + p - 1) * 3.0, rel=1e-6)
    assert tl.makespan == step


def test_missing_link_is_named():
    files = [layers_file(h, num_layers=2) for h in "ab"]
    plan = plan_for(files[0], [(0, 1), (1, 2)], [1, 1], ["a", "b"])
    with pytest.raises(FormatError, match=r"b\|a"):
        price(plan, Profiles.from_layers(files), Bandwidth(bytes_per_sec={"a|b": 1.0}, source="t"))
    with pytest.raises(FormatError, match=r"b\|a"):
        Links(Bandwidth(bytes_per_sec={"a|b": 1.0})).check(["a", "b"])


def test_mismatched_models_are_rejected_naming_file():
    with pytest.raises(FormatError, match="model.num_layers"):
        Profiles.from_layers([layers_file("a", num_layers=2), layers_file("b", num_layers=3)],
                             sources=["la.json", "lb.json"])


def test_per_call_time_is_paid_once_per_micro_batch():
    # 4 samples take 1 s per layer, of which 0.5 s per call: 1 sample costs 0.5 + 0.125
    lf = layers_file("a", num_layers=2, batch=4, layer_fwd_s=1.0, embed_fwd_s=0.4, tail_fwd_s=0.8, fixed_fraction=0.5)
    prof = Profiles.from_layers([lf])
    plan = plan_for(lf, [(0, 2)], [1], ["a"], gb=8, m=2)
    c = MeasuredCost(plan, prof, uniform_links(["a"]))
    total = 0.4 + 1 + 1 + 0.8
    assert c.compute_s(0, Action(Kind.FORWARD, 0, 0, samples=(0, 4))) == pytest.approx(total)
    assert c.compute_s(0, Action(Kind.FORWARD, 0, 0, samples=(0, 1))) == pytest.approx(total / 2 + total / 8)
    assert c.compute_s(0, Action(Kind.BACKWARD, 0, 0, samples=(0, 2))) == pytest.approx(2 * (total / 2 + total / 4))
    assert c.compute_s(0, Action(Kind.FORWARD, 0, 0, samples=(0, 0))) == 0.0
    # a capacity-scaled host scales the per-call part too
    cap = Capacities(ref_host="a", capacity={"a": 1.0, "half": 0.5})
    p2 = Profiles.from_layers([lf], cap)
    assert list(p2.fixed("half")[0]) == pytest.approx(list(2 * p2.fixed("a")[0]))
    # and the capacities file keeps it
    t = p2.as_host_table("a", 4)
    assert t.forward_fixed_s == pytest.approx([0.2, 0.5, 0.5, 0.4])
    assert t.forward_time_s == pytest.approx([0.4, 1.0, 1.0, 0.8])
