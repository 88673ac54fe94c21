"""The event-driven engine against closed forms, hand-computed timelines and replay."""
from pathlib import Path

import pytest

from torchpp import schedules as S
from torchpp.formats import ModelInfo, Plan, SimParams, SimSettings
from torchpp.planner.simple import make_plan
from torchpp.schedules import Kind
from torchpp.sim.engine import Compiled, SimOptions, simulate
from torchpp.sim.model import Priorities, SimError
from torchpp.sim.parametric import (ParamCost, add_accumulation_syncs, compiled_parametric, completion_time,
                                    parametric_plan, run_params, sync_points)
from torchpp.sim.replay import replay

from replay_reference import replay_direct

ROOT = Path(__file__).resolve().parents[1]


class Uneven:
    """Per-rank compute, per-link transfer, fixed all-reduce: nothing symmetric to hide behind."""

    def __init__(self, f=1.0, b=2.0, comm=0.3, ar=0.7, opt=0.1):
        self.f, self.b, self.comm, self.ar, self.opt = f, b, comm, ar, opt

    def compute_s(self, rank, a):
        return {Kind.FORWARD: self.f * (1 + 0.1 * rank), Kind.BACKWARD: self.b * (1 + 0.05 * rank),
                Kind.OPTIMIZER: self.opt}[a.kind]

    def transfer_s(self, src, dst, a):
        return self.comm * (1 + 0.3 * src + 0.1 * dst)

    def allreduce_s(self, a):
        return self.ar * len(a.group)


def build(groups, m, schedule, tied=True):
    p = len(groups)
    info = ModelInfo(name="t", num_layers=p, hidden_size=8, vocab_size=32, tied_embeddings=tied)
    return S.build(make_plan(info, seq_len=4, global_batch=m * 6, num_microbatches=m,
                             layer_ranges=[(i, i + 1) for i in range(p)], group_sizes=groups, schedule=schedule))


def spans(tl):
    return {r: [(s.action, s.start, s.end, s.ready) for s in ss] for r, ss in tl.spans.items()}


# ------------------------------------------------------------------ subsumes replay
@pytest.mark.parametrize("groups", [[1], [3], [1, 1, 1, 1], [2, 1, 3], [2, 2]])
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_links_mode_equals_replay_exactly(groups, schedule):
    sched = build(groups, 5, schedule)
    cost = Uneven()
    assert spans(simulate(sched, cost, SimOptions(comm="links")).timeline) == spans(replay_direct(sched, cost))
    assert spans(replay(sched, cost)) == spans(replay_direct(sched, cost))


def test_runtime_hybrid_plan_priced_in_both_models():
    plan = Plan.load(ROOT / "configs" / "plan_hybrid_tiny.json")
    sched = S.build(plan)
    cost = Uneven()
    links = simulate(sched, cost, SimOptions(comm="links"))
    assert spans(links.timeline) == spans(replay_direct(sched, cost))
    shared = simulate(sched, cost, SimOptions(comm="shared"))
    # every action of every rank is priced once, in list order
    for r, acts in sched.items():
        assert [s.action for s in shared.timeline.spans[r]] == acts
        assert all(s.end >= s.start >= 0 for s in shared.timeline.spans[r])
    # a rank's compute never overlaps itself
    for r, ss in shared.timeline.spans.items():
        comp = sorted((s.start, s.end) for s in ss if s.action.kind in S.COMPUTE)
        assert all(a[1] <= b[0] + 1e-12 for a, b in zip(comp, comp[1:]))


# ------------------------------------------------------------------ closed forms
@pytest.mark.parametrize("p,m", [(1, 1), (2, 4), (4, 8), (4, 2), (3, 7), (8, 16)])
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_zero_comm_closed_form(p, m, schedule):
    f, b = 1.25, 2.5
    params = SimParams(n=m, stages=p, fwd_len=f, bwd_len=b, prop_len=0.0, sync_base_len=0.0, fwd_impact=0.0,
                       bwd_impact=0.0)
    t = completion_time(params, SimSettings(schedule=schedule), Priorities())
    assert t == pytest.approx((m + p - 1) * (f + b), abs=1e-12)


def test_comm_one_microbatch_crosses_every_hop_twice():
    for p in (1, 2, 5):
        params = SimParams(n=1, stages=p, fwd_len=1.0, bwd_len=2.0, prop_len=0.25, sync_base_len=0.0)
        assert completion_time(params, SimSettings(), Priorities()) == pytest.approx(p * 3.0 + 2 * (p - 1) * 0.25)


# ------------------------------------------------------------------ priorities: a hand-computed 2-device case
def two_devices(priorities, **kw):
    """2 stages, 1 micro-batch, f=1 b=2 prop=1 sync=2: at t=5 device 1 posts grad_prop and grad_sync together."""
    p = SimParams(n=1, stages=2, fwd_len=1.0, bwd_len=2.0, prop_len=1.0, sync_base_len=2.0, fwd_impact=0.0,
                  bwd_impact=0.0, **kw)
    res = run_params(p, SimSettings(), priorities)
    out = {}
    for r, ss in res.timeline.spans.items():
        for s in ss:
            name = {Kind.SEND_GRAD: "grad_prop", Kind.SEND_ACT: "fwd_prop", Kind.ALLREDUCE: "grad_sync",
                    Kind.FORWARD: "F", Kind.BACKWARD: "B"}.get(s.action.kind)
            if name:
                out[(r, name)] = (s.ready if name == "grad_sync" else s.start, s.end)
    return res.makespan, out


def test_exclusive_tier_preempts_shared_task():
    t, sp = two_devices(Priorities.of({"fwd_prop": 1.0, "grad_prop": 1.0, "grad_sync": 1.0}, {"grad_sync": "a"}))
    assert sp[(0, "F")] == (0.0, 1.0) and sp[(0, "fwd_prop")] == (1.0, 2.0)
    assert sp[(1, "F")] == (2.0, 3.0) and sp[(1, "B")] == (3.0, 5.0)
    assert sp[(1, "grad_sync")] == (5.0, 7.0)   # the exclusive sync takes the whole channel
    assert sp[(1, "grad_prop")] == (5.0, 8.0)   # posted at 5, gets bandwidth only from 7
    assert sp[(0, "B")] == (8.0, 10.0) and sp[(0, "grad_sync")] == (10.0, 12.0)
    assert t == 12.0
    t2, sp2 = two_devices(Priorities.of(None, {"grad_prop": "a", "grad_sync": "b"}))
    assert sp2[(1, "grad_prop")] == (5.0, 6.0) and sp2[(1, "grad_sync")] == (5.0, 8.0)
    assert t2 == 10.0


def test_shared_priorities_split_bandwidth_in_proportion():
    # grad_prop 0.75, grad_sync 0.25: grad_prop's 1.0 takes 1/0.75; the sync did 1/3 of its 2.0 by then
    t, sp = two_devices(Priorities.of({"fwd_prop": 1.0, "grad_prop": 0.75, "grad_sync": 0.25}))
    assert sp[(1, "grad_prop")][1] == pytest.approx(5.0 + 1 / 0.75)
    assert sp[(1, "grad_sync")][1] == pytest.approx(5.0 + 1 / 0.75 + (2.0 - 0.25 / 0.75))
    # equal priorities: both at one half
    _, eq = two_devices(Priorities.of({"fwd_prop": 1.0, "grad_prop": 0.5, "grad_sync": 0.5}))
    assert eq[(1, "grad_prop")][1] == pytest.approx(7.0) and eq[(1, "grad_sync")][1] == pytest.approx(8.0)


def test_zero_priority_waits_until_nothing_else_is_ready():
    t, sp = two_devices(Priorities.of({"fwd_prop": 1.0, "grad_prop": 1.0, "grad_sync": 0.0}))
    assert sp[(1, "grad_prop")] == (5.0, 6.0)
    assert sp[(1, "grad_sync")] == (5.0, 8.0)  # ready at 5, runs 6..8 after grad_prop
    # all at zero priority: equal split, like equal shares
    _, z = two_devices(Priorities.of({"fwd_prop": 0.0, "grad_prop": 0.0, "grad_sync": 0.0}))
    assert z[(1, "grad_prop")][1] == pytest.approx(7.0) and z[(1, "grad_sync")][1] == pytest.approx(8.0)


def test_interference_stretches_compute_by_the_factor():
    # one stage, two micro-batches, a long sync after B0 holds the whole channel while F1 and B1 run
    p = SimParams(n=2, stages=1, fwd_len=1.0, bwd_len=2.0, prop_len=0.0, sync_base_len=10.0, fwd_impact=0.5,
                  bwd_impact=0.25)
    res = run_params(p, SimSettings(), Priorities())
    ss = {(s.action.kind, s.action.microbatch): s for s in res.timeline.spans[0]}
    f1, b1 = ss[(Kind.FORWARD, 1)], ss[(Kind.BACKWARD, 1)]
    assert f1.end - f1.start == pytest.approx(1.0 / (1 - 0.5))
    assert b1.end - b1.start == pytest.approx(2.0 / (1 - 0.25))
    assert ss[(Kind.FORWARD, 0)].end - ss[(Kind.FORWARD, 0)].start == 1.0  # no sync running yet
    ideal = run_params(p, SimSettings(ideal_sync=True), Priorities())
    ss = {(s.action.kind, s.action.microbatch): s for s in ideal.timeline.spans[0]}
    assert ss[(Kind.FORWARD, 1)].end - ss[(Kind.FORWARD, 1)].start == 1.0


def _inbound_peaks(res, sched):
    """Largest total inbound rate of each receiver over the run (rates are piecewise constant)."""
    peer = {(r, i): a.peer for r, acts in sched.items() for i, a in enumerate(acts) if a.is_send}
    end = {(r, i): s.end for r, ss in res.timeline.spans.items() for i, s in enumerate(ss)}
    cur: dict[tuple[int, int], float] = {}
    peaks: dict[int, float] = {}
    log = sorted(res.rate_log, key=lambda x: x[0])
    i = 0
    while i < len(log):
        t = log[i][0]
        while i < len(log) and log[i][0] == t:
            _, r, step, v = log[i]
            if (r, step) in peer:
                cur[(r, step)] = v
            i += 1
        for dst in set(peer.values()):
            tot = sum(v for k, v in cur.items() if peer[k] == dst and end[k] > t)
            peaks[dst] = max(peaks.get(dst, 0.0), tot)
    return peaks


@pytest.mark.parametrize("cap", [1.0, 0.6])
def test_congestion_never_lets_inbound_exceed_capacity(cap):
    p = SimParams(n=8, stages=4, fwd_len=0.5, bwd_len=1.0, prop_len=2.0, sync_base_len=1.0)
    comp = compiled_parametric(4, 8, 1)
    pr = Priorities.of({"fwd_prop": 0.5, "grad_prop": 0.4, "grad_sync": 0.1})
    free = simulate(comp, ParamCost(p), SimOptions(priorities=pr), record_rates=True)
    assert max(_inbound_peaks(free, comp.sched).values()) > cap + 0.05  # the case does congest
    res = simulate(comp, ParamCost(p), SimOptions(priorities=pr, congestion=True, recv_capacity=cap),
                   record_rates=True)
    assert max(_inbound_peaks(res, comp.sched).values()) <= cap + 1e-9
    assert res.throttled and res.makespan > free.makespan


def test_sync_freq_places_syncs():
    assert sync_points(8, 3) == {2: 3, 5: 3, 7: 2}
    assert sync_points(8, 4) == {3: 4, 7: 4}
    sched = add_accumulation_syncs(S.build(parametric_plan(3, 8)), 8, 3)
    for r, acts in sched.items():
        syncs = [i for i, a in enumerate(acts) if a.kind == Kind.ALLREDUCE]
        assert [acts[i].microbatch for i in syncs] == [2, 5, 7]
        for i in syncs:  # right after that micro-batch's backward (and its gradient send)
            before = [a for a in acts[:i] if a.kind == Kind.BACKWARD]
            assert before[-1].microbatch == acts[i].microbatch
            assert acts[i - 1].kind in (Kind.BACKWARD, Kind.SEND_GRAD)
    p = SimParams(n=8, stages=3, sync_freq=3, sync_base_len=0.5, prop_len=0.0, fwd_impact=0.0, bwd_impact=0.0)
    res = run_params(p, SimSettings(), Priorities())
    durs = [s.end - s.ready for s in res.timeline.spans[0] if s.action.kind == Kind.ALLREDUCE]
    assert durs == [1.5, 1.5, 1.0]


def test_bad_options_are_refused():
    with pytest.raises(SimError, match="fwd_impact"):
        SimOptions(fwd_impact=1.0)
    with pytest.raises(SimError, match="links"):
        SimOptions(comm="links", congestion=True)
    with pytest.raises(SimError, match="grad_sync"):
        Priorities.of({"grad_sync": 1.5})
    with pytest.raises(ValueError, match="sync_freq"):
        SimParams(sync_freq=0)


def test_compiled_schedule_reused_gives_same_result():
    comp = compiled_parametric(4, 8, 2)
    assert compiled_parametric(4, 8, 2) is comp
    p = SimParams(n=8, stages=4, sync_freq=2)
    pr = Priorities.of({"fwd_prop": 0.3, "grad_prop": 0.3, "grad_sync": 0.4})
    a = simulate(comp, ParamCost(p), SimOptions(priorities=pr, congestion=True, fwd_impact=0.2, bwd_impact=0.2))
    b = simulate(Compiled(comp.sched), ParamCost(p), SimOptions(priorities=pr, congestion=True, fwd_impact=0.2,
                                                                bwd_impact=0.2))
    assert spans(a.timeline) == spans(b.timeline)


def test_parametric_bulk_durations_equal_the_cost_model():
    comp = compiled_parametric(3, 7, 3)
    cost = ParamCost(SimParams(n=7, stages=3, sync_freq=3, fwd_len=1.5, bwd_len=2.5, prop_len=0.75, sync_base_len=0.4))
    from torchpp.sim.compiled import durations_generic as _durations_generic

    assert cost.durations(comp) == _durations_generic(comp, cost)


def test_random_configurations_never_beat_the_contention_free_bound():
    """Fixed per-rank order + max-type dependencies: comm, sharing and interference only delay."""
    import random

    rng = random.Random(7)
    for _ in range(60):
        p = SimParams(n=rng.choice([1, 2, 5, 8]), stages=rng.choice([1, 2, 3, 4]), sync_freq=rng.choice([1, 2, 3]),
                      fwd_len=rng.choice([0.5, 1.0]), bwd_len=rng.choice([1.0, 2.5]),
                      prop_len=rng.choice([0.0, 0.5, 2.0]), sync_base_len=rng.choice([0.0, 1.0]),
                      fwd_impact=rng.choice([0.0, 0.3]), bwd_impact=rng.choice([0.0, 0.6]))
        shares = {t: rng.choice([0.0, 0.2, 0.5, 1.0]) for t in ("fwd_prop", "grad_prop", "grad_sync")}
        tiers = {t: rng.choice([None, None, "a", "b"]) for t in ("fwd_prop", "grad_prop", "grad_sync")}
        st = SimSettings(congestion=rng.random() < 0.5, ideal_sync=rng.random() < 0.2,
                         recv_capacity=rng.choice([0.5, 1.0]), schedule=rng.choice(["1f1b", "gpipe"]))
        t = completion_time(p, st, Priorities.of(shares, tiers))
        bound = (p.n + p.stages - 1) * (p.fwd_len + p.bwd_len)
        assert t >= bound - 1e-9, (p, st, shares, tiers)
        if p.prop_len == 0 and p.sync_base_len == 0:
            assert t == pytest.approx(bound)
