"""Versioned JSON records shared by every torchpp command.

Every file carries ``"format": "torchpp.<kind>/<version>"``. Loading checks the format and
each field, and a failure names the file, the field and what was expected, so a bad input
is reported before any rank blocks in a collective. This module imports nothing else of
torchpp but ``validate`` (the ranges shared with the command line; imports flow down the
DESIGN.md layout list).
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

from . import validate as V

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

    def int(self, key: str, default: Any = dataclasses.MISSING, min_value: int | None = None,
            max_value: int | None = None) -> int:
        v = self.raw(key, default)
        if v is default and default is not dataclasses.MISSING:
            return v
        if isinstance(v, bool) or not isinstance(v, int):
            raise FormatError(self.source, self._p(key), "an integer", v)
        if min_value is not None and v < min_value:
            raise FormatError(self.source, self._p(key), f"an integer >= {min_value}", v)
        if max_value is not None and v > max_value:
            raise FormatError(self.source, self._p(key), f"an integer <= {max_value}", v)
        return v

    def float(self, key: str, default: Any = dataclasses.MISSING, min_value: float | None = None,
              positive: bool = False, max_value: float | None = V.MAX_NUMBER) -> float:
        v = self.raw(key, default)
        if v is default and default is not dataclasses.MISSING:
            return v
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise FormatError(self.source, self._p(key), "a finite number", v)
        if positive and v <= 0:
            raise FormatError(self.source, self._p(key), "a number > 0", v)
        if min_value is not None and v < min_value:
            raise FormatError(self.source, self._p(key), f"a number >= {min_value}", v)
        if max_value is not None and v > max_value:
            raise FormatError(self.source, self._p(key), f"a number <= {max_value:g}", v)
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

    def ints(self, key: str, default: Any = dataclasses.MISSING) -> list[int]:
        items = self.list(key, default)
        for i, x in enumerate(items):
            if isinstance(x, bool) or not isinstance(x, int):
                raise FormatError(self.source, f"{self._p(key)}[{i}]", "an integer", x)
        return list(items)

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
        return json.loads(p.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise FormatError(str(p), "<file>", f"UTF-8 JSON text ({e.reason} at byte {e.start})") from None
    except RecursionError:
        raise FormatError(str(p), "<file>", "JSON nested at most a few hundred levels deep") from None
    except json.JSONDecodeError as e:
        raise FormatError(str(p), "<file>", f"valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None


def write_json(path: str | os.PathLike, data: Any) -> Path:
    """Write atomically (temp file + rename) so a crash never leaves half a file.

    NaN and infinities are refused (``allow_nan=False``): JSON has no spelling for them and
    every loader here refuses ``NaN``/``Infinity``, so torchpp never writes what it cannot read.
    """
    p = V.output_file(path, str(path))
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=False, default=_json_default, allow_nan=False)
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
    autocast: str = ""
    """Mixed precision: compute dtype under ``torch.autocast`` ("" none, "bfloat16"); the weights
    and optimizer state stay in ``dtype`` (float32 master weights)."""

    @property
    def precision(self) -> str:
        """What ``--dtype`` of profile and plan names: the autocast dtype, else the weights'."""
        return self.autocast or self.dtype

    @staticmethod
    def parse(r: Reader) -> "ModelInfo":
        return ModelInfo(
            name=r.str("name"), source=r.str("source", "preset", choices={"preset", "path"}),
            num_layers=r.int("num_layers", min_value=1, max_value=V.MAX_LAYERS),
            hidden_size=r.int("hidden_size", min_value=1, max_value=1 << 20),
            vocab_size=r.int("vocab_size", min_value=1, max_value=1 << 24), tied_embeddings=r.bool("tied_embeddings"),
            dtype=r.str("dtype", "float32", choices={"float32", "bfloat16", "float16"}),
            architecture=r.str("architecture", ""),
            autocast=r.str("autocast", "", choices={"", "bfloat16"}),
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
    forward_fixed_s: float = 0.0
    """Seconds per call that do not grow with the samples (kernel launch, Python, small
    matmuls): the intercept of ``t(b) = fixed + b * per_sample`` fitted over ``run.batches``;
    0 when one batch size was measured. On small CPU models it is a large part of a
    micro-batch's time, which is why pricing by samples alone favours too-small micro-batches."""
    backward_fixed_s: float = 0.0
    backward_input_time_s: float | None = None
    """Part of ``backward_time_s`` computing the input gradient alone (``torch.autograd.grad`` on
    the inputs; the rest is the weight gradient). Optional: when absent, zero-bubble schedules
    are priced with the backward split in halves (and the plan says so)."""
    batch_times_s: list[list[float]] = field(default_factory=list)
    """``[batch, forward_s, backward_s]`` for every measured batch size (means)."""

    @staticmethod
    def parse(r: Reader) -> "BlockProfile":
        b = BlockProfile(
            name=r.str("name"), index=r.int("index", None, min_value=0),
            param_bytes=r.int("param_bytes", min_value=0, max_value=V.MAX_BYTES),
            activation_bytes_per_sample=r.int("activation_bytes_per_sample", min_value=0, max_value=V.MAX_BYTES),
            forward_time_s=r.float("forward_time_s", positive=True),
            backward_time_s=r.float("backward_time_s", positive=True),
            forward_samples_s=r.floats("forward_samples_s", []), backward_samples_s=r.floats("backward_samples_s", []),
            forward_fixed_s=r.float("forward_fixed_s", 0.0, min_value=0.0),
            backward_fixed_s=r.float("backward_fixed_s", 0.0, min_value=0.0),
            backward_input_time_s=r.float("backward_input_time_s", None, positive=True),
            batch_times_s=_batch_rows(r),
        )
        if b.backward_input_time_s is not None and b.backward_input_time_s > b.backward_time_s:
            raise r.fail("backward_input_time_s", f"at most backward_time_s={b.backward_time_s}",
                         b.backward_input_time_s)
        if b.forward_fixed_s > b.forward_time_s or b.backward_fixed_s > b.backward_time_s:
            raise r.fail("forward_fixed_s", "at most forward_time_s / backward_time_s (the time at run.batch)",
                         (b.forward_fixed_s, b.backward_fixed_s))
        for key in ("forward_samples_s", "backward_samples_s"):
            for i, v in enumerate(getattr(b, key)):
                if v <= 0:
                    raise r.fail(f"{key}[{i}]", "a measured time > 0", v)
        return b


def _batch_rows(r: Reader) -> list[list[float]]:
    rows = r.list("batch_times_s", [])
    for i, row in enumerate(rows):
        ok = isinstance(row, list) and len(row) == 3 and all(
            isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in row)
        if not ok or row[0] < 1 or row[1] <= 0 or row[2] <= 0:
            raise r.fail(f"batch_times_s[{i}]", "[batch >= 1, forward_s > 0, backward_s > 0]", row)
    return [[float(x) for x in row] for row in rows]


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
    batches: list[int] = field(default_factory=list)
    """Every batch size measured (``batch`` is the largest; its means are the block times)."""

    @staticmethod
    def parse(r: Reader) -> "RunInfo":
        return RunInfo(seq_len=r.int("seq_len", min_value=1, max_value=V.MAX_SEQ_LEN),
                       batch=r.int("batch", min_value=1, max_value=V.MAX_GLOBAL_BATCH),
                       batches=r.ints("batches", []),
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
    call_overhead_s: float = 0.0
    """Seconds the pipeline runtime spends between two compute calls of a stage on this host
    (dispatching, posting messages) beyond waiting for data; measured by ``torchpp profile``'s call
    probe (0 with ``--no-call-probe`` or when the probe failed) and from a run's timelines by
    ``torchpp replan``. The cost model adds it to every forward and backward."""
    optimizer_s_per_byte: float | None = None
    """Seconds per parameter byte of one optimizer step as the runtime takes it (its optimizer,
    fused where torch has it, the global gradient norm), timed by ``torchpp profile`` over the
    profiled model's parameters. Optional: None (absent) = not measured (files before it)."""
    backward_split_factor: float | None = None
    """Seconds of a backward split as zero-bubble schedules run it (the input gradient ``I``, then
    the weight gradients ``W``: two passes over the graph) per second of the same backward in one
    pass, measured by ``torchpp profile`` on the profiled host. The cost model scales ``I`` and
    ``W`` by it. Optional: None (absent) = not measured (priced as 1)."""
    backward_split_layer_s: float | None = None
    """Seconds each decoder layer adds to one split backward call (``I + W``) beyond
    ``backward_split_factor`` times the backward (the deferred weight products' bookkeeping,
    ``models.deferred``), a cost per call rather than per sample. Measured with the factor at two
    batch sizes. Optional: None (absent) = not measured (priced as 0)."""
    format: str = f"torchpp.{LAYERS_KIND}/{LAYERS_VERSION}"

    def to_json(self) -> dict[str, Any]:
        d = to_dict(self)
        for b in (d["embed"], d["tail"], *d["layers"]):
            if b.get("backward_input_time_s") is None:
                b.pop("backward_input_time_s", None)
        for key in ("optimizer_s_per_byte", "backward_split_factor", "backward_split_layer_s"):
            if d.get(key) is None:
                d.pop(key, None)
        return {"format": d.pop("format"), **d}

    def save(self, path: str | os.PathLike) -> Path:
        return write_json(path, self.to_json())

    @staticmethod
    def parse(data: Any, source: str) -> "LayersFile":
        check_format(data, source, LAYERS_KIND, [LAYERS_VERSION])
        r = Reader(data, source)
        lf = LayersFile(
            model=ModelInfo.parse(r.obj("model")), run=RunInfo.parse(r.obj("run")),
            host=V_host(r, "host"),
            embed_param_bytes=r.int("embed_param_bytes", min_value=0, max_value=V.MAX_BYTES),
            tail_param_bytes=r.int("tail_param_bytes", min_value=0, max_value=V.MAX_BYTES),
            embed=BlockProfile.parse(r.obj("embed")), tail=BlockProfile.parse(r.obj("tail")),
            layers=[BlockProfile.parse(x) for x in r.objs("layers", min_len=1)],
            step_time_s=r.float("step_time_s", positive=True), peak_rss_bytes=r.int("peak_rss_bytes", min_value=0),
            step_samples_s=r.floats("step_samples_s", []),
            call_overhead_s=r.float("call_overhead_s", 0.0, min_value=0.0),
            optimizer_s_per_byte=r.float("optimizer_s_per_byte", None, positive=True),
            backward_split_factor=r.float("backward_split_factor", None, positive=True),
            backward_split_layer_s=r.float("backward_split_layer_s", None, min_value=0.0, max_value=1e3),
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
PLAN_KIND, PLAN_VERSION = "plan", 2
SCHEDULES = ("1f1b", "gpipe")
"""The one-chunk-per-device schedules of plan format 1 (and of the simulator's parametric plans)."""
PLACEMENTS = {"1f1b": "single", "gpipe": "single", "zb-h1": "single",
              "interleaved": "interleaved", "interleaved-zb": "interleaved", "v": "v", "zbv": "v"}
"""Every schedule kind of a plan and the placement of chunks on devices it runs on:
``single``: one chunk per device; ``interleaved``: chunk c on the devices of chunk c mod p
(v chunks each); ``v``: chunks c and 2p-1-c on one device (the first and last chunk together)."""
PLAN_SCHEDULES = tuple(PLACEMENTS)


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
    predicted: dict[str, Any] | None = None
    inputs: dict[str, str] = field(default_factory=dict)
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
        for s in d["stages"]:
            s["layers"] = list(s["layers"])
        return d

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
            global_batch=r.int("global_batch", min_value=1, max_value=V.MAX_GLOBAL_BATCH),
            micro_batch_size=r.int("micro_batch_size", min_value=1, max_value=V.MAX_GLOBAL_BATCH),
            num_microbatches=r.int("num_microbatches", min_value=1, max_value=V.MAX_MICROBATCHES),
            schedule=r.str("schedule", choices=set(SCHEDULES if version == 1 else PLAN_SCHEDULES)), stages=stages,
            strategy=r.str("strategy", "manual"), predicted=_predicted(r), inputs=_inputs(r),
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
                     has_tail=sr.bool("has_tail"), devices=devices, recompute=list(rec))


def V_host(r: Reader, key: str) -> str:
    """A host name field: safe in file names and link keys (``validate.host_name``)."""
    v = r.str(key)
    try:
        return V.host_name(v, key)
    except ValueError as e:
        raise r.fail(key, e.args[0].partition("expected ")[2].rpartition(", got")[0], v) from None


def _inputs(r: Reader) -> dict[str, str]:
    """``inputs``: which file each input was and its hash (``{"bandwidth": "sha256:..."}``)."""
    v = r.raw("inputs", {}) or {}
    if not isinstance(v, Mapping) or not all(isinstance(k, str) and isinstance(x, str) for k, x in v.items()):
        raise r.fail("inputs", "an object of strings (input name -> file hash)", v)
    return dict(v)


def _predicted(r: Reader) -> dict[str, Any] | None:
    v = r.raw("predicted", None)
    if v is not None and not isinstance(v, Mapping):
        raise r.fail("predicted", "an object (the planner's prediction) or null", v)
    return None if v is None else dict(v)


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


def _check_plan_sizes(plan: Plan, source: str) -> None:
    """Sizes within ``validate``'s limits (a plan written by hand, or a planner asked for too much)."""
    for key, v, lo, hi in (("seq_len", plan.seq_len, 1, V.MAX_SEQ_LEN),
                           ("global_batch", plan.global_batch, 1, V.MAX_GLOBAL_BATCH),
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


# ============================================================================ capacities / bandwidth / memory model / devices
# --- owned by the planner ---
BANDWIDTH_KIND, BANDWIDTH_VERSION = "bandwidth", 1


def _is_link_key(k: Any) -> bool:
    return isinstance(k, str) and k.count("|") == 1 and "" not in k.split("|")


@dataclass(kw_only=True)
class Bandwidth:
    """bandwidth.json: directed link rates ``"src|dst" -> bytes/s`` (and optional latency).

    Also reads seed 000's ``bandwidth_matrix.json`` (a bare ``{"src|dst": bytes_per_sec}`` map).
    """

    bytes_per_sec: dict[str, float]
    latency_s: dict[str, float] = field(default_factory=dict)
    source: str = ""
    """Where the numbers came from (an iperf3 CSV, ``torchpp bandwidth probe``, an estimate)."""
    format: str = f"torchpp.{BANDWIDTH_KIND}/{BANDWIDTH_VERSION}"

    @staticmethod
    def key(src: str, dst: str) -> str:
        return f"{src}|{dst}"

    def has(self, src: str, dst: str) -> bool:
        return self.key(src, dst) in self.bytes_per_sec

    def rate(self, src: str, dst: str) -> float:
        k = self.key(src, dst)
        if k not in self.bytes_per_sec:
            raise KeyError(f"bandwidth: no link {k!r} (known: {', '.join(sorted(self.bytes_per_sec)) or 'none'})")
        return self.bytes_per_sec[k]

    def latency(self, src: str, dst: str) -> float:
        return self.latency_s.get(self.key(src, dst), 0.0)

    def hosts(self) -> list[str]:
        return sorted({h for k in self.bytes_per_sec for h in k.split("|")})

    def missing_links(self, hosts: Iterable[str]) -> list[str]:
        """Directed links between distinct ``hosts`` that have no rate."""
        hs = list(hosts)
        return [self.key(a, b) for a in hs for b in hs if a != b and not self.has(a, b)]

    def to_json(self) -> dict[str, Any]:
        d = to_dict(self)
        return {"format": d.pop("format"), **d}

    def save(self, path: str | os.PathLike) -> Path:
        data = self.to_json()
        Bandwidth.parse(data, f"{path} (being written)")
        return write_json(path, data)

    @staticmethod
    def parse(data: Any, source: str) -> "Bandwidth":
        if isinstance(data, Mapping) and "format" not in data and data and all(_is_link_key(k) for k in data):
            data = {"format": f"torchpp.{BANDWIDTH_KIND}/{BANDWIDTH_VERSION}", "bytes_per_sec": dict(data),
                    "source": "seed bandwidth_matrix.json"}
        check_format(data, source, BANDWIDTH_KIND, [BANDWIDTH_VERSION])
        r = Reader(data, source)
        rates, lats = r.obj("bytes_per_sec"), r.obj("latency_s", {})
        for sub, name, positive in ((rates, "bytes_per_sec", True), (lats, "latency_s", False)):
            for k in sub.data:
                try:
                    V.link_key(k, f"{name}.{k}")
                except ValueError as e:
                    raise FormatError(source, f"{name}.{k}", str(e).partition(": expected ")[2] or str(e)) from None
                sub.float(k, positive=positive, min_value=None if positive else 0.0,
                          max_value=V.MAX_RATE if positive else V.MAX_SECONDS)
        return Bandwidth(bytes_per_sec={k: float(v) for k, v in rates.data.items()},
                         latency_s={k: float(v) for k, v in lats.data.items()}, source=r.str("source", ""))

    @staticmethod
    def load(path: str | os.PathLike) -> "Bandwidth":
        return _load(path, Bandwidth.parse)


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
    format: str = f"torchpp.{CAPACITIES_KIND}/{CAPACITIES_VERSION}"

    def to_json(self) -> dict[str, Any]:
        d = to_dict(self)
        for key in ("optimizer_s_per_byte", "backward_split_factor", "backward_split_layer_s", "rounds"):
            if not d[key]:
                d.pop(key)
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
            tables[h] = HostTable(batch=t.int("batch", min_value=1), forward_time_s=fw, backward_time_s=bw,
                                  forward_fixed_s=f0, backward_fixed_s=b0)
        co = r.obj("call_overhead_s", {})
        call = {_device_host(source, h): co.float(h, min_value=0.0, max_value=1e3) for h in co.data}
        return Capacities(ref_host=ref, capacity=capacity, tables=tables, call_overhead_s=call,
                          optimizer_s_per_byte=_host_rates(r, "optimizer_s_per_byte", capacity),
                          backward_split_factor=_host_rates(r, "backward_split_factor", capacity),
                          backward_split_layer_s=_host_rates(r, "backward_split_layer_s", capacity, zero=True),
                          rounds=_capacity_rounds(r, capacity))

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


MEMORY_KIND, MEMORY_VERSION = "memory_model", 1
MEMORY_ORDERS = ("fb", "gpipe", "zb")
"""Probe orders of a memory sample (``MemorySample.order``); optional fields keep version 1."""


@dataclass(kw_only=True)
class MemorySample:
    """One calibration span [start, end) of decoder layers and the peak RSS increase it caused."""

    start: int
    end: int
    has_embed: bool
    has_tail: bool
    weights_bytes: int
    activation_bytes_per_sample: int
    """The span's blocks' output bytes per sample as the memory model counts them (the embedding's
    0: ``cost.memory.held_activation_bytes``; files written before counted it)."""
    batch: int
    peak_bytes: int
    predicted_bytes: float = 0.0
    process_bytes: int = 0
    """RSS of the span's process before its model was built (the torch runtime)."""
    tail_activation_bytes_per_sample: int = 0
    """The part of ``activation_bytes_per_sample`` that is the tail's output (the logits)."""
    end_weights_bytes: int = 0
    """Parameter bytes of the span's tail (the lm_head: ``Ke``'s term), 0 without it. Files
    written before the embedding added its gradient in place counted the embedding here too."""
    microbatches: int = 1
    """Micro-batches whose gradients each probed step accumulated (a pipeline rank's regime from 2 on)."""
    order: str = "fb"
    """How the probe ran them: ``fb`` each forward then its full backward (one held at a time),
    ``gpipe`` every forward, then every full backward (all ``microbatches`` held at once: what
    ``Kb`` is fitted on), ``zb`` one ZB-H1 stage's own order of F, I and W (what ``Kw`` and
    ``Kz`` are fitted on)."""
    held: int | None = None
    """``zb``: micro-batches held at the peak of the probe's order (read off it); None: all
    ``microbatches`` (files before it)."""
    past_input: int | None = None
    """``zb``: of those, the ones past their I; None: ``microbatches − 1`` (files before it)."""
    kept_ratio: float | None = None
    """``zb``: bytes a micro-batch keeps past its I over the bytes its graph saved (live tensors,
    counted by the probe); None: not measured."""
    layer_activation_bytes_per_sample: int = 0
    """Activation bytes per sample of the span's largest decoder layer (what ``Kl`` multiplies);
    0 (files before it): no such term."""


@dataclass(kw_only=True)
class MemoryModel:
    """memory_model.json (seed 000 step 4): ``peak ≈ base + alpha·Σweights + Kp·Σactivation·B``.

    Fitted on one forward+backward+optimizer step per span; a stage keeps several micro-batches
    of activations in flight, so the planner multiplies the activation term by that count
    (``torchpp.cost.StageMemory`` prices a stage with it).
    """

    base: float
    alpha: float
    Kp: float
    r2: float = float("nan")
    residuals: list[float] = field(default_factory=list)
    samples: list[MemorySample] = field(default_factory=list)
    host: str = ""
    model: str = ""
    microbatch: int = 0
    process_bytes: float = 0.0
    """Median RSS of the calibration processes before a model was built: what the torch runtime
    itself takes on a device, which the planner reserves from every device's budget."""
    Kt: float | None = None
    """Bytes held per byte of the tail's output (the logits) per sample. A decoder layer keeps
    tens of tensors the size of its output for backward, the tail a copy or two of its logits,
    so one factor for both over- or under-counts whichever stage holds the tail; ``None``
    (files without it) means ``Kp``."""
    Ke: float | None = None
    """Bytes held per byte of a stage's tail (the lm_head, one large tensor): from a rank's
    second micro-batch on, its fresh weight gradient is computed beside the accumulated one
    before it is added in; for a decoder layer's small matrices this is lost in ``alpha``, and
    the embedding adds its gradient in place (``models.embedding``). ``None`` (files
    without it): no such term."""
    Kw: float | None = None
    """Bytes per byte of kept activations (weighted as ``Kp``'s) per sample that a micro-batch
    holds between its input gradient (I) and its weight gradient (W) beyond ``Kp``: negative, as
    the input pass frees its graph and keeps only the linear layers' inputs and output gradients
    for W (``models.deferred``); at least ``−Kp``. Files fitted before that runtime hold a
    positive one. ``None`` (files without it, or calibrated without zero-bubble probes): no such term."""
    Kwt: float | None = None
    """Bytes per byte of the tail's logits per sample beyond ``Kt``, for each micro-batch between its
    I and its W (the logits' gradient the lm_head's W reads, in place of the loss's graph): fitted
    apart from ``Kw`` when zero-bubble probes with and without the tail were run. ``None``: the
    logits count in ``Kw``'s term weighted as ``Kt / Kp``."""
    Kb: float | None = None
    """Bytes per byte of a stage's embedding and layer activations (per sample) held once however
    many micro-batches are in flight: what one backward adds while it runs (the gradients
    flowing through the layers). ``Kp`` is then what each held micro-batch keeps. Fitted from
    probes holding several micro-batches at once (order ``gpipe``); ``None`` (files without it):
    no such term, and ``Kp`` counts it once per held micro-batch."""
    Kz: float | None = None
    """Bytes per byte of a stage's embedding and layer activations (per sample) held once by a
    device running a split backward with a micro-batch past its I at its peak: what the heap
    keeps beyond the live tensors when I and W interleave with the forwards (the stashed
    gradients freed by W out of order). Fitted, given ``Kw``, on zero-bubble probes at several
    positions; ``None`` (files without it): no such term."""
    Kl: float | None = None
    """Bytes per byte of the largest decoder layer's activations (per sample) held once by a
    device, however many layers and micro-batches it holds: the transients of the one layer whose
    forward or backward is running (its intermediate products, the gradients it builds before
    they flow on). Without it the intercept ``base`` absorbs them at the probes' mean batch, which
    over-priced one-layer spans at a small batch by 10-25%. ``None`` (files without it): no such term."""
    format: str = f"torchpp.{MEMORY_KIND}/{MEMORY_VERSION}"

    @property
    def tail_factor(self) -> float:
        return self.Kp if self.Kt is None else self.Kt

    def to_json(self) -> dict[str, Any]:
        d = to_dict(self)
        d = {"format": d.pop("format"), **d}
        if not math.isfinite(d["r2"]):
            d["r2"] = None
        return d

    def save(self, path: str | os.PathLike) -> Path:
        return write_json(path, self.to_json())

    @staticmethod
    def parse(data: Any, source: str) -> "MemoryModel":
        if isinstance(data, Mapping) and "format" not in data and {"base", "alpha", "Kp"} <= set(data):
            data = {**data, "format": f"torchpp.{MEMORY_KIND}/{MEMORY_VERSION}"}  # seed 000's file
        check_format(data, source, MEMORY_KIND, [MEMORY_VERSION])
        r = Reader(data, source)
        samples = []
        for sr in r.objs("samples", []):
            samples.append(MemorySample(
                start=sr.int("start", min_value=0), end=sr.int("end", min_value=0),
                has_embed=sr.bool("has_embed", False), has_tail=sr.bool("has_tail", False),
                weights_bytes=sr.int("weights_bytes", min_value=0),
                activation_bytes_per_sample=sr.int("activation_bytes_per_sample", min_value=0),
                batch=sr.int("batch", min_value=1), peak_bytes=sr.int("peak_bytes"),
                predicted_bytes=sr.float("predicted_bytes", 0.0), process_bytes=sr.int("process_bytes", 0, min_value=0),
                tail_activation_bytes_per_sample=sr.int("tail_activation_bytes_per_sample", 0, min_value=0),
                end_weights_bytes=sr.int("end_weights_bytes", 0, min_value=0),
                microbatches=sr.int("microbatches", 1, min_value=1),
                order=sr.str("order", "fb", choices=MEMORY_ORDERS),
                held=None if sr.raw("held", None) is None else sr.int("held", min_value=1),
                past_input=None if sr.raw("past_input", None) is None else sr.int("past_input", min_value=0),
                kept_ratio=None if sr.raw("kept_ratio", None) is None else sr.float("kept_ratio", min_value=0.0,
                                                                                     max_value=10.0),
                layer_activation_bytes_per_sample=sr.int("layer_activation_bytes_per_sample", 0, min_value=0)))
        r2 = r.raw("r2", None)
        return MemoryModel(base=r.float("base", min_value=0.0, max_value=V.MAX_BYTES),
                           alpha=r.float("alpha", min_value=0.0, max_value=1e6), Kp=r.float("Kp", min_value=0.0, max_value=1e6),
                           r2=float("nan") if r2 is None else r.float("r2"), residuals=r.floats("residuals", []),
                           samples=samples, host=r.str("host", ""), model=r.str("model", ""),
                           microbatch=r.int("microbatch", 0, min_value=0),
                           process_bytes=r.float("process_bytes", 0.0, min_value=0.0),
                           Kt=None if r.raw("Kt", None) is None else r.float("Kt", min_value=0.0),
                           Ke=None if r.raw("Ke", None) is None else r.float("Ke", min_value=0.0, max_value=1e6),
                           Kw=None if r.raw("Kw", None) is None else r.float("Kw", min_value=-1e6, max_value=1e6),
                           Kb=None if r.raw("Kb", None) is None else r.float("Kb", min_value=0.0, max_value=1e6),
                           Kwt=None if r.raw("Kwt", None) is None else r.float("Kwt", min_value=-1e6, max_value=1e6),
                           Kz=None if r.raw("Kz", None) is None else r.float("Kz", min_value=0.0, max_value=1e6),
                           Kl=None if r.raw("Kl", None) is None else r.float("Kl", min_value=0.0, max_value=1e6))

    @staticmethod
    def load(path: str | os.PathLike) -> "MemoryModel":
        return _load(path, MemoryModel.parse)


@dataclass(kw_only=True)
class DeviceInfo:
    host: str
    memory_bytes: int
    address: str = ""
    rank: int | None = None


@dataclass(kw_only=True)
class Devices:
    """devices.json: ``{"host": memory_gb}`` (seed 000) or ``{"host": {"memory_gb", "address", "rank"}}``."""

    devices: dict[str, DeviceInfo]

    @property
    def hosts(self) -> list[str]:
        return list(self.devices)

    def memory_bytes(self, host: str) -> int:
        return self.devices[host].memory_bytes

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for h, d in self.devices.items():
            e: dict[str, Any] = {"memory_gb": d.memory_bytes / GB}
            if d.address:
                e["address"] = d.address
            if d.rank is not None:
                e["rank"] = d.rank
            out[h] = e
        return out

    def save(self, path: str | os.PathLike) -> Path:
        return write_json(path, self.to_json())

    @staticmethod
    def parse(data: Any, source: str) -> "Devices":
        r = Reader(data, source)
        out: dict[str, DeviceInfo] = {}
        for h, v in r.data.items():
            if h == "format":
                continue
            if isinstance(v, Mapping):
                dr = r.obj(h)
                _device_host(source, h)
                gb = dr.float("memory_gb", positive=True, max_value=V.MAX_MEMORY_GB)
                rank = dr.int("rank", None, min_value=0)
                out[h] = DeviceInfo(host=h, memory_bytes=int(gb * GB), address=dr.str("address", ""), rank=rank)
            else:
                _device_host(source, h)
                out[h] = DeviceInfo(host=h, memory_bytes=int(r.float(h, positive=True, max_value=V.MAX_MEMORY_GB) * GB))
        if not out:
            raise FormatError(source, "<root>", "at least one host")
        ranks = [d.rank for d in out.values() if d.rank is not None]
        if len(set(ranks)) != len(ranks):
            raise FormatError(source, "*.rank", "distinct ranks", sorted(ranks))
        return Devices(devices=out)

    @staticmethod
    def load(path: str | os.PathLike) -> "Devices":
        return _load(path, Devices.parse)


GB = 1 << 30
"""devices.json counts memory in GiB (seed 000's ``"cpu1": 24``)."""


def _device_host(source: str, h: str) -> str:
    """A host named by a key (devices.json, capacities.json): safe in file names and link keys."""
    try:
        return V.host_name(h, h)
    except ValueError:
        raise FormatError(source, h, "a host name of letters, digits, '.', '_' or '-' (no '..')") from None


# ============================================================================ simulator configuration
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
        step = r.float("priority_step", 0.1, positive=True)
        if step > 1 or abs(round(1 / step) * step - 1) > 1e-9:
            raise FormatError(source, "priority_step", "a step that divides 1 (e.g. 0.1, 0.25)", step)
        settings = SimSettings.parse(r.obj("settings", {}))
        return ExperimentConfig(grid=grid, settings=settings, priority_step=step)

    @staticmethod
    def load(path: str | os.PathLike) -> "ExperimentConfig":
        return _load(path, ExperimentConfig.parse)


# ============================================================================ traces
TRACE_KIND, TRACE_VERSION = "trace", 1


def check_trace(data: Any, source: str) -> dict[str, Any]:
    """A Chrome trace torchpp can analyse: a known format, and ``X`` events whose times are finite
    numbers with durations >= 0 (a NaN or negative span would silently skew every bubble term)."""
    r = Reader(data, source)
    if "format" in r.data:
        check_format(data, source, TRACE_KIND, [TRACE_VERSION])
    events = r.list("traceEvents")
    for i, ev in enumerate(events):
        if not isinstance(ev, Mapping):
            raise FormatError(source, f"traceEvents[{i}]", "an event object", ev)
        if ev.get("ph") != "X":
            continue
        e = Reader(ev, source, f"traceEvents[{i}]")
        e.float("ts", min_value=-V.MAX_SECONDS * 1e6, max_value=V.MAX_SECONDS * 1e6)
        e.float("dur", 0.0, min_value=0.0, max_value=V.MAX_SECONDS * 1e6)
        e.int("pid", min_value=0, max_value=V.MAX_STAGES)
        a = e.obj("args", {})
        for key in ("stage", "microbatch"):
            if a.has(key):
                a.int(key, min_value=0, max_value=V.MAX_STAGES if key == "stage" else V.MAX_MICROBATCHES)
        if a.has("bytes"):
            a.int("bytes", min_value=0, max_value=V.MAX_BYTES)
        for key in ("recompute_s", "blocked_s"):
            if a.has(key):
                a.float(key, min_value=0.0)
    meta = r.obj("metadata", {})
    for rank, m in (meta.obj("ranks", {}).data or {}).items():
        mr = meta.obj("ranks").obj(rank)
        if not str(rank).isdigit():
            raise mr.fail("", "ranks keyed by rank number", rank)
        for key in ("peak_rss_bytes", "base_rss_bytes"):
            if mr.has(key):
                mr.int(key, min_value=0, max_value=V.MAX_BYTES)
    return data


def trace_plan_hashes(data: Mapping[str, Any]) -> set[str]:
    """The ``plan_hash`` values a trace names (merged timelines carry each rank's metadata)."""
    meta = data.get("metadata") or {}
    found = {meta.get("plan_hash")}
    ranks = meta.get("ranks") if isinstance(meta.get("ranks"), Mapping) else {}
    found |= {m.get("plan_hash") for m in ranks.values() if isinstance(m, Mapping)}
    return {h for h in found if isinstance(h, str)}
