"""Hosts whose sends share one uplink and whose receives share one downlink (bandwidth.json's
``egress_bytes_per_sec`` / ``ingress_bytes_per_sec``): the interface queues of the one cost model
and the simulator's links, against closed forms and against independent links."""
from __future__ import annotations

import json
import re

import pytest

from torchpp.cluster.probe import NicResult, PairResult, fan_size, shared_nics
from torchpp.cost import Links, MeasuredCost, Profiles
from torchpp.formats import Bandwidth, FormatError
from torchpp.planner.simple import make_plan
from torchpp.planner.synthetic import layers_file, uniform_links
from torchpp.schedules import Kind, build
from torchpp.sim.links import through_nics
from torchpp.sim.measured import price, price_step

PIS = ["pi0", "pi1", "pi2"]
RATE = 1.2e6
ACT = 2 * 64 * 256 * 4
"""One micro-batch of 2 x 64 tokens of hidden 256, fp32: 131 kB, 0.11 s at RATE."""


def _links(egress: float | None, ingress: float | None, burst: float = 0.0) -> Links:
    bw = uniform_links(PIS, RATE)
    if egress is not None:
        bw.egress_bytes_per_sec = {h: egress for h in PIS}
    if ingress is not None:
        bw.ingress_bytes_per_sec = {h: ingress for h in PIS}
    bw.burst_bytes = {k: burst for k in bw.bytes_per_sec} if burst else {}
    return Links(bw)


def _pipeline(microbatches: int = 6, fwd: float = 0.02):
    """Three hosts, one layer each, 1F1B: the middle stage sends a gradient back and an activation
    on in every steady-state step."""
    files = [layers_file(h, num_layers=3, batch=2, seq_len=64, layer_fwd_s=fwd, layer_bwd_s=2 * fwd,
                         embed_fwd_s=0.001, tail_fwd_s=0.005, act_bytes_per_sample=64 * 256 * 4, hidden_size=256,
                         vocab_size=4096, embed_param_bytes=4096 * 256 * 4, tail_param_bytes=4096 * 256 * 4 + 1024,
                         tied=False)
             for h in PIS]
    plan = make_plan(files[0].model, seq_len=64, global_batch=2 * microbatches, num_microbatches=microbatches,
                     layer_ranges=[(0, 1), (1, 2), (2, 3)], group_sizes=[1, 1, 1], schedule="1f1b", hosts=PIS)
    return plan, Profiles.from_layers(files)


def _wire(tl, rank: int, kinds: tuple[Kind, ...]) -> list[tuple[float, float]]:
    """(start, arrival) on the wire of the rank's sends of ``kinds``, in time order."""
    return sorted((s.start, s.ready) for s in tl.spans[rank] if s.action.kind in kinds)


def test_an_interface_queues_what_it_carries_at_its_rate():
    d = 1.0
    for x, want in ((d, [1.0, 2.0]), (d / 2, [1.0, 1.0]), (0.0, [1.0, 1.0])):
        free = [0.0, 0.0]
        got = [through_nics(free, 0.0, d, d, 0.0, (0, x, 1, 0.0))[1] for _ in range(2)]
        assert got == pytest.approx(want), x
    # a receiver's downlink: two senders at once, one link's rate each
    free = [0.0, 0.0, 0.0]
    assert [through_nics(free, 0.0, d, d, 0.0, (u, 0.0, 2, d))[1] for u in (0, 1)] == pytest.approx([1.0, 2.0])
    # a rested interface passes the link's burst; a busy one does not
    free = [0.0, 0.0]
    assert through_nics(free, 0.0, 0.75, d, 0.25, (0, d, 1, 0.0)) == pytest.approx((0.0, 0.75))
    assert through_nics(free, 0.0, 0.75, d, 0.25, (0, d, 1, 0.0)) == pytest.approx((0.75, 1.75))


def test_a_shared_uplink_sends_one_message_at_a_time():
    """On independent links the middle rank's gradient and activation cross together; with one
    interface each way, no two of its sends (and no two messages to it) are on the wire at once,
    and the step is longer."""
    plan, prof = _pipeline()
    free, tl_free = price(plan, prof, _links(None, None))
    shared, tl = price(plan, prof, _links(RATE, RATE))
    sends = (Kind.SEND_ACT, Kind.SEND_GRAD)

    def overlaps(spans):
        return sum(b0 < a1 - 1e-12 for (_, a1), (b0, _) in zip(spans, spans[1:]))

    assert overlaps(_wire(tl_free, 1, sends)) > 0
    assert overlaps(_wire(tl, 1, sends)) == 0
    into_middle = sorted(_wire(tl, 0, (Kind.SEND_ACT,)) + _wire(tl, 2, (Kind.SEND_GRAD,)))
    assert overlaps(into_middle) == 0
    assert shared > free
    assert price_step(plan, prof, _links(RATE, RATE)) == pytest.approx(shared, rel=1e-12)


def test_interfaces_as_fast_as_all_links_together_change_nothing():
    plan, prof = _pipeline()
    free, _ = price(plan, prof, _links(None, None))
    wide, _ = price(plan, prof, _links(1e15, 1e15))
    assert wide == pytest.approx(free, rel=1e-9)


def test_a_middle_stage_of_one_interface_is_priced_by_its_bytes():
    """Slow links, instant compute, 1F1B: every message the middle host sends or receives takes
    its interface one message time d, so its 4m messages, 2m each way, bound the step from below
    by 2m·d; independent links let the step go under it."""
    m = 6
    plan, prof = _pipeline(m, fwd=1e-6)
    d = ACT / RATE
    shared, _ = price(plan, prof, _links(RATE, RATE))
    free, _ = price(plan, prof, _links(None, None))
    assert shared >= 2 * m * d
    assert free < 2 * m * d


def test_a_wire_format_shrinks_what_the_interfaces_carry():
    plan, prof = _pipeline()
    links = _links(RATE, RATE)
    send = next(a for a in build(plan)[1] if a.kind == Kind.SEND_ACT)
    fp32 = MeasuredCost(plan, prof, links).nic_s(1, 2, send)
    for s in plan.stages[:-1]:
        s.wire = "bf16"
    bf16 = MeasuredCost(plan, prof, links).nic_s(1, 2, send)
    assert fp32 == pytest.approx(("pi1", ACT / RATE, "pi2", ACT / RATE))
    assert bf16[1] == pytest.approx(fp32[1] / 2) and bf16[3] == pytest.approx(fp32[3] / 2)
    assert MeasuredCost(plan, prof, _links(None, None)).nic_s is None


def test_interface_rates_round_trip_and_are_checked(tmp_path):
    bw = _links(RATE, 2 * RATE).bw
    bw.save(tmp_path / "b.json")
    assert Bandwidth.load(tmp_path / "b.json") == bw
    uniform_links(PIS, RATE).save(tmp_path / "plain.json")
    assert "egress_bytes_per_sec" not in json.loads((tmp_path / "plain.json").read_text())
    for field, value in (("egress_bytes_per_sec", {"pi0": 0}), ("ingress_bytes_per_sec", {"pi 0": 1.0}),
                         ("egress_bytes_per_sec", [1.0])):
        d = bw.to_json()
        d[field] = value
        (tmp_path / "bad.json").write_text(json.dumps(d))
        with pytest.raises(FormatError, match=re.escape(field)):
            Bandwidth.load(tmp_path / "bad.json")


def test_fan_messages_outlast_a_burst_and_stay_short_on_fast_links():
    assert fan_size(1.2e6, 0.25) == 300_000
    assert fan_size(2.4e6, 0.25) == 600_000
    assert fan_size(1e3, 0.25) == 64 << 10
    assert fan_size(1.25e10, 0.25) == 16 << 20
    assert fan_size(1.2e6 + 1, 0.25) % 4 == 0


def test_only_interfaces_slower_than_their_links_together_are_written():
    pairs = [PairResult(a, b, RATE, 0.0, []) for a in PIS for b in PIS if a != b]
    nics = [NicResult("pi0", 1.02 * RATE, 1.8 * RATE), NicResult("pi1", 2 * RATE, 2 * RATE),
            NicResult("pi2", 1.5 * RATE, 0.9 * RATE)]
    egress, ingress = shared_nics(pairs, nics)
    assert egress == {"pi0": 1.02 * RATE, "pi2": 1.5 * RATE}
    assert ingress == {"pi2": 0.9 * RATE}


def test_a_search_rejects_on_independent_links_first_and_finds_the_same_plan():
    """Interfaces only delay transfers: the independent links' step bounds the plan's from below,
    and a neighbour rejected on it would be rejected anyway, so the search ends where it would."""
    import dataclasses

    from torchpp.cost import MemoryEstimator
    from torchpp.planner import chunks
    from torchpp.planner.pricing import price_plan
    from torchpp.planner.search import search
    from torchpp.planner.synthetic import seed000_8host_instance
    from torchpp.planner.types import Problem

    files, bw, mem, _ = seed000_8host_instance()
    hosts = [f.host for f in files]
    shared = dataclasses.replace(bw, egress_bytes_per_sec={h: max(bw.rate(h, o) for o in hosts if o != h) for h in hosts},
                                 ingress_bytes_per_sec={h: max(bw.rate(o, h) for o in hosts if o != h) for h in hosts})

    def problem(b):
        return Problem(profiles=Profiles.from_layers(files), links=Links(b), hosts=hosts, budget=mem,
                       memory=MemoryEstimator.analytic(), global_batch=32, schedule="auto")

    pb = problem(shared)
    first = search(pb)
    plan = first.plan
    full = price_plan(pb, plan, keep=False)
    floor = price_plan(pb, plan, keep=False, above=0.0)
    assert floor == pytest.approx(price_plan(problem(bw), plan, keep=False), rel=1e-12)
    assert floor < full
    assert price_plan(pb, plan, keep=False, above=full * 2) == full

    orig = chunks.price_plan
    try:
        chunks.price_plan = lambda pb, plan, keep=True, above=None: orig(pb, plan, keep)
        res = search(problem(shared))
    finally:
        chunks.price_plan = orig
    assert (res.step_time_s, res.plan.to_json()) == (first.step_time_s, plan.to_json())


def test_a_replan_leaves_out_messages_that_shared_an_interface():
    """The middle host's gradient back and activation on left through its one uplink together, each
    at half its link's rate; fitted as they are they read the link at half its rate. Where the probe
    found the interface shared, those messages are left out and the link reads its rate."""
    from torchpp.planner.replan.fit import fit_links
    from torchpp.planner.replan.read import Measurements, Transfer

    lf = layers_file("pi0", num_layers=3, batch=1)
    plan = make_plan(lf.model, seq_len=16, global_batch=3, num_microbatches=3, layer_ranges=[(0, 1), (1, 2), (2, 3)],
                     group_sizes=[1, 1, 1], hosts=PIS)
    n, d = 1_000_000, 1_000_000 / RATE
    m = Measurements()
    m.transfers = [Transfer(1, 0, n, d, start_s=0.0, end_s=d), Transfer(1, 2, n, d, start_s=5.0, end_s=5.0 + d),
                   Transfer(1, 0, n, 2 * d, start_s=10.0, end_s=10.0 + 2 * d),  # these two together
                   Transfer(1, 2, n, 2 * d, start_s=10.0, end_s=10.0 + 2 * d)]
    alone = {(lk.src, lk.dst): lk for lk in fit_links(plan, m, uniform_links(PIS, RATE))}
    shared = {(lk.src, lk.dst): lk for lk in fit_links(plan, m, _links(RATE, None).bw)}
    assert alone[("pi1", "pi0")].bytes_per_sec < 0.8 * RATE
    assert shared[("pi1", "pi0")].bytes_per_sec == pytest.approx(RATE)
    assert shared[("pi1", "pi2")].bytes_per_sec == pytest.approx(RATE) and shared[("pi1", "pi2")].censored == 1
