"""Plan builders shared by the planner and the simulator: even layer ranges, a plan from ranges and groups.

They sit below both (importing only :mod:`torchpp.formats`) so that the simulator can build its
parametric plans without importing the planner.
"""
from __future__ import annotations

from .formats import ModelInfo, Plan, PlanDevice, PlanStage, split_samples, validate_plan


def even_layer_ranges(num_layers: int, num_stages: int) -> list[tuple[int, int]]:
    """Contiguous ranges, sizes differing by at most one (earlier stages take the extra layers)."""
    if not 1 <= num_stages <= num_layers:
        raise ValueError(f"--stages: expected 1..{num_layers} (the model's decoder layers), got {num_stages}")
    base, extra = divmod(num_layers, num_stages)
    out, a = [], 0
    for i in range(num_stages):
        b = a + base + (1 if i < extra else 0)
        out.append((a, b))
        a = b
    return out


def make_plan(model: ModelInfo, *, seq_len: int, global_batch: int, num_microbatches: int,
              layer_ranges: list[tuple[int, int]], group_sizes: list[int], schedule: str = "1f1b",
              hosts: list[str] | None = None, shares: list[list[float]] | None = None,
              recompute: bool = False, strategy: str = "manual") -> Plan:
    """A plan from layer ranges and group sizes; ranks are numbered stage by stage."""
    if len(group_sizes) != len(layer_ranges):
        raise ValueError(f"--group-sizes: expected {len(layer_ranges)} sizes (one per stage), got {group_sizes}")
    if num_microbatches < 1 or global_batch % num_microbatches:
        raise ValueError(f"--microbatches: expected a divisor of --global-batch {global_batch}, got {num_microbatches}")
    mbs = global_batch // num_microbatches
    world = sum(group_sizes)
    hosts = hosts or [f"host{r}" for r in range(world)]
    if len(hosts) != world:
        raise ValueError(f"hosts: expected {world} names (one per device), got {len(hosts)}")
    stages, rank = [], 0
    for i, ((a, b), k) in enumerate(zip(layer_ranges, group_sizes)):
        if k < 1:
            raise ValueError(f"--group-sizes: expected sizes >= 1, got {group_sizes}")
        sh = shares[i] if shares else [1.0] * k
        if len(sh) != k:
            raise ValueError(f"shares of stage {i}: expected {k} values, got {sh}")
        if mbs < k:
            raise ValueError(f"micro-batch size {mbs} is smaller than the group of stage {i} ({k} devices): "
                             "raise --global-batch or lower --microbatches")
        counts = split_samples(mbs, sh)
        tot = sum(sh)
        devs = [PlanDevice(host=hosts[rank + j], rank=rank + j, share=sh[j] / tot, samples=counts[j]) for j in range(k)]
        stages.append(PlanStage(index=i, layers=(a, b), has_embed=i == 0, has_tail=i == len(layer_ranges) - 1,
                                devices=devs, recompute=[recompute] * (b - a)))
        rank += k
    plan = Plan(model=model, seq_len=seq_len, global_batch=global_batch, micro_batch_size=mbs,
                num_microbatches=num_microbatches, schedule=schedule, stages=stages, strategy=strategy)
    validate_plan(plan)
    return plan
