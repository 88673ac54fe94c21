"""Contention-free pricing of action lists against closed forms."""
import pytest

from torchpp import schedules as S
from torchpp.formats import ModelInfo
from torchpp.planner.simple import make_plan
from torchpp.schedules import Kind
from torchpp.sim.replay import replay


class Uniform:
    def __init__(self, f=1.0, b=2.0, comm=0.0, ar=0.0, opt=0.0):
        self.f, self.b, self.comm, self.ar, self.opt = f, b, comm, ar, opt

    def compute_s(self, rank, a):
        return {Kind.FORWARD: self.f, Kind.BACKWARD: self.b, Kind.OPTIMIZER: self.opt}[a.kind]

    def transfer_s(self, src, dst, a):
        return self.comm

    def allreduce_s(self, a):
        return self.ar


def pipeline(p, m, schedule, tied=False):
    info = ModelInfo(name="t", num_layers=p, hidden_size=8, vocab_size=32, tied_embeddings=tied)
    return S.build(make_plan(info, seq_len=4, global_batch=m, num_microbatches=m,
                             layer_ranges=[(i, i + 1) for i in range(p)], group_sizes=[1] * p, schedule=schedule))


@pytest.mark.parametrize("p,m", [(1, 1), (2, 4), (4, 8), (4, 2), (3, 7)])
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_closed_form_no_comm(p, m, schedule):
    f, b = 1.0, 2.0
    tl = replay(pipeline(p, m, schedule), Uniform(f, b))
    assert tl.makespan == pytest.approx((m + p - 1) * (f + b))


def test_comm_adds_per_hop_latency():
    # one micro-batch crosses every hop twice: p(f + b) + 2(p - 1)c
    for p in (1, 2, 4):
        f, b, c = 1.0, 2.0, 0.25
        tl = replay(pipeline(p, 1, "1f1b"), Uniform(f, b, comm=c))
        assert tl.makespan == pytest.approx(p * (f + b) + 2 * (p - 1) * c)


def test_allreduce_waits_for_last_member():
    info = ModelInfo(name="t", num_layers=2, hidden_size=8, vocab_size=32, tied_embeddings=True)
    sched = S.build(make_plan(info, seq_len=4, global_batch=4, num_microbatches=2, layer_ranges=[(0, 1), (1, 2)],
                              group_sizes=[1, 1]))
    tl = replay(sched, Uniform(1.0, 2.0, ar=0.5, opt=0.1))
    assert tl.makespan == pytest.approx(3 * 3.0 + 0.5 + 0.1)
    ar = [s for s in tl.spans[0] if s.action.kind == Kind.ALLREDUCE][0]
    assert ar.end == pytest.approx(9.5)
