"""capacities.json and speed checks: each host's speed relative to the reference host."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

from .. import validate as V
from .base import FormatError, Reader, V_host, _load, check_format, to_dict, write_json
from .devices import _device_host

CAPACITIES_KIND, CAPACITIES_VERSION = "capacities", 1


@dataclass(kw_only=True)
class HostTable:
    """One host's measured per-block times for ``batch`` samples, blocks ordered embed, layers…, tail."""

    batch: int
    forward_time_s: list[float]
    backward_time_s: list[float]
    forward_fixed_s: list[float] = field(default_factory=list)
    """Per-call seconds of each block (BlockProfile.forward_fixed_s); empty means all 0."""
    backward_fixed_s: list[float] = field(default_factory=list)


@dataclass(kw_only=True)
class CapacityOutlier:
    """A speed round of one host farther from the host's median round than its profiles' spread explains."""

    host: str
    round: int
    """0-based index into ``Capacities.rounds``."""
    value: float
    """The host's capacity in that round."""
    median: float
    tolerance: float
    """The relative distance from ``median`` the round's profiles' spread allowed."""
    cpu_steal_cores: float | None = None
    """The most CPU (cores) the host's or the reference host's machine lost to other guests of a
    virtual machine (steal) while that round's profiles were timed, where they recorded it."""

    def line(self) -> str:
        steal = (f"; {self.cpu_steal_cores:.2f} core(s) of the machine went to other guests (steal) while it was "
                 "profiled" if self.cpu_steal_cores else "")
        return (f"{self.host} round {self.round + 1}: {self.value:.3f} is {100 * (self.value / self.median - 1):+.0f}% "
                f"from its median {self.median:.3f}, beyond the {100 * self.tolerance:.0f}% its profiles' spread explains"
                + steal)


@dataclass(kw_only=True)
class Capacities:
    """capacities.json (seed 000 step 2): speed of each host relative to ``ref_host``.

    ``capacity[h]`` = ref's forward + backward seconds over h's, summed over every block and batch
    size both profiled (``torchpp capacities``; seed 000 took a median over layers). ``tables`` keeps
    every measured host's own per-block times, which beat a scaled reference where they exist.
    """

    ref_host: str
    capacity: dict[str, float]
    tables: dict[str, HostTable] = field(default_factory=dict)
    call_overhead_s: dict[str, float] = field(default_factory=dict)
    """Per host: the runtime's seconds per compute call its layers file measured
    (``LayersFile.call_overhead_s``); optional (files written before it load without it), and a host
    not in it is priced with the reference host's scaled by capacity."""
    optimizer_s_per_byte: dict[str, float] = field(default_factory=dict)
    """Per measured host: its layers file's ``optimizer_s_per_byte`` (hosts not measured absent)."""
    backward_split_factor: dict[str, float] = field(default_factory=dict)
    """Per measured host: its layers file's ``backward_split_factor`` (hosts not measured absent)."""
    backward_split_layer_s: dict[str, float] = field(default_factory=dict)
    """Per measured host: its layers file's ``backward_split_layer_s`` (hosts not measured absent)."""
    rounds: list[dict[str, float]] = field(default_factory=list)
    """Each round's capacities where profiles were taken in several rounds (``capacity`` is the
    median of a host's rounds); optional, empty for one round."""
    consensus_round: dict[str, int] = field(default_factory=dict)
    """Per host with ``rounds``: the round (0-based) whose ratio is the host's median, the profile its
    later speed checks compare against; for the reference host, the round it ran at median speed."""
    agreement: dict[str, float] = field(default_factory=dict)
    """Per host with ``rounds``: the largest relative distance of one of its rounds from its median
    (0 for the reference host, whose capacity is 1 in every round)."""
    outliers: list[CapacityOutlier] = field(default_factory=list)
    """Rounds farther from their host's median than the profiles' spread explains (re-take them)."""
    format: str = f"torchpp.{CAPACITIES_KIND}/{CAPACITIES_VERSION}"

    def to_json(self) -> dict[str, Any]:
        d = to_dict(self)
        for key in ("optimizer_s_per_byte", "backward_split_factor", "backward_split_layer_s", "rounds",
                    "consensus_round", "agreement", "outliers"):
            if not d[key]:
                d.pop(key)
        for o in d.get("outliers", []):
            if o.get("cpu_steal_cores") is None:
                o.pop("cpu_steal_cores", None)
        return {"format": d.pop("format"), **d}

    def save(self, path: str | os.PathLike) -> Path:
        return write_json(path, self.to_json())

    @staticmethod
    def parse(data: Any, source: str) -> "Capacities":
        if isinstance(data, Mapping) and "format" not in data and "capacity" in data:
            data = {**data, "format": f"torchpp.{CAPACITIES_KIND}/{CAPACITIES_VERSION}"}  # seed 000's file
        check_format(data, source, CAPACITIES_KIND, [CAPACITIES_VERSION])
        r = Reader(data, source)
        cap = r.obj("capacity")
        capacity = {_device_host(source, h): cap.float(h, positive=True, max_value=1e6) for h in cap.data}
        ref = r.str("ref_host")
        if ref not in capacity:
            raise FormatError(source, "ref_host", f"one of the hosts in 'capacity' ({', '.join(sorted(capacity))})", ref)
        tables = {}
        tr = r.obj("tables", {})
        for h in tr.data:
            t = tr.obj(h)
            fw, bw = t.floats("forward_time_s"), t.floats("backward_time_s")
            if len(fw) != len(bw) or len(fw) < 3:
                raise t.fail("backward_time_s", f"as many entries as forward_time_s ({len(fw)}, at least 3)", len(bw))
            for key, vals in (("forward_time_s", fw), ("backward_time_s", bw)):
                for i, v in enumerate(vals):
                    if v <= 0:
                        raise t.fail(f"{key}[{i}]", "a measured time > 0", v)
            f0, b0 = t.floats("forward_fixed_s", []), t.floats("backward_fixed_s", [])
            for key, vals in (("forward_fixed_s", f0), ("backward_fixed_s", b0)):
                if vals and (len(vals) != len(fw) or min(vals) < 0):
                    raise t.fail(key, f"{len(fw)} numbers >= 0 (one per block) or absent", vals)
            # a profile's batch (layers files' run.batch): per-sample times are the table's over it
            tables[h] = HostTable(batch=t.int("batch", min_value=1, max_value=V.MAX_GLOBAL_BATCH), forward_time_s=fw,
                                  backward_time_s=bw, forward_fixed_s=f0, backward_fixed_s=b0)
        co = r.obj("call_overhead_s", {})
        call = {_device_host(source, h): co.float(h, min_value=0.0, max_value=1e3) for h in co.data}
        return Capacities(ref_host=ref, capacity=capacity, tables=tables, call_overhead_s=call,
                          optimizer_s_per_byte=_host_rates(r, "optimizer_s_per_byte", capacity),
                          backward_split_factor=_host_rates(r, "backward_split_factor", capacity),
                          backward_split_layer_s=_host_rates(r, "backward_split_layer_s", capacity, zero=True),
                          rounds=(rounds := _capacity_rounds(r, capacity)),
                          **_round_judgement(r, capacity, len(rounds)))

    @staticmethod
    def load(path: str | os.PathLike) -> "Capacities":
        return _load(path, Capacities.parse)


def _capacity_rounds(r: Reader, capacity: Mapping[str, float]) -> list[dict[str, float]]:
    """The optional ``rounds``: a list of ``{host: capacity > 0}`` over hosts of ``capacity``."""
    out = []
    for row in r.objs("rounds", []):
        for h in row.data:
            if h not in capacity:
                raise row.fail(h, f"a host of 'capacity' ({', '.join(sorted(capacity))})", h)
        out.append({h: row.float(h, positive=True, max_value=1e6) for h in row.data})
    return out


def _round_judgement(r: Reader, capacity: Mapping[str, float], n_rounds: int) -> dict[str, Any]:
    """The optional ``consensus_round``, ``agreement`` and ``outliers`` over hosts of ``capacity`` and
    rounds ``0..n_rounds-1``."""
    def host(where: Reader, key: str, h: str) -> str:
        if h not in capacity:
            raise where.fail(key, f"a host of 'capacity' ({', '.join(sorted(capacity))})", h)
        return h
    cr = r.obj("consensus_round", {})
    consensus = {host(cr, h, h): cr.int(h, min_value=0, max_value=max(0, n_rounds - 1)) for h in cr.data}
    ag = r.obj("agreement", {})
    agreement = {host(ag, h, h): ag.float(h, min_value=0.0) for h in ag.data}
    outliers = []
    for o in r.objs("outliers", []):
        outliers.append(CapacityOutlier(host=host(o, "host", o.str("host")),
                                        round=o.int("round", min_value=0, max_value=max(0, n_rounds - 1)),
                                        value=o.float("value", positive=True), median=o.float("median", positive=True),
                                        tolerance=o.float("tolerance", min_value=0.0),
                                        cpu_steal_cores=o.float("cpu_steal_cores", None, min_value=0.0,
                                                                max_value=V.MAX_CPUS)))
    return {"consensus_round": consensus, "agreement": agreement, "outliers": outliers}


def _host_rates(r: Reader, key: str, capacity: Mapping[str, float], zero: bool = False) -> dict[str, float]:
    """An optional ``{host: number > 0}`` (``zero``: ``>= 0``) map over hosts of ``capacity`` (absent: empty)."""
    m = r.obj(key, {})
    for h in m.data:
        if h not in capacity:
            raise m.fail(h, f"a host in 'capacity' ({', '.join(sorted(capacity))})", h)
    return {h: (m.float(h, min_value=0.0, max_value=1e3) if zero else m.float(h, positive=True)) for h in m.data}


SPEED_CHECK_KIND, SPEED_CHECK_VERSION = "speed_check", 1


@dataclass(kw_only=True)
class SpeedCheck:
    """speed_check_<host>.json (``torchpp speed-check``): how fast a host runs now against its profile.

    The same decoder layers at the same batch sizes, timed again; ``ratio`` = measured / profiled
    seconds of forward + backward per layer at the largest batch (median over the layers, as
    capacities are read). A host that got slower than profiled (a Pi that throttles when hot, a
    machine shared with other work) reads above 1, and ``simulate plan --speed-check`` prices a
    plan at the speed the hosts have now."""

    host: str
    reference: str
    """The layers file the host's speed is compared against (its own profile)."""
    batch: int
    profiled_s: list[float]
    """Forward + backward seconds of each decoder layer at ``batch`` samples, from the reference."""
    measured_s: list[float]
    ratio: float
    iters: int
    format: str = f"torchpp.{SPEED_CHECK_KIND}/{SPEED_CHECK_VERSION}"

    def to_json(self) -> dict[str, Any]:
        d = to_dict(self)
        return {"format": d.pop("format"), **d}

    def save(self, path: str | os.PathLike) -> Path:
        return write_json(path, self.to_json())

    @staticmethod
    def parse(data: Any, source: str) -> "SpeedCheck":
        check_format(data, source, SPEED_CHECK_KIND, [SPEED_CHECK_VERSION])
        r = Reader(data, source)
        sc = SpeedCheck(host=V_host(r, "host"), reference=r.str("reference"), batch=r.int("batch", min_value=1),
                        profiled_s=r.floats("profiled_s"), measured_s=r.floats("measured_s"),
                        ratio=r.float("ratio", positive=True, max_value=1e3), iters=r.int("iters", min_value=1))
        if not sc.profiled_s or len(sc.measured_s) != len(sc.profiled_s):
            raise r.fail("measured_s", f"one time per profiled layer ({len(sc.profiled_s)}, at least 1)",
                         len(sc.measured_s))
        for key in ("profiled_s", "measured_s"):
            for i, v in enumerate(getattr(sc, key)):
                if v <= 0:
                    raise r.fail(f"{key}[{i}]", "a measured time > 0", v)
        return sc

    @staticmethod
    def load(path: str | os.PathLike) -> "SpeedCheck":
        return _load(path, SpeedCheck.parse)


def speed_ratios(paths: Iterable[str | os.PathLike]) -> dict[str, float]:
    """``{host: ratio}`` of speed-check files; a host checked twice is an error naming both files."""
    out: dict[str, float] = {}
    seen: dict[str, str] = {}
    for p in paths:
        sc = SpeedCheck.load(p)
        if sc.host in seen:
            raise FormatError(str(p), "host", f"a host not already checked by {seen[sc.host]}", sc.host)
        seen[sc.host], out[sc.host] = str(p), sc.ratio
    return out


