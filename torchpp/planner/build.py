"""From a stage layout to a plan: integer samples per device (Algorithm 1) and per-layer
recomputation (the MILP of :mod:`.recompute`) under each device's memory."""
from __future__ import annotations

from typing import Sequence

from ..formats import Plan, PlanDevice, PlanStage
from ..schedules import PeakState, peak_states
from .recompute import choose_recompute
from .tables import Tables
from .types import Problem, StageChoice


def stage_recompute(pb: Problem, t: Tables, hosts: Sequence[int], cut: tuple[int, int], b: int,
                    states: tuple[PeakState, ...]) -> tuple[list[bool], list[int]] | None:
    """``choose_recompute`` of a stage, kept: the local search and the schedule kinds build the
    same stage many times, and its MILP is the dearest step of building a plan."""
    key = ("recompute", tuple(hosts), cut, b, states)
    if key not in t.memo:
        t.memo[key] = choose_recompute(pb, t, hosts, cut, b, states)
    got = t.memo[key]
    return None if got is None else (list(got[0]), list(got[1]))


def build_plan(pb: Problem, t: Tables, order: Sequence[int], stages: list[StageChoice], b: int, strategy: str
               ) -> Plan | None:
    """Integer samples (Algorithm 1) and per-layer recompute (MILP); None if memory does not fit."""
    p = pb.profiles
    m = pb.global_batch // b
    S = len(stages)
    out: list[PlanStage] = []
    rank = 0
    for s, st in enumerate(stages):
        a, i = st.hosts
        hosts = [order[x] for x in range(a, i)]
        c, c2 = st.cut
        try:
            states = peak_states(pb.schedule, S, s, m)
        except ValueError:  # the kind's order cannot run m micro-batches on S stages (zb-h1's rounds)
            return None
        names = [pb.hosts[h] for h in hosts]
        layers = list(range(c, c2))
        rec = stage_recompute(pb, t, hosts, (c, c2), b, states)
        if rec is None:
            return None
        flags, samples = rec
        devs = [PlanDevice(host=nm, rank=rank + j, share=samples[j] / b, samples=samples[j])
                for j, nm in enumerate(names)]
        rank += len(devs)
        out.append(PlanStage(index=s, layers=(c, c2), has_embed=s == 0, has_tail=s == S - 1, devices=devs,
                             recompute=flags))
        assert len(flags) == len(layers)
    return Plan(model=p.model, seq_len=p.seq_len, global_batch=pb.global_batch, micro_batch_size=b,
                num_microbatches=m, schedule=pb.schedule, stages=out, strategy=strategy)

