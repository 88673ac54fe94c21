"""Pricing a plan of a mocked model on a topology: the one entry point for CLI, planner and benchmarks.

:class:`WorkloadCost` is the simulator's cost model for a homogeneous cluster: every rank is a
tensor-parallel group of ``tp`` devices of one kind, its stage times from
:func:`torchpp.cost.stage_time` on a :class:`~torchpp.cost.workload.Workload`'s profiles, the
tp all-reduces priced on the topology with every tp group of the cluster running at once.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..cost import boundary_bytes, stage_time, stage_weights, tied_sync_bytes
from ..cost.workload import MEGATRON_GPT, Workload, config_dict, workload
from ..formats import Plan
from ..schedules import Action, Kind, build
from ..topology.collectives import allreduce, merged, narrowest
from ..topology.routes import Network
from .fast import replicas, simulate_fast
from .topology import Placement, bundles_of, simulate_topology
from .types import SimResult

HOST = "device"


class WorkloadCost:
    """compute_s of every rank of ``plan`` and the bytes of its messages, from a workload's profiles."""

    def __init__(self, plan: Plan, profiles):
        self.plan, self.p = plan, profiles
        self.times = {s.index: stage_time(profiles, HOST, s) for s in plan.stages}
        self.samples = {d.rank: d.samples for s in plan.stages for d in s.devices}
        self.stage = {d.rank: s.index for s in plan.stages for d in s.devices}

    def compute_s(self, rank: int, a: Action) -> float:
        if a.kind == Kind.OPTIMIZER:
            return 0.0
        n = a.samples[1] - a.samples[0] if a.samples is not None else self.samples[rank]
        t = self.times[self.stage[rank]]
        return t.forward(n) if a.kind == Kind.FORWARD else t.backward(n)

    def bytes_of(self, rank: int, a: Action) -> float:
        st = self.plan.stages
        n = a.samples[1] - a.samples[0] if a.samples is not None else self.samples[rank]
        if a.kind in (Kind.SEND_ACT, Kind.RECV_ACT):
            return float(boundary_bytes(self.p, st[a.stage])) * n
        if a.kind in (Kind.SEND_GRAD, Kind.RECV_GRAD):
            return float(boundary_bytes(self.p, st[a.stage - 1])) * n
        if a.kind == Kind.ALLREDUCE:
            return tied_sync_bytes(self.p, self.plan) if a.tied else float(stage_weights(self.p, st[a.stage]))
        return 0.0

    def transfer_s(self, src: int, dst: int, a: Action) -> float:
        raise NotImplementedError("the topology model prices transfers on the network")

    def allreduce_s(self, a: Action) -> float:
        raise NotImplementedError("the topology model prices all-reduces on the network")


@dataclass
class Cluster:
    """A topology, its device kind and the tensor-parallel width of every plan rank."""

    net: Network
    flops: float
    """FLOP/s of one device."""
    tp: int = 1
    algorithm: str = "ring"

    def placement(self, plan: Plan) -> Placement:
        return Placement.contiguous([d.rank for s in plan.stages for d in s.devices], self.tp)

    def tp_terms(self, world: int) -> tuple[float, float]:
        """(seconds per byte, latency) of one tp all-reduce with every tp group of ``world`` ranks at once."""
        if self.tp == 1:
            return 0.0, 0.0
        groups = [allreduce(self.net, list(range(r * self.tp, (r + 1) * self.tp)), 1.0, self.algorithm)
                  for r in range(world)]
        b = merged(groups)
        return b.volume / narrowest(self.net, b), b.latency_s

    def profiles(self, wl: Workload, world: int):
        s_per_byte, lat = self.tp_terms(world)
        return wl.profiles(HOST, self.flops, self.tp, s_per_byte, lat)


def price_on_topology(plan: Plan, wl: Workload, cluster: Cluster, *, fast: bool | None = None,
                      spans: bool = True) -> SimResult:
    """One training step of ``plan``: the fast path when the plan is uniform (or ``fast``), else every rank."""
    world = plan.world_size
    if world * cluster.tp > cluster.net.hosts:
        raise ValueError(f"{world} ranks × tp {cluster.tp} devices do not fit on {cluster.net.hosts} hosts")
    prof = cluster.profiles(wl, world)
    place = cluster.placement(plan)
    if fast is None:
        fast = replicas(plan) > 0
    if fast:
        return simulate_fast(plan, lambda p: WorkloadCost(p, prof), cluster.net, place,
                             lambda p: WorkloadCost(p, prof).bytes_of, cluster.algorithm, spans=spans)
    cost = WorkloadCost(plan, prof)
    return simulate_topology(build(plan), cost, lambda c: bundles_of(c, cluster.net, place, cost.bytes_of,
                                                                     cluster.algorithm), cluster.net, spans=spans)


def load_workload(model: str, seq_len: int, dtype: str = "bfloat16") -> Workload:
    """A Megatron-GPT size (:data:`MEGATRON_GPT`), a torchpp preset or a local HF config (config only)."""
    if model in MEGATRON_GPT:
        return workload(config_dict(**MEGATRON_GPT[model]), model, seq_len, dtype)
    from ..models.presets import load_config  # the config only: no weights are built

    return workload(load_config(model), model, seq_len, dtype)
