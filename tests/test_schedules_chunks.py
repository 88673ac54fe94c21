"""Chunked plans (format 2) and the schedules beyond 1F1B: interleaved, V, zero-bubble."""
import json

import pytest

from torchpp import schedules as S
from torchpp.formats import FormatError, ModelInfo, Plan
from torchpp.plans import even_layer_ranges, make_chunked_plan
from torchpp.schedules import Action, Kind

INFO = ModelInfo(name="t", num_layers=16, hidden_size=8, vocab_size=32, tied_embeddings=True)
KINDS = [("interleaved", 2), ("interleaved", 3), ("interleaved-zb", 2), ("v", 2), ("zbv", 2), ("zb-h1", 1),
         ("1f1b", 1), ("gpipe", 1)]


def chunked(schedule, v, p, m, group_sizes=None, mbs=4, tied=True):
    info = ModelInfo(**{**INFO.__dict__, "tied_embeddings": tied})
    return make_chunked_plan(info, seq_len=4, global_batch=mbs * m, num_microbatches=m,
                             layer_ranges=even_layer_ranges(16, p * v), schedule=schedule,
                             chunks_per_device=v, group_sizes=group_sizes)


@pytest.mark.parametrize("schedule,v", KINDS)
@pytest.mark.parametrize("p", [1, 2, 3, 4])
@pytest.mark.parametrize("m", [1, 2, 4, 6, 8])
@pytest.mark.parametrize("grouped", [False, True])
def test_every_kind_builds_and_validates(schedule, v, p, m, grouped):
    if schedule.startswith("interleaved") and m % max(1, m // p):
        pytest.skip("micro-batches not a multiple of the rounds (torch's condition)")
    pl = chunked(schedule, v, p, m, group_sizes=[2] + [1] * (p - 1) if grouped else None)
    sched = S.build(pl)  # validates: matching sends, dependency order, no deadlock
    split = schedule in ("interleaved-zb", "zbv", "zb-h1")
    for r, acts in sched.items():
        chunks = [s.index for s in pl.stages_of_rank(r)]
        assert len(chunks) == v
        for c in chunks:
            for kind in (Kind.FORWARD, *((Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT) if split else (Kind.BACKWARD,))):
                assert sorted(a.microbatch for a in acts if a.kind == kind and a.stage == c) == list(range(m))
        assert [a.kind for a in acts].count(Kind.OPTIMIZER) == 1 and acts[-1].kind == Kind.OPTIMIZER


def test_interleaved_is_megatrons_order():
    pl = S.placement_of("interleaved", 4, 2)
    got = [f"{c}{k.value}{mb}" for k, c, mb in S.position_order("interleaved", pl, 0, 4)]
    # warm-up (v-1)*p + 2(p-1-rank) = 4 forwards, chunk 0 then chunk 2 a round of 2 at a time
    assert got[:4] == ["0F0", "0F1", "2F0", "2F1"]
    assert got[4:8] == ["0F2", "2B0", "0F3", "2B1"]
    with pytest.raises(ValueError, match="divisible by 2"):
        S.position_order("interleaved", S.placement_of("interleaved", 4, 2), 0, 5)
    with pytest.raises(ValueError, match=r"got 16 \(5 rounds of 3 leave 1 over\); the nearest that work: 15, 18$"):
        S.interleaved_order(3, 2, 0, 16)
    for m in (15, 18):  # the counts the message names do run
        S.interleaved_order(3, 2, 0, m)


def test_zb_h1_is_1f1b_with_the_backward_split():
    for p, m in [(4, 8), (3, 5), (2, 1)]:
        pl = S.placement_of("zb-h1", p, 1)
        for s in range(p):
            zb = S.position_order("zb-h1", pl, s, m)
            assert S.merge_backward(zb) == [(k, s, mb) for k, mb in S.compute_order("1f1b", p, s, m)]
            assert S.in_flight("zb-h1", p, s, m) <= S.in_flight("1f1b", p, 0, m)  # ZB-H1: 1F1B's memory


def test_v_shape_hands_off_locally_and_needs_no_tied_allreduce():
    pl = chunked("v", 2, 3, 6)
    assert [s.index for s in pl.stages_of_rank(0)] == [0, 5] and [s.index for s in pl.stages_of_rank(2)] == [2, 3]
    sched = S.build(pl)
    assert not [a for acts in sched.values() for a in acts if a.kind == Kind.ALLREDUCE]
    # chunk 2 -> 3 (both on rank 2) is a local hand-off, both ways
    assert not [a for a in sched[2] if (a.kind, a.stage) in ((Kind.SEND_ACT, 2), (Kind.SEND_GRAD, 3))]
    assert not [a for a in sched[2] if (a.kind, a.stage) in ((Kind.RECV_ACT, 3), (Kind.RECV_GRAD, 2))]
    with pytest.raises(ValueError, match="even number"):
        S.placement_of("v", 3, 2)
    inter = S.build(chunked("interleaved", 2, 3, 6))
    assert [a for a in inter[0] if a.kind == Kind.ALLREDUCE and a.tied]  # embed on rank 0, tail on rank 2


def test_stage_of_rank_refuses_several_chunks():
    pl = chunked("interleaved", 2, 2, 4)
    with pytest.raises(ValueError, match="stages_of_rank"):
        pl.stage_of_rank(0)
    assert pl.world_size == 2 and pl.num_stages == 4
    assert pl.device_of_rank(1).rank == 1


def test_rank_in_flight_read_off_the_order():
    pl = chunked("v", 2, 2, 8)
    held = S.rank_in_flight(pl, 0)
    assert set(held) == {0, 3} and held[0] >= held[3] >= 1
    assert S.rank_in_flight(chunked("1f1b", 1, 4, 8), 0) == {0: 4}


def test_action_strings_round_trip_for_split_backward(tmp_path):
    sched = S.build(chunked("zbv", 2, 2, 4, group_sizes=[2, 1]))
    for acts in sched.values():
        for a in acts:
            assert S.parse_action(str(a)) == a
    assert str(Action(Kind.BACKWARD_INPUT, 1, 0)) == "1I0" and str(Action(Kind.BACKWARD_WEIGHT, 1, 0)) == "1W0"
    S.save(sched, tmp_path / "s.json")
    assert S.load(tmp_path / "s.json") == sched


def test_validate_catches_local_order():
    bad = {0: [Action(Kind.FORWARD, 0, 0), Action(Kind.BACKWARD_WEIGHT, 0, 0), Action(Kind.BACKWARD_INPUT, 0, 0)]}
    with pytest.raises(S.ScheduleError, match="runs before I") as e:
        S.validate(bad)
    assert "rank   0:" in str(e.value)
    v_wrong = {0: [Action(Kind.FORWARD, 1, 0), Action(Kind.FORWARD, 0, 0), Action(Kind.BACKWARD, 1, 0),
                   Action(Kind.BACKWARD, 0, 0)]}
    with pytest.raises(S.ScheduleError, match="F of chunk 0"):
        S.validate(v_wrong)


def test_format_2_round_trip_and_format_1_reader(tmp_path):
    pl = chunked("v", 2, 2, 4, group_sizes=[2, 1])
    pl.save(tmp_path / "v.json")
    assert json.loads((tmp_path / "v.json").read_text())["format"] == "torchpp.plan/2"
    assert Plan.load(tmp_path / "v.json") == pl
    one = chunked("1f1b", 1, 3, 4).to_json()
    one["format"] = "torchpp.plan/1"
    (tmp_path / "one.json").write_text(json.dumps(one))
    loaded = Plan.load(tmp_path / "one.json")
    assert loaded.format == "torchpp.plan/2" and loaded.stage_of_rank(2).index == 2
    one["schedule"] = "interleaved"
    (tmp_path / "bad.json").write_text(json.dumps(one))
    with pytest.raises(FormatError, match="'schedule'"):
        Plan.load(tmp_path / "bad.json")


@pytest.mark.parametrize("mutate,field", [
    (lambda d: d["stages"][3]["devices"][0].update(rank=0, host="host0"), "schedule"),  # 3 chunks on rank 0
    (lambda d: d["stages"][3]["devices"][0].update(rank=2, host="host2"), "stages[3].devices[*].rank"),
    (lambda d: d.update(schedule="1f1b"), "stages[*].devices[*].rank"),
    (lambda d: d.update(schedule="v"), "stages[3].devices[*].rank"),
    (lambda d: d["stages"][2]["devices"][0].update(host="elsewhere"), "stages[2].devices[0].host"),
    (lambda d: d["stages"][1].update(layers=[4, 7], recompute=[False] * 3), "stages[2].layers"),
])
def test_placement_errors_name_the_field(tmp_path, mutate, field):
    d = chunked("interleaved", 2, 2, 4).to_json()
    mutate(d)
    (tmp_path / "bad.json").write_text(json.dumps(d))
    with pytest.raises(FormatError) as e:
        Plan.load(tmp_path / "bad.json")
    assert f"'{field}'" in str(e.value)
