"""memory_model.json: the fitted per-rank peak memory model and its samples."""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from .. import validate as V
from .base import FormatError, Reader, _load, check_format, to_dict, write_json


MEMORY_KIND, MEMORY_VERSION = "memory_model", 1


def _span(xs: list[int], source: str) -> tuple[int, int]:
    """A chunk probe's second span, checked."""
    if len(xs) != 2 or not 0 <= xs[0] < xs[1]:
        raise FormatError(source, "samples[].second", "[start, end) with 0 <= start < end", xs)
    return xs[0], xs[1]
MEMORY_ORDERS = ("fb", "gpipe", "zb", "chunks")
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
    ``Kz`` are fitted on), ``chunks`` one interleaved device holding the span and ``second`` in
    its order of F and B (what ``Kc`` is fitted on)."""
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
    second: tuple[int, int] | None = None
    """``chunks``: the layers [start, end) of the device's second chunk (the span is its first);
    None for every other order."""
    position: int | None = None
    """``chunks``: the device's position in its interleaved pipeline (``ZB_PROBE_STAGES`` deep)."""


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
    Kc: float | None = None
    """Bytes a device holds for each chunk beyond its first (interleaved and V placements), once,
    beyond the live tensors its chunks' terms price: each chunk's backward runs while the other
    chunks' micro-batches are held, and the forwards allocated between them take the space a
    backward freed, so the next backward of another chunk takes fresh heap. Fitted on probes of
    one device running two chunks in an interleaved order (``memory_probe`` chunks); a device
    whose split backward is priced with ``Kz`` holds the larger of the two. ``None`` (files
    without it): no such term."""
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
                layer_activation_bytes_per_sample=sr.int("layer_activation_bytes_per_sample", 0, min_value=0),
                second=None if sr.raw("second", None) is None else _span(sr.ints("second"), source),
                position=None if sr.raw("position", None) is None else sr.int("position", min_value=0)))
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
                           Kl=None if r.raw("Kl", None) is None else r.float("Kl", min_value=0.0, max_value=1e6),
                           Kc=None if r.raw("Kc", None) is None else r.float("Kc", min_value=0.0,
                                                                              max_value=V.MAX_BYTES))

    @staticmethod
    def load(path: str | os.PathLike) -> "MemoryModel":
        return _load(path, MemoryModel.parse)


