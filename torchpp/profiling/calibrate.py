"""Memory calibration (`torchpp calibrate-memory`): fit ``peak ≈ base + alpha·Σweights + Kp·Σactivation·B`` (seed 000 step 4).

Random spans [s, e) of decoder layers (with the embedding when s = 0 and the tail when e = N,
as a stage would hold them) are each built as the runtime builds a stage and trained for a
few AdamW steps (the moments exist from the second on) in a fresh subprocess
(:mod:`torchpp.profiling.memory_probe`), which reports its peak RSS increase. The
three coefficients are fitted by non-negative least squares (scipy.optimize.nnls); the file
keeps the samples, the residuals and R². ``alpha`` thus covers weights, gradients and
optimizer state; ``Kp`` the activations of one micro-batch, which the planner multiplies by
the in-flight count read off the schedule (``schedules.in_flight``). The tail's output (the
logits) gets its own factor ``Kt``: a decoder layer keeps tens of tensors its output's size for
backward, the tail one or two copies of its logits, and one factor for both mis-prices
whichever stage holds the tail.

Zero-bubble schedules hold each micro-batch between its input gradient (I) and its weight
gradient (W) with less than its saved tensors (the input pass frees the graph and keeps the
linear layers' inputs and output gradients, ``models.deferred``): ``split_samples`` spans each
run one ZB-H1 stage's own order, which count that share of a micro-batch's bytes (``Kw``,
negative), and ``Kz`` — the heap a split backward holds once beyond the live tensors — is fitted
on what they hold beyond the model above (``cost.memory`` prices both).

The spans above hold one micro-batch at a time, so ``Kp`` first measures what one micro-batch
keeps plus what its backward adds while it runs. A pipeline rank holds several and runs one
backward at a time: ``held_samples`` spans run every forward, then every backward
(``memory_probe`` gpipe, ``HELD_MICROBATCHES`` held at once), and ``Kb``, the running backward's
share, is fitted on what they hold below ``n`` times the first ``Kp``; ``Kp`` keeps the rest.

What the one running layer holds beyond what it keeps (its intermediate products) is held once
whatever the span's length: ``Kl`` per byte of the largest layer's activations, fitted beside
``Kp`` (the spans take several micro-batch sizes, so it is told from the intercept). The fit
weighs each span by the inverse of its peak: a planner needs each stage within a few percent,
and unweighted least squares fits the largest spans' bytes at the small ones' expense (a
one-layer span at batch 4 was over-priced by 12%, its probes' figures 106 MiB against 85).
"""
from __future__ import annotations

import json
import os
import random
import statistics
from dataclasses import replace
import subprocess
import sys
from pathlib import Path
from typing import Sequence

import numpy as np

from ..formats import LayersFile, MemoryModel, MemorySample
from ..cost import BlockSums, stage_blocks
from ..cost.memory import held_activation_bytes

HELD_MICROBATCHES = 4
"""Micro-batches the ``gpipe`` probes hold at once (three more than the others: Kb's lever)."""

PROBE_MICROBATCHES = 2
"""Micro-batches per probed step: from the second on, a backward runs beside the whole stage's
gradients and adds its own into them, the regime of every pipeline rank with 2 or more."""
ZB_PROBE_STAGES = 4
"""The zero-bubble probes run one stage of a ZB-H1 pipeline this deep, over twice as many
micro-batches (its steady state), as a rank of a 4-device plan does."""
ZB_BODY_POSITIONS = (1, 3, 2)
"""Positions the zero-bubble probes without the tail take in turn: their peaks hold one, three
and two micro-batches past their I beside whole ones, so ``Kw`` (per such micro-batch) and ``Kz``
(once) are told apart. A probe with the tail is the last stage."""


CHUNK_LAYERS = 3
"""Most decoder layers of each chunk of a ``chunks`` probe (it holds up to three times as many
micro-batches as stages at once: a small host's probe stays within its memory)."""


def chunk_spans(num_layers: int, count: int, seed: int = 0) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """Pairs of spans for the probes of a device holding two chunks (``memory_probe`` chunks): the
    first without the embedding or the tail, the second after it (with the tail where it ends
    the model), each of at most :data:`CHUNK_LAYERS` layers."""
    pairs = [((a, b), (c, d)) for a in range(1, num_layers) for b in range(a + 1, min(a + CHUNK_LAYERS, num_layers - 1) + 1)
             for c in range(b, num_layers) for d in range(c + 1, min(c + CHUNK_LAYERS, num_layers) + 1)]
    return random.Random(seed + 3).sample(pairs, min(count, len(pairs)))


def random_spans(num_layers: int, count: int, seed: int = 0) -> list[tuple[int, int]]:
    """Distinct spans, spread over lengths so the fit sees small and large stages; a third of
    them (at least three) end with the tail, so its own factor Kt (logits) can be fitted, and a
    sixth (at least one, from six spans on) start with the embedding, whose weights only
    ``alpha`` prices (its gradient is added in place)."""
    rng = random.Random(seed)
    all_spans = [(s, e) for s in range(num_layers) for e in range(s + 1, num_layers + 1)]
    if count >= len(all_spans):
        return all_spans
    rng.shuffle(all_spans)
    tails = [sp for sp in all_spans if sp[1] == num_layers]
    want = min(len(tails), max(3, count // 3), count)
    out = [tails[i] for i in sorted(rng.sample(range(len(tails)), want))] if want else []
    embeds = [sp for sp in all_spans if sp[0] == 0 and sp not in out]
    out += embeds[:min(len(embeds), count // 6, count - len(out))]
    by_len: dict[int, list[tuple[int, int]]] = {}
    for sp in all_spans:
        if sp not in out:
            by_len.setdefault(sp[1] - sp[0], []).append(sp)
    while len(out) < count:  # round-robin over lengths
        for n in sorted(by_len):
            if by_len[n] and len(out) < count:
                out.append(by_len[n].pop())
    rng.shuffle(out)
    return out


def span_sums(lf: LayersFile, start: int, end: int) -> tuple[int, int, bool, bool, int]:
    """Σweights, Σactivation-per-sample (as the memory model counts it: the embedding's output
    0), embed?, tail? and the tail's activation of a stage holding layers [start, end)."""
    has_embed, has_tail = start == 0, end == lf.model.num_layers
    blocks = [lf.embed, *lf.layers, lf.tail]
    params = BlockSums([lf.embed_param_bytes, *[b.param_bytes for b in lf.layers], lf.tail_param_bytes])
    acts = BlockSums(held_activation_bytes([b.activation_bytes_per_sample for b in blocks]))
    lo, hi = stage_blocks((start, end), has_embed, has_tail)
    return (int(params(lo, hi)), int(acts(lo, hi)), has_embed, has_tail,
            int(lf.tail.activation_bytes_per_sample) if has_tail else 0)


def layer_activation(lf: LayersFile, start: int, end: int) -> int:
    """Activation bytes per sample of the largest decoder layer of [start, end): what ``Kl``
    multiplies (``cost.stage.StageActivations.layer``)."""
    return int(max((b.activation_bytes_per_sample for b in lf.layers[start:end]), default=0))


def end_weights(lf: LayersFile, start: int, end: int) -> int:
    """Parameter bytes of the tail when a stage of layers [start, end) holds it (end = N), else
    0: what ``Ke`` multiplies (``cost.stage.StageMemory.end_weights``)."""
    return int(lf.tail_param_bytes) if end == lf.model.num_layers else 0


def fit(samples: Sequence[MemorySample]) -> MemoryModel:
    """The coefficients of the one-at-a-time samples (``order`` fb: :func:`fit_full`), then
    ``Kb`` from those holding several micro-batches (gpipe: :func:`fit_held`) and ``Kw`` from the
    zero-bubble ones (:func:`fit_split`), each where there are any."""
    full = [s for s in samples if s.order == "fb"]
    held = [s for s in samples if s.order == "gpipe"]
    split = [s for s in samples if s.order == "zb"]
    mm = fit_full(full)
    mm = fit_held(mm, held) if held else mm
    return fit_split(mm, split) if split else mm


def _refit_stats(mm: MemoryModel, extra: Sequence[MemorySample], pred: Sequence[float], **coef) -> MemoryModel:
    """``mm`` with ``coef`` set and ``extra`` samples (predicted ``pred``) added; R² and residuals
    over every sample."""
    samples = mm.samples + [MemorySample(**{**s.__dict__, "predicted_bytes": float(p)}) for s, p in zip(extra, pred)]
    y = np.array([float(s.peak_bytes) for s in samples])
    res = y - np.array([s.predicted_bytes for s in samples])
    ss_tot = float(((y - y.mean()) ** 2).sum())
    r2 = 1.0 - float((res ** 2).sum()) / ss_tot if ss_tot > 0 else float("nan")
    return replace(mm, samples=samples, residuals=[float(r) for r in res], r2=r2, **coef)


def held_bytes(mm: MemoryModel, s: MemorySample, kp: float, kb: float, n: int | None = None) -> float:
    """``mm``'s peak of a sample holding ``n`` (default all its ``microbatches``) at once, each
    keeping ``kp`` per byte of its layers' activations, one running backward ``kb``."""
    body = float(s.activation_bytes_per_sample - s.tail_activation_bytes_per_sample)
    tail = float(s.tail_activation_bytes_per_sample)
    n = s.microbatches if n is None else n
    return (mm.base + mm.alpha * s.weights_bytes + (mm.Ke or 0.0) * s.end_weights_bytes
            + s.batch * (n * (kp * body + mm.tail_factor * tail) + kb * body
                         + (mm.Kl or 0.0) * s.layer_activation_bytes_per_sample))


def fit_held(mm: MemoryModel, held: Sequence[MemorySample]) -> MemoryModel:
    """``Kb`` (between 0 and the one-at-a-time ``Kp``) by least squares on what the samples
    holding ``n`` micro-batches hold below ``n × Kp``: ``(n − 1) · s · A_body · Kb``; ``Kp``
    becomes what each held micro-batch keeps (``Kp − Kb``), so one-at-a-time spans are priced
    as before."""
    x = np.array([-(s.microbatches - 1) * s.batch * float(s.activation_bytes_per_sample
                                                          - s.tail_activation_bytes_per_sample) for s in held])
    extra = np.array([float(s.peak_bytes) - held_bytes(mm, s, mm.Kp, 0.0) for s in held])
    kb = min(mm.Kp, max(0.0, float(x @ extra / (x @ x)))) if float(x @ x) > 0 else 0.0
    pred = [held_bytes(mm, s, mm.Kp - kb, kb) for s in held]
    kt = mm.Kt  # the tail keeps its own factor; Kp's change must not move it when it was Kp's
    return _refit_stats(mm, held, pred, Kp=mm.Kp - kb, Kb=kb, Kt=mm.tail_factor if kt is None else kt)


def _held(s: MemorySample) -> int:
    """Micro-batches a zero-bubble probe holds at its peak (read off its order by the probe)."""
    return s.microbatches if s.held is None else s.held


def _past_input(s: MemorySample) -> int:
    """Of those, the ones past their I (0 on a span holding the embedding: its I computes nothing)."""
    if s.has_embed:
        return 0
    return max(0, s.microbatches - 1) if s.past_input is None else s.past_input


def split_columns(mm: MemoryModel, s: MemorySample) -> tuple[float, float, float, float]:
    """(bytes ``mm`` predicts with every held micro-batch whole, then the multipliers of ``Kw``,
    ``Kz`` and ``Kwt``) of a zero-bubble sample at its peak: ``past_input`` micro-batches past their
    I, each ``Kw`` per byte of its kept activations (the tail's weighted Kt / Kp) beyond a whole
    one, or, with ``Kwt``, its layers' by ``Kw`` and its logits by ``Kwt``; ``Kz`` once per byte
    of the span's activations where any is past its I."""
    body = float(s.activation_bytes_per_sample - s.tail_activation_bytes_per_sample)
    tail = float(s.tail_activation_bytes_per_sample)
    w = _past_input(s)
    return (held_bytes(mm, s, mm.Kp, mm.Kb or 0.0, _held(s)), w * s.batch * body,
            s.batch * body if w > 0 else 0.0, w * s.batch * tail)


def fit_split(mm: MemoryModel, split: Sequence[MemorySample]) -> MemoryModel:
    """``Kw``, ``Kz`` and the tail's ``Kwt`` from the zero-bubble samples, on what they hold beyond
    ``mm``'s prediction with all their held micro-batches whole. R² and residuals then over every
    sample.

    ``Kw`` is negative: the input pass frees a micro-batch's graph and keeps only its linear
    layers' inputs and output gradients (``models.deferred``). Where the probes counted those live
    bytes against the graph's (``kept_ratio``, median over the spans without the tail), ``Kw =
    −(1 − ratio)·Kp``: a micro-batch past its I is priced at that share of a whole one. ``Kz``
    (at least 0), the heap a split backward holds beyond the live tensors, is then fitted by
    least squares: measured on this machine, a ZB-H1 stage at positions 1-3 of 4 peaked 8-49 MiB
    above a GPipe probe holding as many whole micro-batches, though it holds fewer live bytes.
    Fitting both from the RSS alone (older samples, without the ratio) is kept, bounded (Kw at
    least ``−Kp``); two probes made that fit exact and unstable (Kw −27 of Kp 28 with Kz 53 on
    ``qwen3-small``). ``Kwt`` is at least ``1 − Kt``: a tail micro-batch past its I holds the
    logits' gradient the lm_head's W reads, one copy of its logits, while ``Kt`` (fitted one
    micro-batch at a time) counts the loss's transient copies too. Without tail samples (or only
    tail samples) the logits count in ``Kw``'s term weighted as ``Kt / Kp``."""
    from scipy.optimize import lsq_linear

    cols = np.array([split_columns(mm, s) for s in split])
    extra = np.array([float(s.peak_bytes) for s in split]) - cols[:, 0]
    has_tail = np.array([s.tail_activation_bytes_per_sample > 0 for s in split])
    ratio_t = mm.tail_factor / mm.Kp if mm.Kp > 0 else 1.0
    apart = bool(has_tail.any() and (~has_tail).any())
    body = ~has_tail if apart else np.ones(len(split), bool)
    x_w = cols[:, 1] + (0.0 if apart else ratio_t * cols[:, 3])
    live = body & (cols[:, 1] + cols[:, 3] > 0)
    if not live.any():
        return _refit_stats(mm, split, list(cols[:, 0]), Kw=None)
    kept = [s.kept_ratio for s, b, t in zip(split, live, has_tail) if b and not t and s.kept_ratio is not None]
    if kept:
        kw = -(1.0 - min(1.0, float(np.median(kept)))) * mm.Kp
        x, y = cols[live, 2], extra[live] - kw * x_w[live]
        kz = max(0.0, float(x @ y / (x @ x))) if float(x @ x) > 0 else None
    else:
        with_z = len({_past_input(s) for s, b in zip(split, live) if b}) >= 2
        a = np.stack([x_w, cols[:, 2]], axis=1)[live] if with_z else x_w[live][:, None]
        scale = np.abs(a).max(axis=0)
        scale[scale == 0] = 1.0
        res = lsq_linear(a / scale, extra[live],
                         bounds=([-mm.Kp * scale[0]] + [0.0] * with_z, [np.inf] * (1 + with_z)))
        kw = float(res.x[0] / scale[0])
        kz = float(res.x[1] / scale[1]) if with_z else None
    pred = cols[:, 0] + kw * x_w + (kz or 0.0) * cols[:, 2]
    if not apart:
        return _refit_stats(mm, split, list(pred), Kw=kw, Kz=kz)
    t = has_tail & (cols[:, 3] > 0)
    x, y = cols[t, 3], extra[t] - kw * cols[t, 1] - (kz or 0.0) * cols[t, 2]
    kwt = max(1.0 - mm.tail_factor, float(x @ y / (x @ x))) if float(x @ x) > 0 else 0.0
    pred = pred + kwt * cols[:, 3]
    return _refit_stats(mm, split, list(pred), Kw=kw, Kwt=kwt, Kz=kz)


KE_FRESH_GRADIENT = 0.0
"""``Ke``: bytes per lm_head weight byte a tail holds beyond its accumulated gradient. 0: the
lm_head adds each micro-batch's weight gradient into ``.grad`` in one product
(``models.deferred.project``), as the embedding adds its rows, so no fresh gradient its size
exists beside the accumulated one (files fitted before hold 1: that block). Set, not fitted:
every tail span has the same lm_head bytes, so a fitted Ke is that span kind's own intercept,
told from Kt only by the tail spans' batch sizes (Ke 3.0 with Kt 0.4 on a small host's few spans)."""


def fit_full(samples: Sequence[MemorySample]) -> MemoryModel:
    """NNLS fit of base, alpha, Kp, the running layer's Kl where the spans took two or more
    micro-batch sizes (with one, its column is the intercept's) and, when spans with and without
    the tail are both present, the tail's own factor Kt, with ``Ke`` set (:data:`KE_FRESH_GRADIENT`)
    where a span holds the tail. Each row is weighted by the inverse of its peak (relative
    errors); columns are scaled so their magnitudes do not matter."""
    from scipy.optimize import nnls

    tails = {s.tail_activation_bytes_per_sample > 0 for s in samples}
    with_kt = tails == {True, False} and len(samples) >= 5
    with_kl = (len({s.batch for s in samples}) >= 2 and len(samples) >= 5 + with_kt
               and all(s.layer_activation_bytes_per_sample > 0 for s in samples))
    ke = KE_FRESH_GRADIENT if any(s.end_weights_bytes > 0 for s in samples) else None
    rows = []
    for s in samples:
        body = (s.activation_bytes_per_sample - s.tail_activation_bytes_per_sample) * s.batch
        tail = s.tail_activation_bytes_per_sample * s.batch
        rows.append([1.0, s.weights_bytes, *([body, tail] if with_kt else [body + tail]),
                     *([s.batch * s.layer_activation_bytes_per_sample] if with_kl else [])])
    A = np.array(rows, dtype=float)
    fixed = np.array([(ke or 0.0) * s.end_weights_bytes for s in samples], dtype=float)
    peaks = np.array([float(s.peak_bytes) for s in samples])
    y = peaks - fixed
    scale = np.where(np.abs(A).max(axis=0) > 0, np.abs(A).max(axis=0), 1.0)
    weight = 1.0 / np.maximum(peaks, 1.0)
    coef, _ = nnls(A / scale * weight[:, None], y * weight)
    coef = coef / scale
    y, pred = y + fixed, A @ coef + fixed
    res = y - pred
    ss_tot = float(((y - y.mean()) ** 2).sum())
    r2 = 1.0 - float((res ** 2).sum()) / ss_tot if ss_tot > 0 else float("nan")
    out = [MemorySample(**{**s.__dict__, "predicted_bytes": float(p)}) for s, p in zip(samples, pred)]
    return MemoryModel(base=float(coef[0]), alpha=float(coef[1]), Kp=float(coef[2]), r2=r2,
                       residuals=[float(r) for r in res], samples=out, Kt=float(coef[3]) if with_kt else None, Ke=ke,
                       Kl=float(coef[-1]) if with_kl else None)


def measure_span(model: str, start: int, end: int, has_embed: bool, has_tail: bool, batch: int, seq_len: int,
                 timeout_s: float = 300.0, threads: int = 1, microbatches: int = 1, order: str = "fb",
                 zb_position: int = ZB_PROBE_STAGES - 1, second: tuple[int, int] | None = None) -> dict:
    """The probe's record of one span, run in a fresh Python process: ``peak_bytes`` (peak RSS
    increase), ``base_rss_bytes`` (the process's RSS before the span's model was built) and, for
    ``order`` zb, the ``held`` / ``past_input`` profile at its peak (stage ``zb_position`` of a
    ``ZB_PROBE_STAGES``-stage ZB-H1 pipeline)."""
    cmd = [sys.executable, "-m", "torchpp.profiling.memory_probe", "--model", model, "--start", str(start),
           "--end", str(end), "--batch", str(batch), "--seq-len", str(seq_len), "--threads", str(threads),
           "--microbatches", str(microbatches), "--order", order, "--zb-stages", str(ZB_PROBE_STAGES),
           "--zb-position", str(zb_position)]
    cmd += ["--embed"] * has_embed + ["--tail"] * has_tail
    cmd += ["--second-start", str(second[0]), "--second-end", str(second[1])] if second else []
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"span [{start}, {end}) did not finish within {timeout_s:.0f} s") from None
    if r.returncode != 0:
        raise RuntimeError(f"span [{start}, {end}) failed (exit {r.returncode}):\n{r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def split_spans(num_layers: int, count: int, seed: int = 0) -> list[tuple[int, int]]:
    """Spans for the zero-bubble probes: none holding the embedding (its I computes nothing, so
    it holds nothing between I and W); where there are two or more, half of them (rounded
    down) with the tail and the rest without, so ``Kw`` and the tail's ``Kwt`` are both seen."""
    spans = [sp for sp in random_spans(num_layers, 10 * count + 10, seed + 1) if sp[0] > 0]
    tails = [sp for sp in spans if sp[1] == num_layers][:count // 2 if count >= 2 else 0]
    return (tails + [sp for sp in spans if sp not in tails and sp[1] < num_layers])[:count]


def held_spans(num_layers: int, count: int, seed: int = 0) -> list[tuple[int, int]]:
    """Spans for the probes holding several micro-batches: none with the tail (its logits keep
    their own factor per held micro-batch), the embedding's included."""
    spans = [sp for sp in random_spans(num_layers, 10 * count + 10, seed + 2) if sp[1] < num_layers]
    return spans[:count]


def chunks_price(mm: MemoryModel, lf: LayersFile, s: MemorySample) -> float:
    """``mm``'s price, without ``Kc``, of the device a ``chunks`` sample ran: its two chunks at the
    worst step of its interleaved order (``StageMemory.chunks_peak``), as the planner prices a rank."""
    from ..cost import MemoryEstimator, Profiles, StageMemory
    from ..formats import PlanDevice, PlanStage
    from ..schedules import held_profiles
    from .memory_probe import chunks_order

    pos = s.position or 0
    pl, _ = chunks_order(ZB_PROBE_STAGES, pos, s.microbatches)
    n = lf.model.num_layers
    chunks = [(PlanStage(index=i, layers=(a, b), has_embed=a == 0 and i == pos, has_tail=b == n,
                         devices=[PlanDevice(host=lf.host, rank=0, share=1.0, samples=s.batch)],
                         recompute=[False] * (b - a)), s.batch)
              for i, (a, b) in ((pos, (s.start, s.end)), (pos + ZB_PROBE_STAGES, s.second))]
    held = held_profiles("interleaved", pl, pl.position[pos], s.microbatches)
    est = replace(MemoryEstimator.fitted(mm), kc=0.0)
    return StageMemory(Profiles.from_layers([lf]), est).chunks_peak(chunks, held)


def fit_chunks(mm: MemoryModel, lf: LayersFile, chunks: Sequence[MemorySample]) -> MemoryModel:
    """``Kc`` (at least 0): the median of what the two-chunk probes held beyond ``mm``'s price of
    their device (:func:`chunks_price`), each one chunk beyond its first. A median: one probe's
    heap moves with its layout by several MiB, and the term is one number per device."""
    price = [chunks_price(mm, lf, s) for s in chunks]
    kc = max(0.0, float(np.median([s.peak_bytes - p for s, p in zip(chunks, price)])))
    return _refit_stats(mm, chunks, [p + kc for p in price], Kc=kc)


def default_extra(samples: int, extra: int | None) -> int:
    """Zero-bubble or held probes run beside ``samples`` one-at-a-time spans: ``extra``, or a quarter."""
    return samples // 4 if extra is None else extra


def calibrate(lf: LayersFile, model: str, *, samples: int, batch: int | Sequence[int], seq_len: int | None = None,
              seed: int = 0, timeout_s: float = 300.0, threads: int = 1, microbatches: int = PROBE_MICROBATCHES,
              split_samples: int | None = None, held_samples: int | None = None, chunk_samples: int | None = None,
              progress=print) -> MemoryModel:
    """Spans take the micro-batch sizes in turn: with one size, weights and activations both
    grow with a span's length and the fit can hardly tell them apart; with several they can.
    Each probed step accumulates ``microbatches`` micro-batches, as a pipeline rank's does.
    ``split_samples`` more spans run one ZB-H1 stage's order (``memory_probe`` zb, a stage of
    ``ZB_PROBE_STAGES`` over twice as many micro-batches; the positions of ``ZB_BODY_POSITIONS``
    in turn, the last for a span with the tail), from which ``Kw``, ``Kz`` and ``Kwt`` are
    fitted, and ``held_samples`` in the GPipe order over ``HELD_MICROBATCHES``, from which ``Kb`` is
    and ``chunk_samples`` as one device of an interleaved pipeline holding two chunks
    (``memory_probe`` chunks, at the smallest size), from which ``Kc`` is (each by default a quarter
    of ``samples``, as ``torchpp calibrate-memory``; 0: none)."""
    split_samples, held_samples = default_extra(samples, split_samples), default_extra(samples, held_samples)
    chunk_samples = default_extra(samples, chunk_samples)
    seq = seq_len or lf.run.seq_len
    sizes = [batch] if isinstance(batch, int) else list(batch)
    probes = [(sp, "fb") for sp in random_spans(lf.model.num_layers, samples, seed)]
    probes += [(sp, "zb") for sp in split_spans(lf.model.num_layers, split_samples, seed)]
    probes += [(sp, "gpipe") for sp in held_spans(lf.model.num_layers, held_samples, seed)]
    pairs = chunk_spans(lf.model.num_layers, chunk_samples, seed)
    probes += [(first, "chunks") for first, _ in pairs]
    rows = []
    body_zb = 0
    for i, ((s, e), order) in enumerate(probes):
        second = pairs[i - (len(probes) - len(pairs))][1] if order == "chunks" else None
        # holding several micro-batches multiplies the activations: the smallest size keeps a
        # small host's probe within its memory
        batch = min(sizes) if order in ("gpipe", "chunks") else sizes[i % len(sizes)]
        w, a, he, ht, at = span_sums(lf, s, e)
        mb = {"gpipe": HELD_MICROBATCHES, "zb": 2 * ZB_PROBE_STAGES, "chunks": 2 * ZB_PROBE_STAGES}.get(order,
                                                                                                   microbatches)
        pos = ZB_PROBE_STAGES - 1
        if order in ("zb", "chunks") and not ht:
            pos, body_zb = ZB_BODY_POSITIONS[body_zb % len(ZB_BODY_POSITIONS)], body_zb + 1
        rec = measure_span(model, s, e, he, ht, batch, seq, timeout_s, threads, mb, order, pos, second)
        peak = int(rec["peak_bytes"])
        rows.append(MemorySample(start=s, end=e, has_embed=he, has_tail=ht, weights_bytes=w,
                                 activation_bytes_per_sample=a, batch=batch, peak_bytes=peak,
                                 process_bytes=int(rec.get("base_rss_bytes", 0)),
                                 tail_activation_bytes_per_sample=at, end_weights_bytes=end_weights(lf, s, e),
                                 microbatches=mb, order=order, held=rec.get("held"), past_input=rec.get("past_input"),
                                 kept_ratio=rec.get("kept_ratio"),
                                 layer_activation_bytes_per_sample=layer_activation(lf, s, e),
                                 second=second, position=pos if second else None))
        how = {"zb": f" (ZB-H1 stage {pos + 1}/{ZB_PROBE_STAGES}: {rec.get('held')} held, {rec.get('past_input')} "
                     "past I)", "gpipe": f" ({mb} held)",
               "chunks": f" and [{second[0]}, {second[1]}) (interleaved device {pos + 1}/{ZB_PROBE_STAGES}, 2 chunks)"
               if second else ""
               }.get(order, "")
        progress(f"  span {i + 1}/{len(probes)} [{s:>3}, {e:>3}){' +embed' if he else ''}{' +tail' if ht else ''} "
                 f"x {batch}{how}: "
                 f"weights {w / 2**20:8.1f} MiB, peak +{peak / 2**20:8.1f} MiB")
    mm = fit([r for r in rows if r.order != "chunks"])
    chunked = [r for r in rows if r.order == "chunks"]
    mm = fit_chunks(mm, lf, chunked) if chunked else mm
    mm.host, mm.model, mm.microbatch = lf.host, model, max(sizes)
    mm.process_bytes = float(statistics.median(r.process_bytes for r in rows))
    return mm
