"""The simulator's parametric settings and experiment files."""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

from .. import validate as V
from .base import FormatError, Reader, _load, check_format
from .plan import SCHEDULES


# --- owned by the simulator ---
SIM_PARAMS = ("n", "stages", "sync_freq", "fwd_len", "bwd_len", "prop_len", "sync_base_len", "fwd_impact", "bwd_impact")
"""The parametric simulator's environment, in the seed's names (plus ``stages``)."""
SIM_INT_PARAMS = ("n", "stages", "sync_freq")
SIM_COMM_TYPES = ("fwd_prop", "grad_prop", "grad_sync")
SIM_POLICIES = ("schedule", "seed002")
EXPERIMENT_KIND, EXPERIMENT_VERSION = "experiment", 1


@dataclass(kw_only=True, frozen=True)
class SimParams:
    """One parametric configuration: ``stages`` single-device stages, ``n`` micro-batches.

    Lengths are in arbitrary time units; a transfer's length is its duration when it holds
    the whole comm channel. ``sync_base_len`` is one micro-batch's share of a gradient
    all-reduce: a sync after ``sync_freq`` backward passes costs ``sync_base_len × sync_freq``.
    """

    n: int = 8
    """Micro-batches per step."""
    stages: int = 4
    """Pipeline stages (one device each)."""
    sync_freq: int = 1
    """A gradient all-reduce after every ``sync_freq`` backward passes (gradient accumulation)."""
    fwd_len: float = 1.0
    bwd_len: float = 2.0
    prop_len: float = 1.0
    """Activation and gradient transfer length."""
    sync_base_len: float = 1.0
    fwd_impact: float = 0.2
    """Fraction of forward speed lost while a grad_sync holds the whole comm channel."""
    bwd_impact: float = 0.2

    def __post_init__(self) -> None:
        check_sim_params(self.__dict__, "<sim params>")


def check_sim_params(values: Mapping[str, Any], source: str, prefix: str = "") -> None:
    """Reject values the simulator cannot price (the seed divided by zero or ran backwards on these)."""
    caps = {"n": V.MAX_MICROBATCHES, "stages": V.MAX_STAGES, "sync_freq": V.MAX_MICROBATCHES}
    for k in SIM_INT_PARAMS:
        v = values.get(k)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= caps[k]):
            raise FormatError(source, prefix + k, f"an integer in [1, {caps[k]}]", v)
    if isinstance(values.get("n"), int) and isinstance(values.get("stages"), int):
        try:
            V.sim_actions(values["stages"], values["n"])
        except ValueError as e:
            raise FormatError(source, prefix + "n", str(e).partition(": ")[2]) from None
    for k in ("fwd_len", "bwd_len", "prop_len", "sync_base_len"):
        v = values.get(k)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
                              or not 0 <= v <= V.MAX_SECONDS):
            raise FormatError(source, prefix + k, f"a length in [0, {V.MAX_SECONDS:g}]", v)
    for k in ("fwd_impact", "bwd_impact"):
        v = values.get(k)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < 1):
            raise FormatError(source, prefix + k, "a number in [0, 1) (1 would stall compute during a sync)", v)


@dataclass(kw_only=True)
class SimSettings:
    """How configurations are priced (the same for every point of a sweep)."""

    policy: str = "schedule"
    """``schedule``: torchpp's own 1F1B/GPipe action lists; ``seed002``: the original's greedy rules."""
    schedule: str = "1f1b"
    congestion: bool = False
    """Receiver congestion: a device's inbound transfers are throttled to ``recv_capacity``."""
    recv_capacity: float = 1.0
    ideal_sync: bool = False
    """grad_sync on its own channel, never slowing compute (the seed's ``is_ideal``)."""

    def __post_init__(self) -> None:
        if self.policy not in SIM_POLICIES:
            raise FormatError("<sim settings>", "policy", f"one of {list(SIM_POLICIES)}", self.policy)
        if self.schedule not in SCHEDULES:
            raise FormatError("<sim settings>", "schedule", f"one of {list(SCHEDULES)}", self.schedule)
        if self.policy == "seed002" and self.schedule != "1f1b":
            raise FormatError("<sim settings>", "schedule", "'1f1b' (the seed002 policy has its own greedy order)",
                              self.schedule)
        if not (isinstance(self.recv_capacity, (int, float)) and self.recv_capacity > 0):
            raise FormatError("<sim settings>", "recv_capacity", "a number > 0", self.recv_capacity)

    @staticmethod
    def parse(r: Reader) -> "SimSettings":
        return SimSettings(policy=r.str("policy", "schedule", choices=set(SIM_POLICIES)),
                           schedule=r.str("schedule", "1f1b", choices=set(SCHEDULES)),
                           congestion=r.bool("congestion", False),
                           recv_capacity=r.float("recv_capacity", 1.0, positive=True),
                           ideal_sync=r.bool("ideal_sync", False))


def parse_priorities(r: Reader, shared_key: str = "priorities", tier_key: str = "exclusive_tiers"
                     ) -> tuple[dict[str, float], dict[str, str]]:
    """``{"fwd_prop": 0.5, ...}`` shares in [0, 1] and ``{"grad_prop": "a"}`` exclusive tiers."""
    shared: dict[str, float] = {t: 1.0 for t in SIM_COMM_TYPES}
    if r.has(shared_key):
        sr = r.obj(shared_key)
        for k in sr.data:
            if k not in SIM_COMM_TYPES:
                raise sr.fail(k, f"one of the comm types {list(SIM_COMM_TYPES)}")
        shared = {t: sr.float(t, 0.0, min_value=0.0) for t in SIM_COMM_TYPES}
        for t, v in shared.items():
            if v > 1:
                raise sr.fail(t, "a share in [0, 1]", v)
    tiers: dict[str, str] = {}
    if r.has(tier_key):
        tr = r.obj(tier_key)
        for k, v in tr.data.items():
            if k not in SIM_COMM_TYPES:
                raise tr.fail(k, f"one of the comm types {list(SIM_COMM_TYPES)}")
            if v is None:
                continue
            if not (isinstance(v, str) and len(v) == 1 and "a" <= v <= "z"):
                raise tr.fail(k, "a tier letter 'a'..'z' ('a' pre-empts 'b') or null", v)
            tiers[k] = v
    return shared, tiers


@dataclass(kw_only=True)
class ExperimentConfig:
    """A sweep: every combination of the parameter values, crossed with every priority scenario.

    The file is seed 002's form: each parameter is a list of values or
    ``{"start", "stop", "step"}`` (stop included). Parameters left out keep
    :class:`SimParams`' defaults. Optional keys: ``settings`` (:class:`SimSettings`) and
    ``priority_step``.
    """

    grid: dict[str, list[float | int]]
    settings: SimSettings = field(default_factory=SimSettings)
    priority_step: float = 0.1

    def points(self) -> list[SimParams]:
        """Every combination in a fixed order; ``sync_freq > n`` is dropped as in the seed."""
        import itertools

        keys = [k for k in SIM_PARAMS if k in self.grid]
        out = []
        for combo in itertools.product(*(self.grid[k] for k in keys)):
            values = dict(zip(keys, combo))
            if values.get("sync_freq", 1) > values.get("n", SimParams.n):
                continue
            out.append(SimParams(**values))
        return out

    @staticmethod
    def parse(data: Any, source: str) -> "ExperimentConfig":
        r = Reader(data, source)
        if "format" in r.data:
            check_format(data, source, EXPERIMENT_KIND, [EXPERIMENT_VERSION])
        known = set(SIM_PARAMS) | {"format", "settings", "priority_step"}
        for k in r.data:
            if k not in known:
                raise FormatError(source, k, f"one of {sorted(known)}")
        grid: dict[str, list[float | int]] = {}
        for k in SIM_PARAMS:
            if k not in r.data:
                continue
            v = r.data[k]
            if isinstance(v, list):
                if not v:
                    raise FormatError(source, k, "a non-empty list or {start, stop, step}", v)
                vals = list(v)
            elif isinstance(v, Mapping):
                rr = r.obj(k)
                start, stop, step = rr.float("start"), rr.float("stop"), rr.float("step", positive=True)
                if stop < start:
                    raise rr.fail("stop", f"a number >= start ({start})", stop)
                num = int(round((stop - start) / step)) + 1
                if abs(start + (num - 1) * step - stop) > 1e-9 * max(1.0, abs(stop)):
                    raise rr.fail("step", f"a step that reaches stop={stop} from start={start}", step)
                vals = [round(start + (stop - start) * i / (num - 1), 12) if num > 1 else start for i in range(num)]
            else:
                raise FormatError(source, k, "a list of values or {\"start\", \"stop\", \"step\"}", v)
            if k in SIM_INT_PARAMS:
                for i, x in enumerate(vals):
                    if isinstance(x, float) and x.is_integer():
                        vals[i] = x = int(x)
            for i, x in enumerate(vals):
                try:
                    check_sim_params({k: x}, source)
                except FormatError as e:
                    raise FormatError(source, f"{k}[{i}]" if isinstance(v, list) else k, e.expected, x) from None
            grid[k] = vals
        sync, n = grid.get("sync_freq", [SimParams.sync_freq]), grid.get("n", [SimParams.n])
        if min(sync) > max(n):  # points() drops sync_freq > n: the grid would be empty
            raise FormatError(source, "sync_freq", f"at least one value <= n (at most {max(n)}): a sweep of no "
                              "points", sync)
        step = r.float("priority_step", 0.1, positive=True)
        if step > 1 or abs(round(1 / step) * step - 1) > 1e-9:
            raise FormatError(source, "priority_step", "a step that divides 1 (e.g. 0.1, 0.25)", step)
        settings = SimSettings.parse(r.obj("settings", {}))
        return ExperimentConfig(grid=grid, settings=settings, priority_step=step)

    @staticmethod
    def load(path: str | os.PathLike) -> "ExperimentConfig":
        return _load(path, ExperimentConfig.parse)


