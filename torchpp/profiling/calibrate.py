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
linear layers' inputs and output gradients, ``models.deferred``): ``split_samples`` spans run in
the zero-bubble order of a last stage (F then I per micro-batch, then every W) and ``Kw``
(negative) is fitted on what they hold beyond the model above with all their micro-batches
whole (``cost.memory`` prices it).

The spans above hold one micro-batch at a time, so ``Kp`` first measures what one micro-batch
keeps plus what its backward adds while it runs. A pipeline rank holds several and runs one
backward at a time: ``held_samples`` spans run every forward, then every backward
(``memory_probe`` gpipe, ``HELD_MICROBATCHES`` held at once), and ``Kb``, the running backward's
share, is fitted on what they hold below ``n`` times the first ``Kp``; ``Kp`` keeps the rest.
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

HELD_MICROBATCHES = 4
"""Micro-batches the ``gpipe`` probes hold at once (three more than the others: Kb's lever)."""

PROBE_MICROBATCHES = 2
"""Micro-batches per probed step: from the second on, a backward runs beside the whole stage's
gradients and adds its own into them, the regime of every pipeline rank with 2 or more."""


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
    """Σweights, Σactivation-per-sample, embed?, tail? and the tail's activation of a stage
    holding layers [start, end)."""
    has_embed, has_tail = start == 0, end == lf.model.num_layers
    blocks = [lf.embed, *lf.layers, lf.tail]
    params = BlockSums([lf.embed_param_bytes, *[b.param_bytes for b in lf.layers], lf.tail_param_bytes])
    acts = BlockSums([b.activation_bytes_per_sample for b in blocks])
    lo, hi = stage_blocks((start, end), has_embed, has_tail)
    return (int(params(lo, hi)), int(acts(lo, hi)), has_embed, has_tail,
            int(lf.tail.activation_bytes_per_sample) if has_tail else 0)


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


def held_bytes(mm: MemoryModel, s: MemorySample, kp: float, kb: float) -> float:
    """``mm``'s peak of a sample holding all its ``microbatches`` at once, each keeping ``kp``
    per byte of its embedding's and layers' activations, one running backward ``kb``."""
    body = float(s.activation_bytes_per_sample - s.tail_activation_bytes_per_sample)
    tail = float(s.tail_activation_bytes_per_sample)
    return (mm.base + mm.alpha * s.weights_bytes + (mm.Ke or 0.0) * s.end_weights_bytes
            + s.batch * (s.microbatches * (kp * body + mm.tail_factor * tail) + kb * body))


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


def split_bytes(mm: MemoryModel, s: MemorySample) -> tuple[float, float]:
    """(bytes ``mm`` predicts without Kw, Kw's multiplier) of a zero-bubble sample at its peak,
    the last micro-batch's I: all ``microbatches`` held, all but that one past their I (none for a
    span holding the embedding, whose I computes nothing); kept activations weighted as Kp's (the
    tail's by Kt/Kp)."""
    body = float(s.activation_bytes_per_sample - s.tail_activation_bytes_per_sample)
    tail = float(s.tail_activation_bytes_per_sample)
    ratio = mm.tail_factor / mm.Kp if mm.Kp > 0 else 1.0
    return (held_bytes(mm, s, mm.Kp, mm.Kb or 0.0),
            0.0 if s.has_embed else _past_input(s) * s.batch * (body + ratio * tail))


def _past_input(s: MemorySample) -> int:
    """Micro-batches past their I at a zero-bubble probe's peak (``memory_probe._split_step``)."""
    return max(0, s.microbatches - 1)


def fit_split(mm: MemoryModel, split: Sequence[MemorySample]) -> MemoryModel:
    """``Kw`` by least squares on what the zero-bubble samples hold beyond ``mm``'s prediction
    with all their micro-batches whole: negative, as the input pass frees each micro-batch's graph
    and keeps only its linear layers' inputs and output gradients (``models.deferred``); at least
    ``−Kp`` (a micro-batch past its I holds nothing). The tail's ``Kwt`` is at least ``1 − Kt``: a
    tail micro-batch past its I holds the logits' gradient the lm_head's W reads, one copy of its
    logits, while ``Kt`` (fitted one micro-batch at a time) counts the loss's transient copies too,
    which the zero-bubble tail probes, holding several, see once. R² and residuals then over
    every sample.
    With samples both with and without the tail (neither holding the embedding), ``Kw`` is fitted
    on those without and the tail's logits get their own ``Kwt`` from those with, given ``Kw``:
    what a tail micro-batch holds between I and W is the logits' gradient and the loss's graph,
    not a decoder layer's dozen branch gradients; and a tail probe holding two micro-batches
    counts ``Kt`` (fitted one at a time, the loss's transient copies included) for each, so its
    excess says little about the layers' ``Kw`` (one factor for both under-priced mid ranks)."""
    rows = [split_bytes(mm, s) for s in split]
    extra = np.array([float(s.peak_bytes) - r[0] for s, r in zip(split, rows)])
    live = [s for s in split if not s.has_embed]
    if {s.tail_activation_bytes_per_sample > 0 for s in live} == {True, False}:
        cols = np.array([[0.0, 0.0] if s.has_embed else
                          [_past_input(s) * s.batch * float(s.activation_bytes_per_sample - s.tail_activation_bytes_per_sample),
                           _past_input(s) * s.batch * float(s.tail_activation_bytes_per_sample)] for s in split])
        body = np.array([not s.has_embed and s.tail_activation_bytes_per_sample == 0 for s in split])
        x, y = cols[body, 0], extra[body]
        kw = max(-mm.Kp, float(x @ y / (x @ x))) if float(x @ x) > 0 else 0.0
        x, y = cols[~body, 1], extra[~body] - kw * cols[~body, 0]
        kwt = max(1.0 - mm.tail_factor, float(x @ y / (x @ x))) if float(x @ x) > 0 else 0.0
        pred = [r[0] + kw * c[0] + kwt * c[1] for r, c in zip(rows, cols)]
        return _refit_stats(mm, split, pred, Kw=kw, Kwt=kwt)
    x = np.array([r[1] for r in rows])
    kw = max(-mm.Kp, float(x @ extra / (x @ x))) if float(x @ x) > 0 else None
    pred = [r[0] + (kw or 0.0) * r[1] for r in rows]
    return _refit_stats(mm, split, pred, Kw=kw)


KE_FRESH_GRADIENT = 1.0
"""``Ke``: the lm_head's fresh weight gradient is one tensor its size, beside the accumulated one.
Set, not fitted: every tail span has the same lm_head bytes, so a fitted Ke is that span kind's
own intercept, told from Kt only by the tail spans' batch sizes; with the few spans a small
host can afford the fit traded one for the other (Ke 3.0 with Kt 0.4, or Kt 0 outright, which
priced a second held micro-batch's logits at nothing)."""


def fit_full(samples: Sequence[MemorySample]) -> MemoryModel:
    """NNLS fit of base, alpha, Kp and, when spans with and without the tail are both present,
    the tail's own factor Kt, with ``Ke`` set (:data:`KE_FRESH_GRADIENT`) where a span holds the
    tail. Columns are scaled so their magnitudes do not matter."""
    from scipy.optimize import nnls

    tails = {s.tail_activation_bytes_per_sample > 0 for s in samples}
    with_kt = tails == {True, False} and len(samples) >= 5
    ke = KE_FRESH_GRADIENT if any(s.end_weights_bytes > 0 for s in samples) else None
    rows = []
    for s in samples:
        body = (s.activation_bytes_per_sample - s.tail_activation_bytes_per_sample) * s.batch
        tail = s.tail_activation_bytes_per_sample * s.batch
        rows.append([1.0, s.weights_bytes, body, tail] if with_kt else [1.0, s.weights_bytes, body + tail])
    A = np.array(rows, dtype=float)
    fixed = np.array([(ke or 0.0) * s.end_weights_bytes for s in samples], dtype=float)
    y = np.array([float(s.peak_bytes) for s in samples]) - fixed
    scale = np.where(np.abs(A).max(axis=0) > 0, np.abs(A).max(axis=0), 1.0)
    coef, _ = nnls(A / scale, y)
    coef = coef / scale
    y, pred = y + fixed, A @ coef + fixed
    res = y - pred
    ss_tot = float(((y - y.mean()) ** 2).sum())
    r2 = 1.0 - float((res ** 2).sum()) / ss_tot if ss_tot > 0 else float("nan")
    out = [MemorySample(**{**s.__dict__, "predicted_bytes": float(p)}) for s, p in zip(samples, pred)]
    return MemoryModel(base=float(coef[0]), alpha=float(coef[1]), Kp=float(coef[2]), r2=r2,
                       residuals=[float(r) for r in res], samples=out, Kt=float(coef[3]) if with_kt else None, Ke=ke)


def measure_span(model: str, start: int, end: int, has_embed: bool, has_tail: bool, batch: int, seq_len: int,
                 timeout_s: float = 300.0, threads: int = 1, microbatches: int = 1, order: str = "fb"
                 ) -> tuple[int, int]:
    """Peak RSS increase (bytes) of one span, in a fresh Python process, and that process's RSS
    before the span's model was built (``order``: the probe's, fb or zb)."""
    cmd = [sys.executable, "-m", "torchpp.profiling.memory_probe", "--model", model, "--start", str(start),
           "--end", str(end), "--batch", str(batch), "--seq-len", str(seq_len), "--threads", str(threads),
           "--microbatches", str(microbatches), "--order", order]
    cmd += ["--embed"] * has_embed + ["--tail"] * has_tail
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"span [{start}, {end}) did not finish within {timeout_s:.0f} s") from None
    if r.returncode != 0:
        raise RuntimeError(f"span [{start}, {end}) failed (exit {r.returncode}):\n{r.stderr[-2000:]}")
    rec = json.loads(r.stdout.strip().splitlines()[-1])
    return int(rec["peak_bytes"]), int(rec.get("base_rss_bytes", 0))


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


def calibrate(lf: LayersFile, model: str, *, samples: int, batch: int | Sequence[int], seq_len: int | None = None,
              seed: int = 0, timeout_s: float = 300.0, threads: int = 1, microbatches: int = PROBE_MICROBATCHES,
              split_samples: int = 0, held_samples: int = 0, progress=print) -> MemoryModel:
    """Spans take the micro-batch sizes in turn: with one size, weights and activations both
    grow with a span's length and the fit can hardly tell them apart; with several they can.
    Each probed step accumulates ``microbatches`` micro-batches, as a pipeline rank's does.
    ``split_samples`` more spans run in the zero-bubble order (``memory_probe`` zb: F then I per
    micro-batch, then all W, over ``microbatches``), from which ``Kw`` is fitted, and ``held_samples`` in the
    GPipe order over ``HELD_MICROBATCHES``, from which ``Kb`` is."""
    seq = seq_len or lf.run.seq_len
    sizes = [batch] if isinstance(batch, int) else list(batch)
    probes = [(sp, "fb") for sp in random_spans(lf.model.num_layers, samples, seed)]
    probes += [(sp, "zb") for sp in split_spans(lf.model.num_layers, split_samples, seed)]
    probes += [(sp, "gpipe") for sp in held_spans(lf.model.num_layers, held_samples, seed)]
    rows = []
    for i, ((s, e), order) in enumerate(probes):
        # holding several micro-batches multiplies the activations: the smallest size keeps a
        # small host's probe within its memory
        batch = min(sizes) if order == "gpipe" else sizes[i % len(sizes)]
        w, a, he, ht, at = span_sums(lf, s, e)
        mb = HELD_MICROBATCHES if order == "gpipe" else microbatches
        peak, proc = measure_span(model, s, e, he, ht, batch, seq, timeout_s, threads, mb, order)
        rows.append(MemorySample(start=s, end=e, has_embed=he, has_tail=ht, weights_bytes=w,
                                 activation_bytes_per_sample=a, batch=batch, peak_bytes=peak, process_bytes=proc,
                                 tail_activation_bytes_per_sample=at, end_weights_bytes=end_weights(lf, s, e),
                                 microbatches=mb, order=order))
        how = {"zb": " (I/W order)", "gpipe": f" ({mb} held)"}.get(order, "")
        progress(f"  span {i + 1}/{len(probes)} [{s:>3}, {e:>3}){' +embed' if he else ''}{' +tail' if ht else ''} "
                 f"x {batch}{how}: "
                 f"weights {w / 2**20:8.1f} MiB, peak +{peak / 2**20:8.1f} MiB")
    mm = fit(rows)
    mm.host, mm.model, mm.microbatch = lf.host, model, max(sizes)
    mm.process_bytes = float(statistics.median(r.process_bytes for r in rows))
    return mm
