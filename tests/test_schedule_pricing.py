"""Pricing the schedules beyond 1F1B: closed forms, the B/W split, V without the tied all-reduce,
predicted traces with chunks, and memory of several chunks."""

import pytest

from torchpp import schedules as S
from torchpp.cost import MeasuredCost, MemoryEstimator, Profiles, StageMemory
from torchpp.formats import LayersFile, ModelInfo
from torchpp.cost import device_memory
from torchpp.planner.report import predict
from torchpp.planner.synthetic import layers_file, uniform_links
from torchpp.plans import even_layer_ranges, make_chunked_plan
from torchpp.schedules import Kind
from torchpp.sim.measured import price
from torchpp.sim.replay import replay
from torchpp.sim.trace import predicted_trace
from torchpp.trace.analyze import analyze, events_from_trace

INFO = ModelInfo(name="t", num_layers=48, hidden_size=8, vocab_size=32, tied_embeddings=False)


class Unit:
    """Every compute action its own constant length; communication free."""

    def __init__(self, f=1.0, b=2.0, i=1.0, w=1.0):
        self.t = {Kind.FORWARD: f, Kind.BACKWARD: b, Kind.BACKWARD_INPUT: i, Kind.BACKWARD_WEIGHT: w,
                  Kind.OPTIMIZER: 0.0}

    def compute_s(self, rank, a):
        return self.t[a.kind]

    def transfer_s(self, src, dst, a):
        return 0.0

    def allreduce_s(self, a):
        return 0.0


def _plan(schedule, v, p, m, info=INFO, **kw):
    return make_chunked_plan(info, seq_len=4, global_batch=m, num_microbatches=m, schedule=schedule,
                             layer_ranges=even_layer_ranges(info.num_layers, p * v), chunks_per_device=v, **kw)


@pytest.mark.parametrize("p,v,m", [(4, 2, 8), (4, 3, 8), (2, 2, 4), (4, 2, 16), (3, 2, 6), (4, 2, 4)])
def test_interleaved_bubble_is_p_minus_1_over_v_m(p, v, m):
    """Equal F and B per chunk, free communication: bubble / steady state = (p-1)/(v·m)."""
    T = replay(S.build(_plan("interleaved", v, p, m)), Unit(b=1.0)).makespan
    steady = m * v * 2.0
    assert (T - steady) / steady == pytest.approx((p - 1) / (v * m), abs=1e-12)


@pytest.mark.parametrize("p,m", [(4, 8), (4, 12), (3, 9), (2, 6), (8, 16)])
def test_zb_h1_bubble_is_a_third_of_1f1b(p, m):
    """F = I = W (B = I + W): 1F1B's bubble (p-1)(F+B), ZB-H1's (p-1)(F+I-W) = a third of it."""
    steady = m * 3.0
    b1 = replay(S.build(_plan("1f1b", 1, p, m)), Unit()).makespan - steady
    bz = replay(S.build(_plan("zb-h1", 1, p, m)), Unit()).makespan - steady
    assert b1 == pytest.approx(3 * (p - 1)) and bz == pytest.approx(b1 / 3)


def _profiles(num_layers=8, split=None):
    files = [layers_file(f"h{i}", num_layers=num_layers, speed=1.0 + 0.3 * i, tied=True) for i in range(4)]
    if split is not None:
        for f in files:
            for b in (f.embed, *f.layers, f.tail):
                b.backward_input_time_s = split * b.backward_time_s
    return Profiles.from_layers(files), uniform_links([f.host for f in files], 1e6)


def test_v_shape_has_no_tied_allreduce_and_is_priced():
    prof, links = _profiles()
    info = ModelInfo(**{**prof.model.__dict__})
    hosts = ["h0", "h1", "h2", "h3"]
    one = _plan("1f1b", 1, 4, 8, info, hosts=hosts)
    vee = _plan("v", 2, 4, 8, info, hosts=hosts)
    _, tl1 = price(one, prof, links)
    _, tlv = price(vee, prof, links)
    tied = lambda tl: [sp for spans in tl.spans.values() for sp in spans if sp.action.kind == Kind.ALLREDUCE]
    assert tied(tl1) and all(sp.action.tied for sp in tied(tl1))
    assert not tied(tlv)


def test_backward_split_halves_unless_measured():
    for split, want in [(None, 0.5), (0.3, 0.3)]:
        prof, links = _profiles(split=split)
        plan = _plan("zb-h1", 1, 4, 4, ModelInfo(**prof.model.__dict__), hosts=["h0", "h1", "h2", "h3"])
        cost = MeasuredCost(plan, prof, links)
        for r in plan.ranks:
            st = plan.stages[r]
            n = st.device(r).samples
            b, i, w = (cost.compute_s(r, S.Action(k, st.index, 0, samples=(0, n)))
                       for k in (Kind.BACKWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT))
            assert i + w == pytest.approx(b + prof.call.get(st.devices[0].host, 0.0))
            # the embedding's stage takes no input gradient: its I is nothing, its W the whole backward
            assert i == pytest.approx(0.0 if st.has_embed else want * b)
        assert ("assumed" in cost.backward_split) == (split is None)
        pred, _ = predict(plan, prof, links, MemoryEstimator.analytic(), {})
        assert pred["backward_split"] == cost.backward_split


def test_layers_file_backward_input_round_trip(tmp_path):
    lf = layers_file("h0", num_layers=2)
    assert "backward_input_time_s" not in lf.to_json()["layers"][0]
    lf.layers[0].backward_input_time_s = 0.5
    lf.save(tmp_path / "l.json")
    assert LayersFile.load(tmp_path / "l.json").layers[0].backward_input_time_s == 0.5


def test_predicted_trace_shows_chunks_and_reads_back():
    prof, links = _profiles()
    plan = _plan("zbv", 2, 2, 4, ModelInfo(**prof.model.__dict__), hosts=["h0", "h1"])
    _, tl = price(plan, prof, links)
    trace = predicted_trace(plan, tl)
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "process_name"}
    assert "stages 0,3" in names[0] and "stages 1,2" in names[1]
    stages = {(e["pid"], e["args"]["stage"]) for e in trace["traceEvents"]
              if e.get("ph") == "X" and e["name"][:1] in "FIW"}
    assert stages == {(0, 0), (0, 3), (1, 1), (1, 2)}
    res = analyze(events_from_trace(trace))
    assert res.num_stages == 4 and all(v >= 0 for v in res.bubble.values())
    assert res.step_time_s == pytest.approx(tl.makespan)


def test_memory_of_several_chunks():
    prof, _ = _profiles()
    mem = StageMemory(prof, MemoryEstimator.analytic())
    plan = _plan("1f1b", 1, 4, 8, ModelInfo(**prof.model.__dict__), hosts=["h0", "h1", "h2", "h3"])
    for r in plan.ranks:  # one chunk: the same as the single-stage accessor
        st = plan.stage_of_rank(r)
        n = S.in_flight("1f1b", 4, st.index, 8)
        assert mem.chunks_peak([(st, st.device(r).samples)], S.rank_profiles(plan, r)) == pytest.approx(
            float(mem.peak(st, st.device(r).samples, n)))
    vee = _plan("v", 2, 2, 8, ModelInfo(**prof.model.__dict__), hosts=["h0", "h1"])
    peaks = device_memory(vee, prof, MemoryEstimator.analytic())
    assert set(peaks) == {0, 1} and all(v > 0 for v in peaks.values())
