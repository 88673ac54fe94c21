"""Versioned JSON records shared by every torchpp command, one module per file kind.

Every file carries ``"format": "torchpp.<kind>/<version>"``. Loading checks the format and
each field, and a failure names the file, the field and what was expected, so a bad input
is reported before any rank blocks in a collective. This package imports nothing else of
torchpp but ``validate`` (the ranges shared with the command line; imports flow down the
DESIGN.md layout list). ``from torchpp.formats import X`` reaches every record.
"""
from .base import FormatError, Reader, check_format, file_hash, read_json, to_dict, write_json
from .layers import BlockProfile, LAYERS_KIND, LAYERS_VERSION, LayersFile, ModelInfo, RunInfo
from .plan import (PLACEMENTS, PLAN_KIND, PLAN_SCHEDULES, PLAN_VERSION, SCHEDULES, Placement, Plan, PlanDevice, Predicted,
                   PlanStage, placement_of, rows_refusal, split_samples, validate_plan)
from .kinds import (FULL_BACKWARD_ONE_CHUNK, KIND_NAMES, KINDS, MULTI_CHUNK, ONE_CHUNK, SPLIT_BACKWARD, KindSpec,
                    parse_kinds)
from .bandwidth import BANDWIDTH_KIND, BANDWIDTH_VERSION, Bandwidth
from .capacities import (CAPACITIES_KIND, CAPACITIES_VERSION, SPEED_CHECK_KIND, SPEED_CHECK_VERSION, Capacities,
                         CapacityOutlier, HostTable, SpeedCheck, speed_ratios)
from .memory import MEMORY_KIND, MEMORY_ORDERS, MEMORY_VERSION, MemoryModel, MemorySample
from .devices import DeviceInfo, Devices, GB
from .sim import (EXPERIMENT_KIND, EXPERIMENT_VERSION, SIM_COMM_TYPES, SIM_INT_PARAMS, SIM_PARAMS, SIM_POLICIES,
                  ExperimentConfig, SimParams, SimSettings, check_sim_params, parse_priorities)
from .wire import LOSSY, OPTIMIZERS, POWERSGD_RANK, SYNC_KINDS, WIRE_FORMATS, Sync, tied_rows, wire_bytes, wire_ratio
from .trace import TRACE_KIND, TRACE_VERSION, check_trace, trace_plan_hashes
from .tokens import (TOKEN_DTYPES, TOKENS_KIND, TOKENS_VERSION, SourceFile, TokenizerInfo, TokensIndex,
                     check_corpus_files, token_dtype)

__all__ = [
    "FormatError", "Reader", "check_format", "file_hash", "read_json", "to_dict", "write_json",
    "BlockProfile", "LAYERS_KIND", "LAYERS_VERSION", "LayersFile", "ModelInfo", "RunInfo",
    "PLACEMENTS", "PLAN_KIND", "PLAN_SCHEDULES", "PLAN_VERSION", "Placement", "Plan", "PlanDevice", "Predicted",
    "PlanStage", "SCHEDULES", "placement_of", "rows_refusal", "split_samples", "validate_plan", "BANDWIDTH_KIND",
    "BANDWIDTH_VERSION", "Bandwidth", "CAPACITIES_KIND", "CAPACITIES_VERSION", "Capacities", "CapacityOutlier",
    "HostTable", "SPEED_CHECK_KIND", "SPEED_CHECK_VERSION", "SpeedCheck", "speed_ratios",
    "MEMORY_KIND", "MEMORY_ORDERS", "MEMORY_VERSION", "MemoryModel", "MemorySample", "DeviceInfo",
    "Devices", "GB", "EXPERIMENT_KIND", "EXPERIMENT_VERSION", "ExperimentConfig", "SIM_COMM_TYPES",
    "SIM_INT_PARAMS", "SIM_PARAMS", "SIM_POLICIES", "SimParams", "SimSettings", "check_sim_params",
    "parse_priorities", "TRACE_KIND", "TRACE_VERSION", "check_trace", "trace_plan_hashes",
    "LOSSY", "OPTIMIZERS", "POWERSGD_RANK", "SYNC_KINDS", "WIRE_FORMATS", "Sync", "tied_rows", "wire_bytes", "wire_ratio",
    "TOKEN_DTYPES", "TOKENS_KIND", "TOKENS_VERSION", "SourceFile", "TokenizerInfo", "TokensIndex",
    "check_corpus_files", "token_dtype",
    "FULL_BACKWARD_ONE_CHUNK", "KIND_NAMES", "KINDS", "MULTI_CHUNK", "ONE_CHUNK", "SPLIT_BACKWARD",
    "KindSpec", "parse_kinds",
]
