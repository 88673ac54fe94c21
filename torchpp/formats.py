"""Versioned JSON records shared by every torchpp command.

Every file carries ``"format": "torchpp.<kind>/<version>"``. Loading checks the format and
each field, and a failure names the file, the field and what was expected, so a bad input
is reported before any rank blocks in a collective. This module imports nothing else of
torchpp (imports flow down the DESIGN.md layout list).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, TypeVar

T = TypeVar("T")


class FormatError(ValueError):
    """A file (or in-memory record) does not match its schema."""

    def __init__(self, source: str, field_path: str, expected: str, got: Any = dataclasses.MISSING):
        self.source, self.field_path, self.expected = source, field_path, expected
        msg = f"{source}: field '{field_path}': expected {expected}"
        if got is not dataclasses.MISSING:
            shown = repr(got)
            msg += f", got {shown if len(shown) <= 80 else shown[:77] + '...'}"
        super().__init__(msg)


# ----------------------------------------------------------------------------- reading helpers
class Reader:
    """Typed access to one JSON object with error messages that name file and field."""

    def __init__(self, data: Any, source: str, path: str = ""):
        self.source, self.path = source, path
        if not isinstance(data, Mapping):
            raise FormatError(source, path or "<root>", "a JSON object", data)
        self.data = data

    def _p(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def has(self, key: str) -> bool:
        return key in self.data and self.data[key] is not None

    def raw(self, key: str, default: Any = dataclasses.MISSING) -> Any:
        if key not in self.data:
            if default is dataclasses.MISSING:
                raise FormatError(self.source, self._p(key), "a value (field is missing)")
            return default
        return self.data[key]

    def str(self, key: str, default: Any = dataclasses.MISSING, choices: Iterable[str] | None = None) -> str:
        v = self.raw(key, default)
        if v is default and default is not dataclasses.MISSING:
            return v
        if not isinstance(v, str):
            raise FormatError(self.source, self._p(key), "a string", v)
        if choices is not None and v not in choices:
            raise FormatError(self.source, self._p(key), f"one of {sorted(choices)}", v)
        return v

    def bool(self, key: str, default: Any = dataclasses.MISSING) -> bool:
        v = self.raw(key, default)
        if v is default and default is not dataclasses.MISSING:
            return v
        if not isinstance(v, bool):
            raise FormatError(self.source, self._p(key), "true or false", v)
        return v

    def int(self, key: str, default: Any = dataclasses.MISSING, min_value: int | None = None) -> int:
        v = self.raw(key, default)
        if v is default and default is not dataclasses.MISSING:
            return v
        if isinstance(v, bool) or not isinstance(v, int):
            raise FormatError(self.source, self._p(key), "an integer", v)
        if min_value is not None and v < min_value:
            raise FormatError(self.source, self._p(key), f"an integer >= {min_value}", v)
        return v

    def float(self, key: str, default: Any = dataclasses.MISSING, min_value: float | None = None,
              positive: bool = False) -> float:
        v = self.raw(key, default)
        if v is default and default is not dataclasses.MISSING:
            return v
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise FormatError(self.source, self._p(key), "a finite number", v)
        if positive and v <= 0:
            raise FormatError(self.source, self._p(key), "a number > 0", v)
        if min_value is not None and v < min_value:
            raise FormatError(self.source, self._p(key), f"a number >= {min_value}", v)
        return float(v)

    def obj(self, key: str, default: Any = dataclasses.MISSING) -> "Reader":
        v = self.raw(key, default)
        if v is default and default is not dataclasses.MISSING:
            return Reader({}, self.source, self._p(key)) if v is None else Reader(v, self.source, self._p(key))
        return Reader(v, self.source, self._p(key))

    def list(self, key: str, default: Any = dataclasses.MISSING, min_len: int = 0) -> list[Any]:
        v = self.raw(key, default)
        if v is default and default is not dataclasses.MISSING:
            return v
        if not isinstance(v, list):
            raise FormatError(self.source, self._p(key), "a list", v)
        if len(v) < min_len:
            raise FormatError(self.source, self._p(key), f"a list of at least {min_len} item(s)", v)
        return v

    def objs(self, key: str, default: Any = dataclasses.MISSING, min_len: int = 0) -> list["Reader"]:
        items = self.list(key, default, min_len)
        return [Reader(x, self.source, f"{self._p(key)}[{i}]") for i, x in enumerate(items)]

    def floats(self, key: str, default: Any = dataclasses.MISSING) -> list[float]:
        items = self.list(key, default)
        out = []
        for i, x in enumerate(items):
            if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
                raise FormatError(self.source, f"{self._p(key)}[{i}]", "a finite number", x)
            out.append(float(x))
        return out

    def fail(self, key: str, expected: str, got: Any = dataclasses.MISSING) -> FormatError:
        return FormatError(self.source, self._p(key), expected, got)


def check_format(data: Any, source: str, kind: str, versions: Iterable[int]) -> int:
    """Check ``data["format"] == "torchpp.<kind>/<v>"`` and return v."""
    r = Reader(data, source)
    fmt = r.raw("format", None)
    allowed = [f"torchpp.{kind}/{v}" for v in versions]
    if fmt not in allowed:
        raise FormatError(source, "format", " or ".join(repr(a) for a in allowed), fmt)
    return int(fmt.rsplit("/", 1)[1])


def read_json(path: str | os.PathLike) -> Any:
    p = Path(path)
    if not p.is_file():
        raise FormatError(str(p), "<file>", "an existing file")
    try:
        return json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise FormatError(str(p), "<file>", f"valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None


def write_json(path: str | os.PathLike, data: Any) -> Path:
    """Write atomically (temp file + rename) so a crash never leaves half a file."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=False, default=_json_default)
            f.write("\n")
        os.replace(tmp, p)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return p


def _json_default(o: Any) -> Any:
    if dataclasses.is_dataclass(o):
        return to_dict(o)
    if hasattr(o, "tolist"):
        return o.tolist()
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def to_dict(obj: Any) -> Any:
    """dataclass -> plain JSON data (keeps field order; drops None-valued optional extras)."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(x) for x in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def file_hash(path: str | os.PathLike) -> str:
    return "sha256:" + hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]


def _load(path: str | os.PathLike, parse: Callable[[Any, str], T]) -> T:
    return parse(read_json(path), str(path))


# ============================================================================ model description
@dataclass(kw_only=True)
class ModelInfo:
    """Which model a file refers to; runtime, planner and profiler all compare these."""

    name: str
    source: str = "preset"  # "preset" or "path"
    num_layers: int
    hidden_size: int
    vocab_size: int
    tied_embeddings: bool
    dtype: str = "float32"
    architecture: str = ""

    @staticmethod
    def parse(r: Reader) -> "ModelInfo":
        return ModelInfo(
            name=r.str("name"), source=r.str("source", "preset", choices={"preset", "path"}),
            num_layers=r.int("num_layers", min_value=1), hidden_size=r.int("hidden_size", min_value=1),
            vocab_size=r.int("vocab_size", min_value=1), tied_embeddings=r.bool("tied_embeddings"),
            dtype=r.str("dtype", "float32", choices={"float32", "bfloat16", "float16"}),
            architecture=r.str("architecture", ""),
        )


# ============================================================================ layers_<host>.json
# (torchpp profile; fields named as in seed 000 step 1)
LAYERS_KIND, LAYERS_VERSION = "layers", 1


@dataclass(kw_only=True)
class BlockProfile:
    """Measured cost of one block (embed, a decoder layer, or tail) for ``run.batch`` samples."""

    name: str
    index: int | None = None
    """Decoder layer index (None for embed and tail)."""
    param_bytes: int
    activation_bytes_per_sample: int
    """Bytes of the block's output tensor per sample, measured (what crosses a stage boundary
    after it; for the tail, the logits)."""
    forward_time_s: float
    backward_time_s: float
    forward_samples_s: list[float] = field(default_factory=list)
    backward_samples_s: list[float] = field(default_factory=list)

    @staticmethod
    def parse(r: Reader) -> "BlockProfile":
        b = BlockProfile(
            name=r.str("name"), index=r.int("index", None, min_value=0),
            param_bytes=r.int("param_bytes", min_value=0),
            activation_bytes_per_sample=r.int("activation_bytes_per_sample", min_value=0),
            forward_time_s=r.float("forward_time_s", positive=True),
            backward_time_s=r.float("backward_time_s", positive=True),
            forward_samples_s=r.floats("forward_samples_s", []), backward_samples_s=r.floats("backward_samples_s", []),
        )
        for key in ("forward_samples_s", "backward_samples_s"):
            for i, v in enumerate(getattr(b, key)):
                if v <= 0:
                    raise r.fail(f"{key}[{i}]", "a measured time > 0", v)
        return b


@dataclass(kw_only=True)
class RunInfo:
    seq_len: int
    batch: int
    iters: int
    warmup: int
    threads: int
    torch_version: str
    timer: str
    """Which span timer measured the times: "cpp" (torchpp._timer) or "python"."""
    seed: int = 0
    """Seed of the preset's weights and of the synthetic token ids."""
    cpu: str = ""
    """Processor description of the host (informational)."""

    @staticmethod
    def parse(r: Reader) -> "RunInfo":
        return RunInfo(seq_len=r.int("seq_len", min_value=1), batch=r.int("batch", min_value=1),
                       iters=r.int("iters", min_value=1), warmup=r.int("warmup", min_value=0),
                       threads=r.int("threads", min_value=1), torch_version=r.str("torch_version"),
                       timer=r.str("timer", choices={"cpp", "python"}), seed=r.int("seed", 0),
                       cpu=r.str("cpu", ""))


@dataclass(kw_only=True)
class LayersFile:
    """layers_<host>.json: what ``torchpp profile`` measured on one host (seed 000 step 1)."""

    host: str
    model: ModelInfo
    run: RunInfo
    embed_param_bytes: int
    tail_param_bytes: int
    embed: BlockProfile
    tail: BlockProfile
    """Final norm + lm_head + loss."""
    layers: list[BlockProfile]
    step_time_s: float
    """Mean wall time of one profiled forward+backward step (the blocks add up to it)."""
    peak_rss_bytes: int
    """Largest resident set size seen during the profiled steps (psutil, sampled after each
    forward and each backward)."""
    step_samples_s: list[float] = field(default_factory=list)
    """Wall time of each counted step."""
    format: str = f"torchpp.{LAYERS_KIND}/{LAYERS_VERSION}"

    def to_json(self) -> dict[str, Any]:
        d = to_dict(self)
        return {"format": d.pop("format"), **d}

    def save(self, path: str | os.PathLike) -> Path:
        return write_json(path, self.to_json())

    @staticmethod
    def parse(data: Any, source: str) -> "LayersFile":
        check_format(data, source, LAYERS_KIND, [LAYERS_VERSION])
        r = Reader(data, source)
        lf = LayersFile(
            host=r.str("host"), model=ModelInfo.parse(r.obj("model")), run=RunInfo.parse(r.obj("run")),
            embed_param_bytes=r.int("embed_param_bytes", min_value=0),
            tail_param_bytes=r.int("tail_param_bytes", min_value=0),
            embed=BlockProfile.parse(r.obj("embed")), tail=BlockProfile.parse(r.obj("tail")),
            layers=[BlockProfile.parse(x) for x in r.objs("layers", min_len=1)],
            step_time_s=r.float("step_time_s", positive=True), peak_rss_bytes=r.int("peak_rss_bytes", min_value=0),
            step_samples_s=r.floats("step_samples_s", []),
        )
        if len(lf.layers) != lf.model.num_layers:
            raise FormatError(source, "layers", f"{lf.model.num_layers} entries (model.num_layers)", len(lf.layers))
        for i, layer in enumerate(lf.layers):
            if layer.index != i:
                raise FormatError(source, f"layers[{i}].index", str(i), layer.index)
        return lf

    @staticmethod
    def load(path: str | os.PathLike) -> "LayersFile":
        return _load(path, LayersFile.parse)


# ============================================================================ plan.json
PLAN_KIND, PLAN_VERSION = "plan", 1
SCHEDULES = ("1f1b", "gpipe")


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
    index: int
    layers: tuple[int, int]
    """Decoder layer range [start, end)."""
    has_embed: bool
    has_tail: bool
    devices: list[PlanDevice]
    recompute: list[bool]
    """One flag per decoder layer of the stage: recompute its activations in backward."""

    @property
    def ranks(self) -> list[int]:
        return [d.rank for d in self.devices]

    @property
    def num_layers(self) -> int:
        return self.layers[1] - self.layers[0]


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
    strategy: str = "manual"
    predicted: dict[str, Any] | None = None
    inputs: dict[str, str] = field(default_factory=dict)
    format: str = f"torchpp.{PLAN_KIND}/{PLAN_VERSION}"

    @property
    def world_size(self) -> int:
        return sum(len(s.devices) for s in self.stages)

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def stage_of_rank(self, rank: int) -> PlanStage:
        for s in self.stages:
            if rank in s.ranks:
                return s
        raise KeyError(f"rank {rank} is in no stage of the plan")

    def device_of_rank(self, rank: int) -> PlanDevice:
        for d in self.stage_of_rank(rank).devices:
            if d.rank == rank:
                return d
        raise KeyError(rank)

    def to_json(self) -> dict[str, Any]:
        d = to_dict(self)
        d = {"format": d.pop("format"), **d}
        for s in d["stages"]:
            s["layers"] = list(s["layers"])
        return d

    def save(self, path: str | os.PathLike) -> Path:
        validate_plan(self, str(path))
        return write_json(path, self.to_json())

    @staticmethod
    def parse(data: Any, source: str) -> "Plan":
        check_format(data, source, PLAN_KIND, [PLAN_VERSION])
        r = Reader(data, source)
        stages = []
        for sr in r.objs("stages", min_len=1):
            lay = sr.list("layers")
            if len(lay) != 2 or not all(isinstance(x, int) and not isinstance(x, bool) for x in lay):
                raise sr.fail("layers", "[start, end) as two integers", lay)
            devices = [
                PlanDevice(host=dr.str("host"), rank=dr.int("rank", min_value=0),
                           share=dr.float("share", positive=True), samples=dr.int("samples", min_value=0))
                for dr in sr.objs("devices", min_len=1)
            ]
            rec = sr.list("recompute", [False] * max(0, lay[1] - lay[0]))
            if not all(isinstance(x, bool) for x in rec):
                raise sr.fail("recompute", "a list of true/false, one per layer of the stage", rec)
            stages.append(PlanStage(index=sr.int("index", len(stages)), layers=(lay[0], lay[1]),
                                    has_embed=sr.bool("has_embed"), has_tail=sr.bool("has_tail"),
                                    devices=devices, recompute=list(rec)))
        plan = Plan(
            model=ModelInfo.parse(r.obj("model")), seq_len=r.int("seq_len", min_value=1),
            global_batch=r.int("global_batch", min_value=1), micro_batch_size=r.int("micro_batch_size", min_value=1),
            num_microbatches=r.int("num_microbatches", min_value=1),
            schedule=r.str("schedule", choices=set(SCHEDULES)), stages=stages,
            strategy=r.str("strategy", "manual"), predicted=r.raw("predicted", None),
            inputs=dict(r.raw("inputs", {}) or {}),
        )
        validate_plan(plan, source)
        return plan

    @staticmethod
    def load(path: str | os.PathLike) -> "Plan":
        return _load(path, Plan.parse)


def validate_plan(plan: Plan, source: str = "<plan>", world_size: int | None = None,
                  model_layers: int | None = None) -> None:
    """Everything a rank must know to be true before it joins any collective."""
    S = plan.num_stages
    if plan.micro_batch_size * plan.num_microbatches != plan.global_batch:
        raise FormatError(source, "global_batch", f"micro_batch_size × num_microbatches = "
                          f"{plan.micro_batch_size} × {plan.num_microbatches} = "
                          f"{plan.micro_batch_size * plan.num_microbatches}", plan.global_batch)
    expect = 0
    ranks: list[int] = []
    for i, s in enumerate(plan.stages):
        p = f"stages[{i}]"
        if s.index != i:
            raise FormatError(source, f"{p}.index", f"{i} (stages listed in pipeline order)", s.index)
        a, b = s.layers
        if a != expect or b < a:
            raise FormatError(source, f"{p}.layers", f"[{expect}, end) with end >= {expect} "
                              "(stages cover the decoder layers contiguously)", [a, b])
        expect = b
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
        ranks += s.ranks
    if expect != plan.model.num_layers:
        raise FormatError(source, f"stages[{S - 1}].layers", f"to end at model.num_layers="
                          f"{plan.model.num_layers}", list(plan.stages[-1].layers))
    if sorted(ranks) != list(range(len(ranks))):
        raise FormatError(source, "stages[*].devices[*].rank", f"each of 0..{len(ranks) - 1} exactly once",
                          sorted(ranks))
    if world_size is not None and world_size != len(ranks):
        raise FormatError(source, "stages[*].devices", f"{world_size} device(s) in total to match the "
                          f"world size {world_size}", len(ranks))
    if model_layers is not None and model_layers != plan.model.num_layers:
        raise FormatError(source, "model.num_layers", f"{model_layers} (the layers of the model being "
                          "trained; see --layers)", plan.model.num_layers)


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


# ============================================================================ capacities / bandwidth / memory model / devices
# --- owned by the planner ---
BANDWIDTH_KIND, BANDWIDTH_VERSION = "bandwidth", 1


@dataclass(kw_only=True)
class Bandwidth:
    """bandwidth.json: directed link rates ``"src|dst" -> bytes/s`` (and optional latency)."""

    bytes_per_sec: dict[str, float]
    latency_s: dict[str, float] = field(default_factory=dict)
    source: str = ""
    """Where the numbers came from (an iperf3 CSV, ``torchpp bandwidth probe``, an estimate)."""
    format: str = f"torchpp.{BANDWIDTH_KIND}/{BANDWIDTH_VERSION}"

    @staticmethod
    def key(src: str, dst: str) -> str:
        return f"{src}|{dst}"

    def rate(self, src: str, dst: str) -> float:
        k = self.key(src, dst)
        if k not in self.bytes_per_sec:
            raise KeyError(f"bandwidth: no link {k!r} (known: {', '.join(sorted(self.bytes_per_sec)) or 'none'})")
        return self.bytes_per_sec[k]

    def latency(self, src: str, dst: str) -> float:
        return self.latency_s.get(self.key(src, dst), 0.0)

    def hosts(self) -> list[str]:
        return sorted({h for k in self.bytes_per_sec for h in k.split("|")})

    def to_json(self) -> dict[str, Any]:
        d = to_dict(self)
        return {"format": d.pop("format"), **d}

    def save(self, path: str | os.PathLike) -> Path:
        return write_json(path, self.to_json())

    @staticmethod
    def parse(data: Any, source: str) -> "Bandwidth":
        check_format(data, source, BANDWIDTH_KIND, [BANDWIDTH_VERSION])
        r = Reader(data, source)
        rates, lats = r.obj("bytes_per_sec"), r.obj("latency_s", {})
        for sub, name, positive in ((rates, "bytes_per_sec", True), (lats, "latency_s", False)):
            for k in sub.data:
                if not isinstance(k, str) or k.count("|") != 1 or "" in k.split("|"):
                    raise FormatError(source, f"{name}.{k}", "a key of the form 'src|dst'")
                sub.float(k, positive=positive, min_value=None if positive else 0.0)
        return Bandwidth(bytes_per_sec={k: float(v) for k, v in rates.data.items()},
                         latency_s={k: float(v) for k, v in lats.data.items()}, source=r.str("source", ""))

    @staticmethod
    def load(path: str | os.PathLike) -> "Bandwidth":
        return _load(path, Bandwidth.parse)


# ============================================================================ simulator configuration
# --- owned by the simulator ---


# ============================================================================ traces
TRACE_KIND, TRACE_VERSION = "trace", 1
