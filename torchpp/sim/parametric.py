"""The seed's parametric world priced with torchpp's own schedule.

``stages`` single-device stages and ``n`` micro-batches become a plan; :func:`schedules.build`
turns it into the runtime's action lists; :func:`add_accumulation_syncs` adds the seed's
data-parallel gradient syncs (one after every ``sync_freq`` backward passes, each over a
one-rank group standing for the stage's replicas); :class:`ParamCost` prices each action
from the seed's lengths.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from .. import schedules
from ..formats import ModelInfo, Plan, SimParams, SimSettings
from ..plans import make_plan
from ..schedules import Action, Kind, Schedule
from .compiled import Compiled, durations_generic
from .engine import simulate
from .model import Priorities
from .types import SimOptions, SimResult
from .seed002 import Seed002Result, simulate_seed002


def parametric_plan(stages: int, n: int, schedule: str = "1f1b") -> Plan:
    info = ModelInfo(name="parametric", num_layers=stages, hidden_size=1, vocab_size=1, tied_embeddings=False)
    return make_plan(info, seq_len=1, global_batch=n, num_microbatches=n,
                     layer_ranges=[(i, i + 1) for i in range(stages)], group_sizes=[1] * stages, schedule=schedule)


def sync_points(n: int, sync_freq: int) -> dict[int, int]:
    """micro-batch -> how many backward passes the sync after it carries."""
    out = {i: sync_freq for i in range(n) if (i + 1) % sync_freq == 0}
    if n % sync_freq:
        out[n - 1] = n % sync_freq
    return out


def add_accumulation_syncs(sched: Schedule, n: int, sync_freq: int) -> Schedule:
    """After each backward that closes an accumulation window, post that rank's gradient sync."""
    points = sync_points(n, sync_freq)
    out: Schedule = {}
    for rank, acts in sched.items():
        seq: list[Action] = []
        pending: Action | None = None
        for a in acts:
            if pending is not None and not (a.kind == Kind.SEND_GRAD and a.microbatch == pending.microbatch):
                seq.append(pending)
                pending = None
            seq.append(a)
            if a.kind == Kind.BACKWARD and a.microbatch in points:
                pending = Action(Kind.ALLREDUCE, a.stage, a.microbatch, group=(rank,))
        if pending is not None:
            seq.append(pending)
        out[rank] = seq
    schedules.validate(out)
    return out


@lru_cache(maxsize=256)
def compiled_parametric(stages: int, n: int, sync_freq: int, schedule: str = "1f1b") -> Compiled:
    """The action lists of one pipeline shape, compiled once and shared by a sweep's points."""
    sched = schedules.build(parametric_plan(stages, n, schedule))
    comp = Compiled(add_accumulation_syncs(sched, n, sync_freq))
    windows = sync_points(n, sync_freq)
    comp.kind_index = [_KIND_INDEX[a.kind] for a in comp.acts]
    comp.sync_windows = [(a, windows[comp.acts[a].microbatch]) for a in range(len(comp.acts))
                         if comp.acts[a].kind == Kind.ALLREDUCE]
    return comp


_KIND_INDEX = {Kind.FORWARD: 0, Kind.BACKWARD: 1, Kind.SEND_ACT: 2, Kind.SEND_GRAD: 2, Kind.OPTIMIZER: 3,
               Kind.RECV_ACT: 3, Kind.RECV_GRAD: 3, Kind.ALLREDUCE: 3}


@dataclass(frozen=True)
class ParamCost:
    """The seed's lengths as a CostModel: every stage alike, every transfer ``prop_len``."""

    p: SimParams

    def compute_s(self, rank: int, a: Action) -> float:
        if a.kind == Kind.FORWARD:
            return self.p.fwd_len
        if a.kind == Kind.BACKWARD:
            return self.p.bwd_len
        return 0.0

    def transfer_s(self, src: int, dst: int, a: Action) -> float:
        return self.p.prop_len

    def allreduce_s(self, a: Action) -> float:
        windows = sync_points(self.p.n, self.p.sync_freq)
        return self.p.sync_base_len * windows.get(a.microbatch, self.p.sync_freq)

    def durations(self, c: Compiled) -> list[float]:
        """All actions at once (what a sweep prices thousands of times); same values as above."""
        if getattr(c, "kind_index", None) is None:  # not built by compiled_parametric: the generic path
            return durations_generic(c, self)
        p = self.p
        return list(_bulk_durations(c, p.fwd_len, p.bwd_len, p.prop_len, p.sync_base_len))


@lru_cache(maxsize=64, typed=True)
def _bulk_durations(c: Compiled, fwd_len: float, bwd_len: float, prop_len: float,
                    sync_base_len: float) -> tuple[float, ...]:
    """Durations depend on the shape and the lengths only, and a sweep prices every priority
    scenario of one environment in a row: work them out once per environment."""
    table = (float(fwd_len), float(bwd_len), float(prop_len), 0.0)
    dur = [table[i] for i in c.kind_index]
    for a, w in c.sync_windows:
        dur[a] = sync_base_len * w
    return tuple(dur)


def options_for(p: SimParams, settings: SimSettings, priorities: Priorities) -> SimOptions:
    return SimOptions(comm="shared", priorities=priorities, fwd_impact=p.fwd_impact, bwd_impact=p.bwd_impact,
                      congestion=settings.congestion, recv_capacity=settings.recv_capacity,
                      ideal_sync=settings.ideal_sync)


def seed_lengths(p: SimParams) -> dict[str, float]:
    return {"forward": p.fwd_len, "backward": p.bwd_len, "fwd_prop": p.prop_len, "grad_prop": p.prop_len,
            "grad_sync": p.sync_base_len}


def run_params(p: SimParams, settings: SimSettings, priorities: Priorities) -> SimResult | Seed002Result:
    """One configuration under the chosen compute policy (full result, for charts and traces)."""
    if settings.policy == "seed002":
        return simulate_seed002(num_gpus=p.stages, n=p.n, sync_freq=p.sync_freq, lengths=seed_lengths(p),
                                priorities=priorities, fwd_impact=p.fwd_impact, bwd_impact=p.bwd_impact,
                                is_ideal=settings.ideal_sync, use_recv_congestion=settings.congestion)
    comp = compiled_parametric(p.stages, p.n, p.sync_freq, settings.schedule)
    return simulate(comp, ParamCost(p), options_for(p, settings, priorities))


def completion_time(p: SimParams, settings: SimSettings, priorities: Priorities) -> float:
    """Only the completion time (the sweep's unit of work)."""
    if settings.policy == "seed002":
        return run_params(p, settings, priorities).completion_time
    comp = compiled_parametric(p.stages, p.n, p.sync_freq, settings.schedule)
    return simulate(comp, ParamCost(p), options_for(p, settings, priorities), spans=False).makespan
