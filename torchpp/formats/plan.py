"""plan.json: the contract between planner, runtime and simulator."""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping

from .. import validate as V
from .base import FormatError, Reader, V_host, _load, check_format, to_dict, write_json
from .kinds import FULL_BACKWARD_ONE_CHUNK, KIND_NAMES, KINDS
from .layers import ModelInfo
from .wire import OPTIMIZERS, Sync, parse_sync, parse_wire


PLAN_KIND, PLAN_VERSION = "plan", 2
SCHEDULES = FULL_BACKWARD_ONE_CHUNK
"""The one-chunk-per-device schedules of plan format 1 (and of the simulator's parametric plans)."""
PLACEMENTS = {k.name: k.placement for k in KINDS.values()}
"""Every schedule kind of a plan and the placement of chunks it runs on (:mod:`.kinds`)."""
PLAN_SCHEDULES = KIND_NAMES


@dataclass(kw_only=True)
class PlanDevice:
    """One device of a stage's group: which rank runs it and which samples it takes."""

    host: str
    rank: int
    share: float
    """Fraction of every micro-batch this device computes (proportional to its speed)."""
    samples: int
    """Samples of each micro-batch this device computes; the group's counts sum to micro_batch_size."""


@dataclass(kw_only=True)
class PlanStage:
    """A chunk (a virtual stage): a contiguous layer range run by a group of devices. A device may
    hold several chunks (interleaved or V placement); ``index`` is the chunk's place in the pipeline."""

    index: int
    layers: tuple[int, int]
    """Decoder layer range [start, end)."""
    has_embed: bool
    has_tail: bool
    devices: list[PlanDevice]
    recompute: list[bool]
    """One flag per decoder layer of the stage: recompute its activations in backward."""
    wire: str | None = None
    """Format of the link to the next chunk, activations and their gradients (None: fp32; formats/wire.py)."""
    sync: Sync | None = None
    """How this chunk's device group agrees on its weights (None: fp32 all-reduce every step)."""

    @property
    def ranks(self) -> list[int]:
        return [d.rank for d in self.devices]

    @property
    def num_layers(self) -> int:
        return self.layers[1] - self.layers[0]

    def device(self, rank: int) -> PlanDevice:
        """This chunk's entry for ``rank`` (its share and samples in this chunk)."""
        for d in self.devices:
            if d.rank == rank:
                return d
        raise KeyError(f"rank {rank} is not in stage {self.index}")


@dataclass(kw_only=True)
class Predicted:
    """What the planner predicts a plan does (plan.json ``predicted``): its replayed step, the lower
    bound and the gap to it, the bubble split, each rank's peak memory and each stage's times.

    Keys the planner does not know (a newer or hand-edited file) are kept in ``extra`` and written
    back; older readers index it like the JSON object it is (``p["step_time_s"]``, ``p.get(..)``)."""

    step_time_s: float | None = None
    throughput_samples_per_s: float | None = None
    lower_bound_s: float | None = None
    ratio_to_lower_bound: float | None = None
    gap_to_bound: dict[str, float] | None = None
    """``planner.gap.Gap`` as a dict: the step in parts that add up to it."""
    bubble: dict[str, float] = field(default_factory=dict)
    """real = ideal + imbalance + communication + recompute, seconds per rank on average."""
    memory_model: str = ""
    memory_bytes_per_rank: dict[str, int] = field(default_factory=dict)
    stages: list[dict[str, Any]] = field(default_factory=list)
    """Per stage: layers, forward/backward/recompute/comm/all-reduce seconds, devices' memory and budget."""
    backward_split: Any = None
    """Split-backward kinds: each host's input-gradient share of the backward."""
    optimizer: str | None = None
    """Where the optimizer rate came from."""
    certificate: dict[str, Any] | None = None
    """``plan --certify``: the proven gap to the optimum of the searched space."""
    extra: dict[str, Any] = field(default_factory=dict)

    def __getitem__(self, key: str) -> Any:
        if key in self._known():
            return getattr(self, key)
        return self.extra[key]

    def __setitem__(self, key: str, value: Any) -> None:
        if key in self._known():
            setattr(self, key, value)
        else:
            self.extra[key] = value

    def __contains__(self, key: str) -> bool:
        return key in self.to_json()

    def get(self, key: str, default: Any = None) -> Any:
        return self.to_json().get(key, default)

    @classmethod
    def _known(cls) -> set[str]:
        return {f.name for f in fields(cls)} - {"extra"}

    def to_json(self) -> dict[str, Any]:
        """The JSON object, optional parts left out where absent (as the planner always wrote it)."""
        out = {k: getattr(self, k) for k in [f.name for f in fields(self)] if k != "extra"}
        out = {k: v for k, v in out.items() if v is not None or k == "gap_to_bound"}
        return {**out, **self.extra}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "Predicted":
        known = cls._known()
        return cls(**{k: v for k, v in data.items() if k in known},
                   extra={k: v for k, v in data.items() if k not in known})


@dataclass(frozen=True)
class Placement:
    """Where the chunks sit: ``p`` device groups (pipeline positions), ``v`` chunks per group,
    ``position[c]`` the group holding chunk c; ``chunks[g]`` the chunks of group g in pipeline order."""

    kind: str
    p: int
    v: int
    position: tuple[int, ...]

    @property
    def chunks(self) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in range(self.p)]
        for c, g in enumerate(self.position):
            out[g].append(c)
        return out


def placement_of(schedule: str, num_stages: int, chunks_of_first: int) -> Placement:
    """The placement a schedule kind implies for ``num_stages`` chunks, the first device holding
    ``chunks_of_first`` of them. Raises ValueError naming what does not fit."""
    kind = PLACEMENTS.get(schedule)
    S = num_stages
    if kind is None:
        raise ValueError(f"schedule: expected one of {list(PLACEMENTS)}, got {schedule!r}")
    if kind == "single":
        return Placement(kind, S, 1, tuple(range(S)))
    if kind == "v":
        if S % 2:
            raise ValueError(f"schedule {schedule!r} places chunks c and 2p-1-c on one device: "
                             f"expected an even number of stages, got {S}")
        p = S // 2
        return Placement(kind, p, 2, tuple(c if c < p else 2 * p - 1 - c for c in range(S)))
    v = chunks_of_first
    if v < 1 or S % v:
        raise ValueError(f"schedule {schedule!r} places chunk c on the devices of chunk c mod p: the first "
                         f"device holds {v} chunk(s), which does not divide the {S} stages")
    p = S // v
    return Placement(kind, p, v, tuple(c % p for c in range(S)))


@dataclass(kw_only=True)
class Plan:
    """The contract between planner, runtime and simulator (DESIGN.md, plan.json)."""

    model: ModelInfo
    seq_len: int
    global_batch: int
    micro_batch_size: int
    num_microbatches: int
    schedule: str
    stages: list[PlanStage]
    """The chunks in pipeline order (format 1: one per device)."""
    strategy: str = "manual"
    predicted: Predicted | None = None
    inputs: dict[str, str] = field(default_factory=dict)
    tied_sync: Sync | None = None
    """The tied-weight all-reduce's format (None: fp32 every step)."""
    optimizer: str | None = None
    """The optimizer the planner's lossy choices were made for (``adamw`` or ``sgd``; ``torchpp plan
    --optimizer``): the PowerSGD rank it offers depends on it. None: not recorded (planned without
    ``--allow-lossy``); ``torchpp.train`` warns when it runs another."""
    format: str = f"torchpp.{PLAN_KIND}/{PLAN_VERSION}"

    @property
    def ranks(self) -> list[int]:
        """Every rank of the plan, once each, sorted."""
        return sorted({r for s in self.stages for r in s.ranks})

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def num_stages(self) -> int:
        """Chunks (virtual stages) of the pipeline."""
        return len(self.stages)

    def stages_of_rank(self, rank: int) -> list[PlanStage]:
        """The chunks ``rank`` holds, in pipeline order."""
        out = [s for s in self.stages if rank in s.ranks]
        if not out:
            raise KeyError(f"rank {rank} is in no stage of the plan")
        return out

    def stage_of_rank(self, rank: int) -> PlanStage:
        """The one chunk of ``rank``; raises ValueError when it holds several (use stages_of_rank)."""
        out = self.stages_of_rank(rank)
        if len(out) > 1:
            raise ValueError(f"rank {rank} holds {len(out)} chunks ({[s.index for s in out]}) under schedule "
                             f"{self.schedule!r}: use Plan.stages_of_rank")
        return out[0]

    def device_of_rank(self, rank: int) -> PlanDevice:
        """``rank``'s entry in its first chunk (its host is the same in every chunk; its samples
        per chunk are ``stage.device(rank).samples``)."""
        return self.stages_of_rank(rank)[0].device(rank)

    def placement(self) -> Placement:
        """Which device group holds which chunk, as the schedule kind places them."""
        first = self.stages[0].ranks[0] if self.stages and self.stages[0].devices else 0
        n = sum(1 for s in self.stages if first in s.ranks)
        return placement_of(self.schedule, self.num_stages, n)

    def to_json(self) -> dict[str, Any]:
        d = to_dict(self)
        d = {"format": d.pop("format"), **d}
        if self.predicted is not None:
            d["predicted"] = to_dict(self.predicted.to_json())
        for s, st in zip(d["stages"], self.stages):
            s["layers"] = list(s["layers"])
            _optional(s, "wire", st.wire)
            _optional(s, "sync", st.sync)
        _optional(d, "tied_sync", self.tied_sync)
        _optional(d, "optimizer", self.optimizer)
        return d

    @property
    def lossy(self) -> list[str]:
        """Where the plan changes what crosses a link (empty: the arithmetic of fp32 training)."""
        out = [f"stages[{s.index}].wire={s.wire}" for s in self.stages if s.wire not in (None, "fp32")]
        out += [f"stages[{s.index}].sync={s.sync.kind}/{s.sync.wire}" for s in self.stages if s.sync and s.sync.lossy]
        if self.tied_sync and self.tied_sync.lossy:
            out.append(f"tied_sync={self.tied_sync.kind}/{self.tied_sync.wire}")
        return out

    def save(self, path: str | os.PathLike) -> Path:
        validate_plan(self, str(path))
        return write_json(path, self.to_json())

    @staticmethod
    def parse(data: Any, source: str) -> "Plan":
        """Format 2, or format 1 (one chunk per device, 1F1B or GPipe), read into format 2."""
        version = check_format(data, source, PLAN_KIND, [1, PLAN_VERSION])
        r = Reader(data, source)
        stages = [_parse_stage(sr, i) for i, sr in enumerate(r.objs("stages", min_len=1))]
        plan = Plan(
            model=ModelInfo.parse(r.obj("model")), seq_len=r.int("seq_len", min_value=1, max_value=V.MAX_SEQ_LEN),
            global_batch=r.int("global_batch", min_value=1, max_value=V.MAX_PLAN_GLOBAL_BATCH),
            micro_batch_size=r.int("micro_batch_size", min_value=1, max_value=V.MAX_GLOBAL_BATCH),
            num_microbatches=r.int("num_microbatches", min_value=1, max_value=V.MAX_MICROBATCHES),
            schedule=r.str("schedule", choices=set(SCHEDULES if version == 1 else PLAN_SCHEDULES)), stages=stages,
            strategy=r.str("strategy", "manual"), predicted=_predicted(r), inputs=_inputs(r),
            tied_sync=parse_sync(r, "tied_sync"),
            optimizer=r.str("optimizer", None, choices=set(OPTIMIZERS)) if r.has("optimizer") else None,
        )
        validate_plan(plan, source)
        return plan

    @staticmethod
    def load(path: str | os.PathLike) -> "Plan":
        return _load(path, Plan.parse)


def _parse_stage(sr: Reader, i: int) -> PlanStage:
    lay = sr.list("layers")
    if len(lay) != 2 or not all(isinstance(x, int) and not isinstance(x, bool) for x in lay):
        raise sr.fail("layers", "[start, end) as two integers", lay)
    devices = [
        PlanDevice(host=V_host(dr, "host"), rank=dr.int("rank", min_value=0, max_value=V.MAX_STAGES),
                   share=dr.float("share", positive=True), samples=dr.int("samples", min_value=0))
        for dr in sr.objs("devices", min_len=1)
    ]
    rec = sr.list("recompute", [False] * max(0, lay[1] - lay[0]))
    if not all(isinstance(x, bool) for x in rec):
        raise sr.fail("recompute", "a list of true/false, one per layer of the stage", rec)
    return PlanStage(index=sr.int("index", i), layers=(lay[0], lay[1]), has_embed=sr.bool("has_embed"),
                     has_tail=sr.bool("has_tail"), devices=devices, recompute=list(rec),
                     wire=parse_wire(sr, "wire"), sync=parse_sync(sr, "sync"))


def _optional(d: dict[str, Any], key: str, value: Any) -> None:
    """Absent fields stay absent: a plan without them is byte-identical to one written before they existed."""
    if value is None:
        d.pop(key, None)
    else:
        d[key] = value.to_json() if isinstance(value, Sync) else value


def _inputs(r: Reader) -> dict[str, str]:
    """``inputs``: which file each input was and its hash (``{"bandwidth": "sha256:..."}``)."""
    v = r.raw("inputs", {}) or {}
    if not isinstance(v, Mapping) or not all(isinstance(k, str) and isinstance(x, str) for k, x in v.items()):
        raise r.fail("inputs", "an object of strings (input name -> file hash)", v)
    return dict(v)


def _predicted(r: Reader) -> Predicted | None:
    v = r.raw("predicted", None)
    if v is not None and not isinstance(v, Mapping):
        raise r.fail("predicted", "an object (the planner's prediction) or null", v)
    return None if v is None else Predicted.from_json(v)


def validate_plan(plan: Plan, source: str = "<plan>", world_size: int | None = None,
                  model_layers: int | None = None) -> None:
    """Everything a rank must know to be true before it joins any collective."""
    _check_plan_sizes(plan, source)
    if plan.micro_batch_size * plan.num_microbatches != plan.global_batch:
        raise FormatError(source, "global_batch", f"micro_batch_size × num_microbatches = "
                          f"{plan.micro_batch_size} × {plan.num_microbatches} = "
                          f"{plan.micro_batch_size * plan.num_microbatches}", plan.global_batch)
    if plan.schedule not in PLACEMENTS:
        raise FormatError(source, "schedule", f"one of {list(PLACEMENTS)}", plan.schedule)
    for i, s in enumerate(plan.stages):
        _validate_chunk(plan, s, i, source)
    if plan.stages[-1].layers[1] != plan.model.num_layers:
        raise FormatError(source, f"stages[{plan.num_stages - 1}].layers", f"to end at model.num_layers="
                          f"{plan.model.num_layers}", list(plan.stages[-1].layers))
    ranks = plan.ranks
    if ranks != list(range(len(ranks))):
        raise FormatError(source, "stages[*].devices[*].rank", f"each of 0..{len(ranks) - 1} at least once", ranks)
    _validate_placement(plan, source)
    _validate_wire(plan, source)
    if world_size is not None and world_size != len(ranks):
        raise FormatError(source, "stages[*].devices", f"{world_size} device(s) in total to match the "
                          f"world size {world_size}", len(ranks))
    if model_layers is not None and model_layers != plan.model.num_layers:
        raise FormatError(source, "model.num_layers", f"{model_layers} (the layers of the model being "
                          "trained; see --layers)", plan.model.num_layers)


def _validate_chunk(plan: Plan, s: PlanStage, i: int, source: str) -> None:
    """One chunk: its place in the pipeline, its layers (contiguous after the previous chunk's), its group."""
    p, S = f"stages[{i}]", plan.num_stages
    _check_group(s, source, p)
    if s.index != i:
        raise FormatError(source, f"{p}.index", f"{i} (stages listed in pipeline order)", s.index)
    expect = plan.stages[i - 1].layers[1] if i else 0
    a, b = s.layers
    if a != expect or b < a:
        raise FormatError(source, f"{p}.layers", f"[{expect}, end) with end >= {expect} "
                          "(stages cover the decoder layers contiguously, in order, once)", [a, b])
    if s.has_embed != (i == 0):
        raise FormatError(source, f"{p}.has_embed", str(i == 0).lower(), s.has_embed)
    if s.has_tail != (i == S - 1):
        raise FormatError(source, f"{p}.has_tail", str(i == S - 1).lower(), s.has_tail)
    if b == a and not (s.has_embed or s.has_tail):
        raise FormatError(source, f"{p}.layers", "at least one layer (a stage without embed or tail "
                          "must hold a decoder layer)", [a, b])
    if len(s.recompute) != b - a:
        raise FormatError(source, f"{p}.recompute", f"{b - a} flag(s), one per layer", len(s.recompute))
    total = sum(d.samples for d in s.devices)
    if total != plan.micro_batch_size:
        raise FormatError(source, f"{p}.devices[*].samples", f"counts summing to micro_batch_size="
                          f"{plan.micro_batch_size}", [d.samples for d in s.devices])
    for j, d in enumerate(s.devices):
        if d.samples == 0:
            raise FormatError(source, f"{p}.devices[{j}].samples", "at least 1 (drop idle devices "
                              "from the group)", d.samples)
    if len(set(s.ranks)) != len(s.ranks):
        raise FormatError(source, f"{p}.devices[*].rank", "each rank at most once in a stage", s.ranks)


def _validate_placement(plan: Plan, source: str) -> None:
    """The schedule kind fits where the chunks sit: each group holds exactly its chunks, one host per rank."""
    try:
        pl = plan.placement()
    except ValueError as e:
        raise FormatError(source, "schedule", f"a schedule whose placement fits the stages ({e})", plan.schedule)
    held: dict[int, list[int]] = {}
    for c, s in enumerate(plan.stages):
        for r in s.ranks:
            held.setdefault(r, []).append(c)
    for g, chunks in enumerate(pl.chunks):
        group = set(plan.stages[chunks[0]].ranks)
        for c in chunks:
            if set(plan.stages[c].ranks) != group:
                raise FormatError(source, f"stages[{c}].devices[*].rank", f"the ranks of stages[{chunks[0]}] "
                                  f"{sorted(group)}: schedule {plan.schedule!r} places chunks {chunks} on one "
                                  "device group", plan.stages[c].ranks)
        for r in group:
            if held[r] != chunks:
                raise FormatError(source, "stages[*].devices[*].rank", f"rank {r} in stages {chunks} only "
                                  f"(schedule {plan.schedule!r}, {pl.kind} placement, {pl.v} chunk(s) per device)",
                                  held[r])
    hosts: dict[int, str] = {}
    for i, s in enumerate(plan.stages):
        for j, d in enumerate(s.devices):
            if hosts.setdefault(d.rank, d.host) != d.host:
                raise FormatError(source, f"stages[{i}].devices[{j}].host", f"{hosts[d.rank]!r} (rank {d.rank}'s "
                                  "host in an earlier stage: a rank is one device)", d.host)


def _validate_wire(plan: Plan, source: str) -> None:
    """Wire formats only on links that exist; a sync only on groups that all-reduce; diloco only on
    groups outside the tied all-reduce (whose sum assumes every group member holds the same gradient)."""
    first, last = set(plan.stages[0].ranks), set(plan.stages[-1].ranks)
    tied = plan.model.tied_embeddings and first != last
    if plan.stages[-1].wire is not None:
        raise FormatError(source, f"stages[{plan.num_stages - 1}].wire", "no format (the last chunk sends nothing on)",
                          plan.stages[-1].wire)
    for s in plan.stages:
        if s.sync is None:
            continue
        if len(s.devices) < 2:
            raise FormatError(source, f"stages[{s.index}].sync", "no sync (a group of one device all-reduces nothing)",
                              s.sync.kind)
        if s.sync.kind == "rows":
            raise FormatError(source, f"stages[{s.index}].sync.kind", "allreduce, powersgd or diloco (rows is the "
                              "tied pair's)", s.sync.kind)
        if s.sync.kind == "diloco" and tied and (s.has_embed or s.has_tail):
            raise FormatError(source, f"stages[{s.index}].sync.kind", "allreduce or powersgd (diloco replicas of the "
                              "first or last stage would disagree in the tied-weight all-reduce)", s.sync.kind)
    if plan.tied_sync is not None:
        if not tied:
            raise FormatError(source, "tied_sync", "no value (this plan has no tied-weight all-reduce)",
                              plan.tied_sync.kind)
        if plan.tied_sync.kind == "diloco":
            raise FormatError(source, "tied_sync.kind", "allreduce, powersgd or rows", "diloco")
        why = rows_refusal(plan) if plan.tied_sync.kind == "rows" else None
        if why is not None:
            raise FormatError(source, "tied_sync.kind", f"allreduce or powersgd (rows: {why})", "rows")


ROWS_GROUP_SYNCS = ("fp32", "bf16", "fp16")
"""The group syncs of an end stage that a ``rows`` tied sync can follow: a plain all-reduce, in fp32 or cast
to 16 bits (a zero stays zero, so the gradient stays zero outside the step's rows)."""


def rows_refusal(plan: Plan) -> str | None:
    """Why the tied pair of ``plan`` cannot sync by the rows a step touches (None: it can). The gradient
    rows a step leaves out must be zero at the first stage once its group has summed it (true of a
    plain all-reduce, not of a compressor with error feedback or a low-rank one), and the two ends
    must be different ranks."""
    first, last = plan.stages[0], plan.stages[-1]
    if not set(first.ranks).isdisjoint(last.ranks):
        return "the first and the last stage on different ranks"
    for s in (first, last):
        if s.sync is not None and not (s.sync.kind == "allreduce" and s.sync.wire in ROWS_GROUP_SYNCS):
            return (f"stages[{s.index}]'s group all-reduced in fp32, bf16 or fp16; its {s.sync.kind} {s.sync.wire} "
                    "sync leaves gradient outside the step's rows")
    return None


def _check_plan_sizes(plan: Plan, source: str) -> None:
    """Sizes within ``validate``'s limits (a plan written by hand, or a planner asked for too much)."""
    for key, v, lo, hi in (("seq_len", plan.seq_len, 1, V.MAX_SEQ_LEN),
                           ("global_batch", plan.global_batch, 1, V.MAX_PLAN_GLOBAL_BATCH),
                           ("num_microbatches", plan.num_microbatches, 1, V.MAX_MICROBATCHES),
                           ("stages", plan.num_stages, 1, V.MAX_STAGES)):
        if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
            raise FormatError(source, key, f"an integer in [{lo}, {hi}]" if key != "stages"
                              else f"1 to {hi} stages", v)


def _check_group(s: PlanStage, source: str, p: str) -> None:
    """A stage's devices: safe host names (a host may run several ranks) and shares that add up to 1."""
    try:
        for j, d in enumerate(s.devices):
            V.host_name(d.host, f"{p}.devices[{j}].host")
        V.shares([d.share for d in s.devices], f"{p}.devices[*].share")
    except ValueError as e:
        field_path, _, rest = str(e).partition(": ")
        raise FormatError(source, field_path, rest.removeprefix("expected ")) from None


def split_samples(total: int, shares: list[float]) -> list[int]:
    """Integer sample counts proportional to ``shares`` (largest remainder), each >= 1 when possible."""
    if total < 0 or not shares or any(s <= 0 for s in shares):
        raise ValueError(f"cannot split {total} samples by shares {shares}")
    tot = sum(shares)
    exact = [total * s / tot for s in shares]
    counts = [int(math.floor(x)) for x in exact]
    order = sorted(range(len(shares)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in order[: total - sum(counts)]:
        counts[i] += 1
    if total >= len(shares):
        for i in range(len(counts)):  # never leave a device with nothing to do
            if counts[i] == 0:
                j = max(range(len(counts)), key=lambda k: counts[k])
                counts[j] -= 1
                counts[i] += 1
    return counts


