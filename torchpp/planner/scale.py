"""Choosing pp × dp × tp for N devices on a topology: enumerate layouts, price each by the fast path.

Library code: returns the priced layouts (best first); ``torchpp plan --estimate --topology``
writes the best as plan.json (one plan rank per tensor-parallel group of ``tp`` devices).
Memory is not checked here: the mocked model gives bytes, not a fitted memory model.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..cost.workload import Workload
from ..formats import Plan
from ..plans import even_layer_ranges, make_plan
from ..sim.scale import Cluster, price_on_topology
from ..topology.routes import Network


@dataclass
class Layout:
    pp: int
    dp: int
    tp: int
    microbatches: int
    step_time_s: float
    throughput: float
    """Samples per second."""
    plan: Plan


def layout_plan(wl: Workload, pp: int, dp: int, global_batch: int, microbatches: int, schedule: str = "1f1b") -> Plan:
    return make_plan(wl.model, seq_len=wl.seq_len, global_batch=global_batch, num_microbatches=microbatches,
                     layer_ranges=even_layer_ranges(wl.model.num_layers, pp), group_sizes=[dp] * pp,
                     schedule=schedule, strategy="topology")


def layouts(wl: Workload, net: Network, devices: int, flops: float, global_batch: int,
            tps: tuple[int, ...] = (1, 2, 4, 8), max_pp: int | None = None) -> list[Layout]:
    """Every (tp, pp, dp, micro-batches) with tp·pp·dp = devices that the batch allows, priced; best first."""
    out = []
    L = wl.model.num_layers
    for tp in tps:
        if devices % tp:
            continue
        ranks = devices // tp
        for pp in range(1, min(L, max_pp or L, ranks) + 1):
            if ranks % pp:
                continue
            dp = ranks // pp
            for m in sorted({pp, 2 * pp, 4 * pp, 1}):
                if global_batch % m or (global_batch // m) % dp:
                    continue
                plan = layout_plan(wl, pp, dp, global_batch, m)
                t = price_on_topology(plan, wl, Cluster(net, flops, tp), spans=False).makespan
                out.append(Layout(pp, dp, tp, m, t, global_batch / t, plan))
    if not out:
        raise ValueError(f"no pp × dp × tp layout of {devices} devices fits a global batch of {global_batch}")
    return sorted(out, key=lambda x: x.step_time_s)
