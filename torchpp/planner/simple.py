"""Hand-made plans (even split, pure data parallel, pure pipeline) for runs and comparisons."""
from __future__ import annotations

from ..formats import ModelInfo, Plan
from ..plans import even_layer_ranges, make_plan

__all__ = ["dp_plan", "even_layer_ranges", "even_plan", "make_plan", "pp_plan"]


def even_plan(model: ModelInfo, *, stages: int, group_sizes: list[int] | None = None, **kw) -> Plan:
    return make_plan(model, layer_ranges=even_layer_ranges(model.num_layers, stages),
                     group_sizes=group_sizes or [1] * stages, strategy="even", **kw)


def pp_plan(model: ModelInfo, *, stages: int, **kw) -> Plan:
    return make_plan(model, layer_ranges=even_layer_ranges(model.num_layers, stages), group_sizes=[1] * stages,
                     strategy="pp", **kw)


def dp_plan(model: ModelInfo, *, devices: int, **kw) -> Plan:
    return make_plan(model, layer_ranges=[(0, model.num_layers)], group_sizes=[devices], strategy="dp", **kw)
