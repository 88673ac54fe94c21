"""Hand-made plans (even split, pure data parallel, pure pipeline, one device) for runs and comparisons."""
from __future__ import annotations

from ..formats import ModelInfo, Plan
from ..plans import even_layer_ranges, make_plan

__all__ = ["FIXED", "dp_plan", "even_layer_ranges", "even_plan", "fixed_candidates", "make_plan",
           "microbatch_counts", "pp_plan", "single_plan"]

FIXED = ("even", "pp", "dp", "single")
"""Fixed strategies `plan --compare` prices, each at its own best micro-batching."""


def even_plan(model: ModelInfo, *, stages: int, group_sizes: list[int] | None = None, **kw) -> Plan:
    return make_plan(model, layer_ranges=even_layer_ranges(model.num_layers, stages),
                     group_sizes=group_sizes or [1] * stages, strategy="even", **kw)


def pp_plan(model: ModelInfo, *, stages: int, **kw) -> Plan:
    return make_plan(model, layer_ranges=even_layer_ranges(model.num_layers, stages), group_sizes=[1] * stages,
                     strategy="pp", **kw)


def dp_plan(model: ModelInfo, *, devices: int, **kw) -> Plan:
    return make_plan(model, layer_ranges=[(0, model.num_layers)], group_sizes=[devices], strategy="dp", **kw)


def single_plan(model: ModelInfo, *, host: str, **kw) -> Plan:
    """The whole model on one device: what a user with one machine would run."""
    return make_plan(model, layer_ranges=[(0, model.num_layers)], group_sizes=[1], hosts=[host], strategy="single",
                     **kw)


def microbatch_counts(global_batch: int, min_size: int = 1, sizes: list[int] | None = None) -> list[int]:
    """Every micro-batch count that splits the global batch into micro-batches of at least
    ``min_size`` samples (only sizes in ``sizes`` when given)."""
    return [m for m in range(1, global_batch + 1)
            if global_batch % m == 0 and global_batch // m >= min_size
            and (sizes is None or global_batch // m in sizes)]


def fixed_candidates(name: str, model: ModelInfo, hosts: list[str], *, seq_len: int, global_batch: int,
                     schedule: str = "1f1b", sizes: list[int] | None = None) -> list[Plan]:
    """Every micro-batching (and, for ``single``, every device) of one fixed strategy, so it can
    be compared at its own best rather than at another plan's micro-batching. ``even``/``pp``:
    min(devices, layers) stages in the hosts' order; ``dp``: one stage over every device."""
    if name not in FIXED:
        raise ValueError(f"expected one of {', '.join(FIXED)}, got {name!r}")
    kw = dict(seq_len=seq_len, global_batch=global_batch, schedule=schedule)
    if name == "single":
        return [single_plan(model, host=h, num_microbatches=m, **kw)
                for h in hosts for m in microbatch_counts(global_batch, 1, sizes)]
    if name == "dp":
        return [dp_plan(model, devices=len(hosts), hosts=hosts, num_microbatches=m, **kw)
                for m in microbatch_counts(global_batch, len(hosts), sizes)]
    S = min(len(hosts), model.num_layers)
    build = even_plan if name == "even" else pp_plan
    return [build(model, stages=S, hosts=hosts[:S], num_microbatches=m, **kw)
            for m in microbatch_counts(global_batch, 1, sizes)]
