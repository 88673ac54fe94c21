"""The one schedule: orders, communication passes, validation, save/load."""
import itertools

import pytest

from torchpp import schedules as S
from torchpp.formats import ModelInfo
from torchpp.planner.simple import make_plan
from torchpp.schedules import Action, Kind

TINY = ModelInfo(name="t", num_layers=6, hidden_size=8, vocab_size=32, tied_embeddings=True)


def plan(groups, m=4, mbs=None, schedule="1f1b", tied=True, shares=None):
    mbs = mbs or max(groups) * 2
    layers = [(i, i + 1) for i in range(len(groups) - 1)] + [(len(groups) - 1, TINY.num_layers)]
    info = ModelInfo(**{**TINY.__dict__, "tied_embeddings": tied})
    return make_plan(info, seq_len=4, global_batch=mbs * m, num_microbatches=m, layer_ranges=layers,
                     group_sizes=groups, schedule=schedule, shares=shares)


@pytest.mark.parametrize("p,s,m", [(4, 0, 8), (4, 3, 8), (4, 1, 2), (1, 0, 3)])
def test_1f1b_order(p, s, m):
    order = S.compute_order("1f1b", p, s, m)
    warm = min(p - s - 1, m)
    assert [k for k, _ in order[:warm]] == [Kind.FORWARD] * warm
    assert sorted(i for k, i in order if k == Kind.FORWARD) == list(range(m))
    assert sorted(i for k, i in order if k == Kind.BACKWARD) == list(range(m))
    # in flight never exceeds min(p - s, m): the 1F1B memory bound the planner relies on
    live = peak = 0
    for k, _ in order:
        live += 1 if k == Kind.FORWARD else -1
        peak = max(peak, live)
    assert peak == min(p - s, m)


def test_gpipe_order():
    order = S.compute_order("gpipe", 3, 1, 3)
    assert [str(k.value) + str(i) for k, i in order] == ["F0", "F1", "F2", "B0", "B1", "B2"]


@pytest.mark.parametrize("groups", [[1], [3], [1, 1], [2, 1], [1, 2, 3], [3, 2], [2, 2, 1, 1]])
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("tied", [True, False])
def test_build_is_consistent(groups, schedule, tied):
    pl = plan(groups, schedule=schedule, tied=tied, mbs=6)
    sched = S.build(pl)  # build() validates: matching sends, no deadlock
    assert set(sched) == set(range(sum(groups)))
    for r, acts in sched.items():
        st = pl.stage_of_rank(r)
        f = [a for a in acts if a.kind == Kind.FORWARD]
        b = [a for a in acts if a.kind == Kind.BACKWARD]
        assert len(f) == len(b) == pl.num_microbatches
        assert acts[-1].kind == Kind.OPTIMIZER
        # every sample of every micro-batch is received exactly once by a stage's group
        if st.index > 0:
            got = sorted(a.samples for a in acts if a.kind == Kind.RECV_ACT and a.microbatch == 0)
            assert got[0][0] == f[0].samples[0] and got[-1][1] == f[0].samples[1]
        syncs = [a for a in acts if a.kind == Kind.ALLREDUCE]
        assert any(not a.tied for a in syncs) == (len(st.devices) > 1)
        assert any(a.tied for a in syncs) == (tied and len(groups) > 1 and st.index in (0, len(groups) - 1))


def test_uneven_shares_split_samples():
    pl = plan([2, 1], mbs=5, shares=[[3, 1], [1]])
    assert [d.samples for d in pl.stages[0].devices] == [4, 1]
    sched = S.build(pl)
    assert [str(a) for a in sched[2] if a.kind == Kind.RECV_ACT][:2] == ["1RA0<0[0:4]", "1RA0<1[4:5]"]


def test_round_trip_strings_and_file(tmp_path):
    sched = S.build(plan([2, 1, 3], mbs=6))
    for acts in sched.values():
        for a in acts:
            assert S.parse_action(str(a)) == a
    S.save(sched, tmp_path / "s.json")
    assert S.load(tmp_path / "s.json") == sched
    with pytest.raises(ValueError, match="not an action"):
        S.parse_action("1X0")


def test_validate_detects_deadlock_and_shows_grid():
    # both ranks receive first: nobody can move
    bad = {0: [Action(Kind.RECV_GRAD, 0, 0, 1), Action(Kind.SEND_ACT, 0, 0, 1)],
           1: [Action(Kind.RECV_ACT, 1, 0, 0), Action(Kind.SEND_GRAD, 1, 0, 0)]}
    with pytest.raises(S.ScheduleError, match="deadlock") as e:
        S.validate(bad)
    assert "rank   0: *0RG0<1" in str(e.value)


def test_validate_detects_order_mismatch_and_lost_sends():
    a0, a1 = Action(Kind.SEND_ACT, 0, 0, 1), Action(Kind.SEND_ACT, 0, 1, 1)
    with pytest.raises(S.ScheduleError, match="would receive"):
        S.validate({0: [a0, a1], 1: [Action(Kind.RECV_ACT, 1, 1, 0), Action(Kind.RECV_ACT, 1, 0, 0)]})
    with pytest.raises(S.ScheduleError, match="never received"):
        S.validate({0: [a0], 1: []})
    with pytest.raises(S.ScheduleError, match="meets"):
        S.validate({0: [Action(Kind.ALLREDUCE, 0, group=(0, 1))],
                    1: [Action(Kind.ALLREDUCE, 0, group=(0, 1), tied=True)]})


def test_every_small_hybrid_plan_validates():
    """Exhaustive over group shapes up to 4 devices and micro-batch sizes up to 4."""
    for n in range(1, 5):
        for groups in (g for k in range(1, n + 1) for g in itertools.product(range(1, n + 1), repeat=k) if sum(g) == n):
            for mbs in range(max(groups), 5):
                for schedule in ("1f1b", "gpipe"):
                    S.build(plan(list(groups), m=3, mbs=mbs, schedule=schedule))
