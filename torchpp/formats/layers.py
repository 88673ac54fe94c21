"""layers_<host>.json: a host's measured per-block profile (``torchpp profile``)."""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import validate as V
from .base import FormatError, Reader, V_host, _load, check_format, to_dict, write_json


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
    path: str = ""
    """A local checkpoint directory (source "path"): its absolute path where the file was written, so
    ``torchpp.train --plan`` finds the model without ``--model`` ("" in older files and for presets)."""
    config_hash: str = ""
    """``sha256:`` of that directory's config.json (its settings, not its bytes): the model's identity,
    which ``torchpp.train`` checks whatever path the model is given by ("" in older files, presets)."""

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
            path=r.str("path", ""), config_hash=_config_hash(r),
        )


def _config_hash(r: Reader) -> str:
    v = r.str("config_hash", "")
    if v and not (v.startswith("sha256:") and len(v) > 7 and all(c in "0123456789abcdef" for c in v[7:])):
        raise r.fail("config_hash", "'sha256:' and hexadecimal digits, or absent", v)
    return v


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
    def parse(r: Reader, measured: bool = True) -> "BlockProfile":
        """``measured=False``: a block the host left out (``LayersFile.left_out``), its times 0."""
        b = BlockProfile(
            name=r.str("name"), index=r.int("index", None, min_value=0),
            param_bytes=r.int("param_bytes", min_value=0, max_value=V.MAX_BYTES),
            activation_bytes_per_sample=r.int("activation_bytes_per_sample", min_value=0, max_value=V.MAX_BYTES),
            forward_time_s=r.float("forward_time_s", positive=True) if measured else _zero(r, "forward_time_s"),
            backward_time_s=r.float("backward_time_s", positive=True) if measured else _zero(r, "backward_time_s"),
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


def _zero(r: Reader, key: str) -> float:
    v = r.float(key, 0.0, min_value=0.0)
    if v != 0.0:
        raise r.fail(key, "0 (a block the host left out is not timed; see left_out)", v)
    return v


LEFT_OUT_BLOCKS = ("embed", "tail")
"""Blocks ``torchpp profile`` may leave out on a host whose memory cannot hold them."""


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
    cpu_steal_cores: float | None = None
    """Cores the machine lost to other guests of a virtual machine (steal) on average while the
    blocks were timed (``torchpp.trace.cpu_steal``); the times include that slowdown. Optional:
    None (absent) = not recorded."""

    @staticmethod
    def parse(r: Reader) -> "RunInfo":
        return RunInfo(seq_len=r.int("seq_len", min_value=1, max_value=V.MAX_SEQ_LEN),
                       batch=r.int("batch", min_value=1, max_value=V.MAX_GLOBAL_BATCH),
                       batches=r.ints("batches", []),
                       iters=r.int("iters", min_value=1), warmup=r.int("warmup", min_value=0),
                       threads=r.int("threads", min_value=1), torch_version=r.str("torch_version"),
                       timer=r.str("timer", choices={"cpp", "python"}), seed=r.int("seed", 0),
                       cpu=r.str("cpu", ""),
                       cpu_steal_cores=r.float("cpu_steal_cores", None, min_value=0.0, max_value=V.MAX_CPUS))


def _codec(r: Reader) -> dict[str, list[float]] | None:
    """``codec_s_per_byte``: {format: [encode, decode]} seconds per fp32 byte, each >= 0."""
    if not r.has("codec_s_per_byte"):
        return None
    c = r.obj("codec_s_per_byte")
    out = {}
    for fmt in c.data:
        v = c.floats(fmt)
        if fmt not in ("bf16", "fp16", "int8", "powersgd") or len(v) != 2 or min(v) < 0:
            raise c.fail(fmt, "a wire format (bf16, fp16, int8) or powersgd -> [encode, decode] seconds per byte, "
                         "each >= 0", v)
        out[fmt] = v
    return out


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
    codec_s_per_byte: dict[str, list[float]] | None = None
    """Per wire format (``bf16``, ``fp16``, ``int8``): [encode, decode] CPU seconds per fp32 byte on
    this host, measured by ``torchpp profile`` (``torchpp.wire.measure_codec``); ``powersgd``: its
    compress/decompress arithmetic at rank 4 (``measure_powersgd``). Optional: None (absent) = not
    measured (priced as 0)."""
    left_out: list[str] = field(default_factory=list)
    """Blocks (of ``LEFT_OUT_BLOCKS``) this host did not time because its memory cannot hold them:
    their bytes are the model's, their times 0, and the planner prices them from the hosts that
    timed them and never places them here. Optional: absent = every block timed."""
    memory_limit_bytes: int | None = None
    """The memory limit the profile ran under (``--memory``, the cgroup's, an emulated host's, or
    the machine's), written when blocks were left out: the planner holds the host to it."""
    format: str = f"torchpp.{LAYERS_KIND}/{LAYERS_VERSION}"

    def to_json(self) -> dict[str, Any]:
        d = to_dict(self)
        for b in (d["embed"], d["tail"], *d["layers"]):
            if b.get("backward_input_time_s") is None:
                b.pop("backward_input_time_s", None)
        for key in ("optimizer_s_per_byte", "backward_split_factor", "backward_split_layer_s", "codec_s_per_byte",
                    "memory_limit_bytes"):
            if d.get(key) is None:
                d.pop(key, None)
        if not d.get("left_out"):
            d.pop("left_out", None)
        if d["run"].get("cpu_steal_cores") is None:
            d["run"].pop("cpu_steal_cores", None)
        return {"format": d.pop("format"), **d}

    def save(self, path: str | os.PathLike) -> Path:
        return write_json(path, self.to_json())

    @staticmethod
    def parse(data: Any, source: str) -> "LayersFile":
        check_format(data, source, LAYERS_KIND, [LAYERS_VERSION])
        r = Reader(data, source)
        left_out = [str(x) for x in r.list("left_out", [])]
        for i, name in enumerate(left_out):
            if name not in LEFT_OUT_BLOCKS or left_out.index(name) != i:
                raise r.fail(f"left_out[{i}]", f"one of {', '.join(LEFT_OUT_BLOCKS)}, each once", name)
        lf = LayersFile(
            model=ModelInfo.parse(r.obj("model")), run=RunInfo.parse(r.obj("run")),
            host=V_host(r, "host"),
            embed_param_bytes=r.int("embed_param_bytes", min_value=0, max_value=V.MAX_BYTES),
            tail_param_bytes=r.int("tail_param_bytes", min_value=0, max_value=V.MAX_BYTES),
            embed=BlockProfile.parse(r.obj("embed"), "embed" not in left_out),
            tail=BlockProfile.parse(r.obj("tail"), "tail" not in left_out),
            layers=[BlockProfile.parse(x) for x in r.objs("layers", min_len=1)],
            step_time_s=r.float("step_time_s", positive=True), peak_rss_bytes=r.int("peak_rss_bytes", min_value=0),
            step_samples_s=r.floats("step_samples_s", []),
            call_overhead_s=r.float("call_overhead_s", 0.0, min_value=0.0),
            optimizer_s_per_byte=r.float("optimizer_s_per_byte", None, positive=True),
            backward_split_factor=r.float("backward_split_factor", None, positive=True),
            backward_split_layer_s=r.float("backward_split_layer_s", None, min_value=0.0, max_value=1e3),
            codec_s_per_byte=_codec(r),
            left_out=left_out, memory_limit_bytes=r.int("memory_limit_bytes", None, min_value=1, max_value=V.MAX_BYTES),
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


