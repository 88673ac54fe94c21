"""Links that pass a burst at once after a rest (bandwidth.json's ``burst_bytes``): the token bucket
in the one cost model and the simulator's FIFO links, against closed forms."""
from __future__ import annotations

import json
import re

import pytest

from torchpp import schedules as S
from torchpp.cluster.probe import burst_of
from torchpp.cost import Links, MeasuredCost, Profiles, tied_rows_bytes
from torchpp.formats import Bandwidth, FormatError, ModelInfo, Sync
from torchpp.planner.simple import make_plan
from torchpp.planner.synthetic import layers_file, uniform_links
from torchpp.schedules import Action, Kind
from torchpp.sim.measured import price, price_step
from torchpp.sim.replay import replay

PIS = ["pi0", "pi1", "pi2"]
RATE, LAT = 1.19e6, 0.0005
INT8_MSG = 2 * 64 * 256 + 4 * 2 * 64
"""One micro-batch of 2 x 64 tokens of hidden 256 as int8 with a scale per token."""


def _bursty(burst: float) -> Bandwidth:
    bw = uniform_links(PIS, RATE, latency_s=LAT)
    bw.burst_bytes = {k: burst for k in bw.bytes_per_sec} if burst else {}
    return bw


def _three_stages(microbatches: int, tied: bool = False, wire: str | None = "int8"):
    files = [layers_file(h, num_layers=3, batch=2, seq_len=64, layer_fwd_s=0.01, layer_bwd_s=0.02, embed_fwd_s=0.002,
                         tail_fwd_s=0.01, act_bytes_per_sample=64 * 256 * 4, hidden_size=256, vocab_size=4096,
                         embed_param_bytes=4096 * 256 * 4, tail_param_bytes=4096 * 256 * 4 + 1024, tied=tied)
             for h in PIS]
    plan = make_plan(files[0].model, seq_len=64, global_batch=2 * microbatches, num_microbatches=microbatches,
                     layer_ranges=[(0, 1), (1, 2), (2, 3)], group_sizes=[1, 1, 1], schedule="1f1b", hosts=PIS)
    for s in plan.stages[:-1]:
        s.wire = wire
    return plan, Profiles.from_layers(files)


@pytest.mark.parametrize("burst", [0.0, 20_000.0, 64 * 1024.0])
def test_three_stage_pipeline_on_rested_duplex_links_is_the_closed_form(burst):
    """One micro-batch crosses each of the four directed links once, each rested: every transfer
    loses min(burst, its bytes) / rate, so the step is the plain one less four of them."""
    plan, prof = _three_stages(1)
    plain, _ = price(plan, prof, Links(_bursty(0.0)))
    step, tl = price(plan, prof, Links(_bursty(burst)))
    assert step == pytest.approx(plain - 4 * min(burst, INT8_MSG) / RATE, rel=1e-12)
    assert price_step(plan, prof, Links(_bursty(burst))) == pytest.approx(step, rel=1e-12)
    compute = sum(s.end - s.start for ss in tl.spans.values() for s in ss if s.action.kind in (Kind.FORWARD,
                                                                                                 Kind.BACKWARD))
    assert step == pytest.approx(compute + 4 * (LAT + (INT8_MSG - min(burst, INT8_MSG)) / RATE), rel=1e-12)


class _Uniform:
    """f, b seconds per pass, every send ``d`` seconds on its link, every link's bucket ``depth`` seconds."""

    def __init__(self, f: float, b: float, d: float, depth: float):
        self.f, self.b, self.d, self.depth = f, b, d, depth

    def compute_s(self, rank, a):
        return {Kind.FORWARD: self.f, Kind.BACKWARD: self.b, Kind.OPTIMIZER: 0.0}[a.kind]

    def transfer_s(self, src, dst, a):
        return self.d

    def allreduce_s(self, a):
        return 0.0

    def burst_s(self, src, dst, a):
        return self.depth, min(self.depth, self.d)


def test_a_busy_link_passes_only_what_its_bucket_refilled():
    """GPipe over two stages with instant forwards: three activations posted at once on one link of
    a bucket of 1.5 messages. The first passes at once, the second waits for the half message its
    bucket lacks, the third for one more message: arrivals 0, d/2, 3d/2 (a plain FIFO: d, 2d, 3d)."""
    info = ModelInfo(name="t", num_layers=2, hidden_size=8, vocab_size=32, tied_embeddings=False)
    sched = S.build(make_plan(info, seq_len=4, global_batch=3, num_microbatches=3, layer_ranges=[(0, 1), (1, 2)],
                              group_sizes=[1, 1], schedule="gpipe"))
    d = 1.0
    for depth, want in ((0.0, [1.0, 2.0, 3.0]), (1.5, [0.0, 0.5, 1.5]), (10.0, [0.0, 0.0, 0.0])):
        tl = replay(sched, _Uniform(0.0, 0.0, d, depth))
        got = [s.ready for s in tl.spans[1] if s.action.kind == Kind.RECV_ACT]
        assert got == pytest.approx(want), depth


def test_rows_sync_and_ring_all_reduce_start_on_rested_links():
    plan, prof = _three_stages(3, tied=True)
    plan.tied_sync = Sync(kind="rows", rows=50)
    rows = tied_rows_bytes(prof, plan)
    ar = Action(Kind.ALLREDUCE, 0, group=(0, 2), tied=True)
    for burst in (0.0, 20_000.0, 1e6):
        got = MeasuredCost(plan, prof, Links(_bursty(burst))).allreduce_s(ar)
        assert got == pytest.approx(2 * (LAT + (rows - min(burst, rows)) / RATE), rel=1e-12)
        links = Links(_bursty(burst))
        n = 4096 * 256 * 4
        assert links.ring_allreduce(["pi0", "pi2"], n) == pytest.approx((n - min(burst, n)) / RATE + 2 * LAT)


def test_probe_burst_is_what_a_rested_message_gained():
    rate, rtt = 1.2e6, 0.002
    # 256 kB after a rest, 64 kB of it at once: delivered and acknowledged in rtt + 192 kB / rate
    assert burst_of(256 << 10, rtt + (192 << 10) / rate, rate, rtt) == pytest.approx(64 << 10)
    assert burst_of(256 << 10, rtt + (300 << 10) / rate, rate, rtt) == 0.0
    assert burst_of(256 << 10, rtt / 2, rate, rtt) == 256 << 10


def test_burst_bytes_round_trip_and_are_checked(tmp_path):
    bw = _bursty(65536.0)
    bw.save(tmp_path / "b.json")
    assert Bandwidth.load(tmp_path / "b.json") == bw
    _bursty(0.0).save(tmp_path / "plain.json")
    assert "burst_bytes" not in json.loads((tmp_path / "plain.json").read_text())
    d = bw.to_json()
    d["burst_bytes"]["pi0|pi1"] = -1
    (tmp_path / "bad.json").write_text(json.dumps(d))
    with pytest.raises(FormatError, match=re.escape("burst_bytes.pi0|pi1")):
        Bandwidth.load(tmp_path / "bad.json")


@pytest.mark.parametrize("burst", [0.0, 65536.0])
def test_the_tied_pairs_int8_all_gather_waits_for_the_late_members_notices(burst):
    """gloo's all-gather of two members that arrive apart: the late member's buffer crosses at once,
    the early member's second half only after it (its notice rides behind): 1.5 buffers of time."""
    links, n = Links(_bursty(burst)), 1_064_960
    assert links.ring_allgather(["pi0", "pi2"], n) == pytest.approx((n - min(burst, n)) / RATE + 2 * LAT)
    assert links.ring_allgather(["pi0", "pi2"], n, skewed=True) == pytest.approx((1.5 * n - burst) / RATE + 2 * LAT)
    plan, prof = _three_stages(3, tied=True)
    plan.tied_sync = Sync(kind="allreduce", wire="int8")
    got = MeasuredCost(plan, prof, links).allreduce_s(Action(Kind.ALLREDUCE, 0, group=(0, 2), tied=True))
    assert got == pytest.approx((1.5 * n - burst) / RATE + 2 * LAT)  # codes and a scale per 256; no codec CPU measured
