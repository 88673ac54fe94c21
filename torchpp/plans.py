"""Plan builders shared by the planner and the simulator: even layer ranges, a plan from ranges and
groups, and a plan whose devices hold several chunks (interleaved, V).

They sit below both (importing only :mod:`torchpp.formats`) so that the simulator can build its
parametric plans without importing the planner.
"""
from __future__ import annotations

from .formats import ModelInfo, Plan, PlanDevice, PlanStage, placement_of, split_samples, validate_plan


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


def make_chunked_plan(model: ModelInfo, *, seq_len: int, global_batch: int, num_microbatches: int,
                      layer_ranges: list[tuple[int, int]], schedule: str, chunks_per_device: int = 2,
                      group_sizes: list[int] | None = None, hosts: list[str] | None = None,
                      shares: list[list[float]] | None = None, recompute: bool | list[list[bool]] = False,
                      strategy: str = "manual") -> Plan:
    """A plan whose devices may hold several chunks, placed as ``schedule`` places them (interleaved:
    chunk c on group c mod p; V: chunks c and 2p-1-c on one group; one chunk per group otherwise).
    ``layer_ranges`` per chunk in pipeline order; ``group_sizes``, ``shares`` per device group
    (position); ranks numbered group by group; ``recompute``: one flag, or a list per chunk."""
    S = len(layer_ranges)
    pl = placement_of(schedule, S, chunks_per_device)
    sizes = group_sizes or [1] * pl.p
    if len(sizes) != pl.p or min(sizes) < 1:
        raise ValueError(f"group_sizes: expected {pl.p} sizes >= 1 (one per device group), got {sizes}")
    if num_microbatches < 1 or global_batch % num_microbatches:
        raise ValueError(f"num_microbatches: expected a divisor of global_batch {global_batch}, got {num_microbatches}")
    mbs = global_batch // num_microbatches
    first = [sum(sizes[:g]) for g in range(pl.p)]
    hosts = hosts or [f"host{r}" for r in range(sum(sizes))]
    if len(hosts) != sum(sizes):
        raise ValueError(f"hosts: expected {sum(sizes)} names (one per device), got {len(hosts)}")
    stages = []
    for c, (a, b) in enumerate(layer_ranges):
        g = pl.position[c]
        sh = shares[g] if shares else [1.0] * sizes[g]
        if len(sh) != sizes[g] or mbs < sizes[g]:
            raise ValueError(f"device group {g}: {sizes[g]} devices, shares {sh}, micro-batch size {mbs}")
        counts, tot = split_samples(mbs, sh), sum(sh)
        devs = [PlanDevice(host=hosts[first[g] + j], rank=first[g] + j, share=sh[j] / tot, samples=counts[j])
                for j in range(sizes[g])]
        rec = list(recompute[c]) if isinstance(recompute, list) else [recompute] * (b - a)
        stages.append(PlanStage(index=c, layers=(a, b), has_embed=c == 0, has_tail=c == S - 1, devices=devs,
                                recompute=rec))
    plan = Plan(model=model, seq_len=seq_len, global_batch=global_batch, micro_batch_size=mbs,
                num_microbatches=num_microbatches, schedule=schedule, stages=stages, strategy=strategy)
    validate_plan(plan)
    return plan
