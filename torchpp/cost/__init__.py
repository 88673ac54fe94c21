"""The cost layer: measured profiles, links, the memory model and the one price of a stage.

Below both the planner and the simulator: it imports only ``torchpp.formats``,
``torchpp.schedules`` and numpy.
"""
from .actions import MeasuredCost
from .links import FormatLinks, FreeLinks, Links
from .memory import ANALYTIC_ALPHA, ANALYTIC_KP, MemoryEstimator
from .profiles import Profiles
from .stage import (BlockMax, BlockSums, MemoryTerms, Span, StageMemory, StageTime, block_time, boundary_bytes,
                    layer_forward, layer_forward_calls, model_time, rank_weights, recompute_runs, stage_blocks, stage_time,
                    stage_weights, tied_rows_bytes, tied_sync_bytes)
from .ranks import device_memory

__all__ = ["ANALYTIC_ALPHA", "ANALYTIC_KP", "BlockMax", "BlockSums", "FreeLinks", "Links", "MeasuredCost",
           "MemoryEstimator", "MemoryTerms", "Profiles", "Span", "StageMemory", "StageTime", "block_time", "boundary_bytes",
           "layer_forward", "layer_forward_calls", "model_time", "recompute_runs", "stage_blocks", "stage_time",
           "stage_weights", "rank_weights", "device_memory", "tied_rows_bytes", "tied_sync_bytes",
           "FormatLinks"]
