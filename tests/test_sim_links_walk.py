"""The ``links`` model walked list by list (``sim.links.replay_links``) equals the event core's run
of the same model, start, end and ready of every action bit for bit: every kind, device groups,
chunked placements, tied and untied, uneven and tied durations (zeros included), bursty links."""
import random

import pytest

from torchpp import schedules as S
from torchpp.formats import KIND_NAMES, MULTI_CHUNK, ModelInfo
from torchpp.plans import make_chunked_plan
from torchpp.schedules import Action, Kind, ScheduleError
from torchpp.sim.compiled import Compiled
from torchpp.sim.engine import SimOptions, simulate


class Random:
    """Durations drawn per (rank, action) from a few values, zeros among them, so that many events
    fall at the same instant (the order the core handles them in must not matter)."""

    def __init__(self, seed: int, burst: bool):
        self.rng, self.burst = random.Random(seed), burst
        self.memo: dict = {}

    def _draw(self, key, values):
        if key not in self.memo:
            self.memo[key] = self.rng.choice(values)
        return self.memo[key]

    def compute_s(self, rank, a):
        return self._draw(("c", rank, a.kind, a.stage, a.microbatch), [0.0, 0.25, 0.5, 1.0, 1.5, 0.1 * rank + 0.3])

    def transfer_s(self, src, dst, a):
        return self._draw(("t", src, dst, a.kind, a.microbatch), [0.0, 0.125, 0.25, 0.75, 2.0])

    def allreduce_s(self, a):
        return self._draw(("a", a.group, a.tied, a.stage), [0.0, 0.5, 1.25])

    def burst_s(self, src, dst, a):
        if not self.burst:
            return (0.0, 0.0)
        depth = self._draw(("b", src, dst), [0.0, 0.5, 1.0])
        return depth, min(depth, self.transfer_s(src, dst, a))  # as cost.Links: a bucket takes at most the transfer


def plans():
    for kind in KIND_NAMES:
        chunked = kind in MULTI_CHUNK
        for groups in ([1, 1], [2, 1, 1], [1, 3], [1, 1, 1, 1]):
            for tied in (True, False):
                for m in (1, 3, 4, 8):
                    p = len(groups)
                    v = 2 if chunked else 1
                    info = ModelInfo(name="t", num_layers=p * v, hidden_size=8, vocab_size=32, tied_embeddings=tied)
                    try:
                        plan = make_chunked_plan(info, seq_len=4, global_batch=m * 6, num_microbatches=m,
                                                 layer_ranges=[(i, i + 1) for i in range(p * v)], schedule=kind,
                                                 chunks_per_device=v, group_sizes=groups)
                        yield f"{kind}-{groups}-{'tied' if tied else 'untied'}-m{m}", S.build(plan)
                    except (ValueError, ScheduleError):
                        continue


CASES = list(plans())


def arrays(res):
    return {r: [(s.start, s.end, s.ready) for s in ss] for r, ss in res.timeline.spans.items()}


@pytest.mark.parametrize("name,sched", CASES, ids=[n for n, _ in CASES])
def test_the_walk_equals_the_event_core(name, sched):
    c = Compiled(sched)
    for seed in range(3):
        for burst in (False, True):
            cost = Random(seed, burst)
            walked = simulate(c, cost, SimOptions(comm="links"))
            evented = simulate(c, cost, SimOptions(comm="links"), events=True)
            assert arrays(walked) == arrays(evented), (name, seed, burst)
            assert simulate(c, cost, SimOptions(comm="links"), spans=False).makespan == evented.makespan


def test_every_kind_is_covered():
    kinds = {name.split("-[")[0] for name, _ in CASES}
    assert kinds == set(KIND_NAMES)


def test_all_reduces_before_more_compute_queue_as_on_the_core():
    """An all-reduce in the middle of a list (the rank computes on while it runs) and two queued
    all-reduces of one rank: the walk prices them as the core does."""
    ar01 = Action(Kind.ALLREDUCE, 0, group=(0, 1))
    sched = {0: [Action(Kind.FORWARD, 0, 0), ar01, Action(Kind.ALLREDUCE, 0, group=(0, 1), tied=True),
                 Action(Kind.FORWARD, 0, 1), Action(Kind.OPTIMIZER, 0)],
             1: [Action(Kind.FORWARD, 1, 0), Action(Kind.FORWARD, 1, 1), Action(Kind.FORWARD, 1, 2), ar01,
                 Action(Kind.ALLREDUCE, 1, group=(0, 1), tied=True), Action(Kind.OPTIMIZER, 1)]}
    c = Compiled(sched)
    for seed in range(20):
        cost = Random(seed, False)
        assert arrays(simulate(c, cost, SimOptions(comm="links"))) == \
            arrays(simulate(c, cost, SimOptions(comm="links"), events=True))


def test_a_deadlock_is_reported_by_the_walk():
    sched = {0: [Action(Kind.RECV_ACT, 0, 0, peer=1), Action(Kind.SEND_ACT, 0, 0, peer=1)],
             1: [Action(Kind.RECV_ACT, 1, 0, peer=0), Action(Kind.SEND_ACT, 1, 0, peer=0)]}
    with pytest.raises(ScheduleError, match="deadlocks"):
        simulate(Compiled(sched), Random(0, False), SimOptions(comm="links"))
