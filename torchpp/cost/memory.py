"""Per-device peak memory of a stage: the fitted model of calibrate-memory, or an analytic one.

Both have the form of seed 000's model, extended for 1F1B and recomputation::

    peak = base + alpha·W + Ke·W_end + s·n·(Kp·A_kept + A_recomputed) + s·n_w·Kw·A_kept
           + Kp·A_max_recomputed·s + Kb·A_body·s + [n_w ≥ 1]·Kz·A_body·s + Kl·A_layer·s

with W the stage's parameter bytes, s the samples of a micro-batch this device computes,
n the micro-batches the stage holds at its peak (``schedules.in_flight``, read off its order), A_kept the activation bytes per sample of layers whose activations are kept, and
A_recomputed those of recomputed layers, which keep only their input (one tensor) per
micro-batch plus, during backward, one layer's activations at a time. The tail's share of
A_kept (its logits) counts with its own fitted factor Kt instead of Kp (``activations``).
W_end is the parameter bytes of the stage's tail (the lm_head: one large tensor), Ke what it
holds beyond its weights' alpha: 0 since the lm_head adds its weight gradient into ``.grad`` in one
product (``models.deferred.project``), as the embedding adds its rows (``models.embedding``);
files fitted before hold 1 (a fresh gradient beside the accumulated one) or none.

n_w is the micro-batches held between their input gradient ``I`` and their weight gradient ``W``
in a zero-bubble order (zb-h1, interleaved-zb, zbv; 0 for every other kind), at the step of the
order holding the most micro-batches, the fewest such (``schedules.split_in_flight``;
``held_profiles``, every step, for several chunks: read off the order, like n). Such a
micro-batch no longer holds its graph: the input pass frees it and keeps each linear layer's
input and output gradient for W (``models.deferred``), so it holds ``(Kp + Kw)`` per byte of
kept activations instead of Kp, Kw < 0 (the tail's by Kt / Kp), fitted by calibrate-memory's
zero-bubble probes (0 where the file has none: priced as whole, an upper bound). Where the file
has Kwt (fitted when zero-bubble probes with and without the tail were run), the tail's logits
count with it instead: Kw·A_kept + (Kwt − Kw·Kt/Kp)·A_tail. A chunk holding the embedding has
no input gradient: its whole backward waits for W and holds nothing more, so its n_w counts 0.
A device with a micro-batch past its I at its peak holds ``Kz·s·A_body`` more, once: the heap
beyond the live tensors when W frees the stashed gradients out of the order I made them in
(fitted, given Kw, on zero-bubble probes at several pipeline positions; 0 where the file has none).
That heap exists only once a W has run: a one-chunk stage is priced at every state of its order
(``schedules.peak_states``: held, past I, whether a W ran before) and the largest is its peak, so
a ZB-H1 stage with as many micro-batches as stages, which holds the most before its first W, is
not charged Kz there (it over-priced such stages by 10–12%; several chunks still take Kz whenever
one is past its I).

A_body is the activation bytes per sample of the stage's layers (kept or recomputed, the tail's
logits not included; the embedding's output counts in no term: the first layer keeps it as its
input, :func:`held_activation_bytes`), and Kb what one backward adds while it runs (the
gradients flowing back through the layers): once per device, however many micro-batches it
holds, where Kp is what each held micro-batch keeps. Fitted on probes holding several
micro-batches at once (0 where the file has none: Kp then counts it with every held one, which
over-priced a 2-stage first rank by 12-14%).

A device holding k chunks (interleaved, V) holds ``Kc·(k − 1)`` more bytes, once: each chunk's
backward runs while the other chunks' micro-batches are held, and the forwards allocated between
two backwards take the space the first freed, so the next backward of another chunk takes fresh
heap. Measured on ``qwen3-homelab`` (8 stages on 4 ranks, 8 micro-batches of 4): the same
8-stage split peaked 5-13% above its price both interleaved and as a V, against 2.5-6% for a
1F1B split of the same layers, and one process running a rank's two chunks in its order without
any communication peaked where the rank did (127.8 against 127.0 MiB, 293.2 against 296.1):
the excess belongs to the chunks, not to the runtime's buffers. Where the device's split backward
is charged ``Kz`` (the heap a W leaves, also once) it holds the larger of the two. Fitted on
calibration probes running two chunks in an interleaved order (0 where the file has none).

A_layer is the activation bytes per sample of the stage's largest decoder layer, and Kl what the
one layer whose forward or backward is running holds beyond what it keeps (its intermediate
products): once per device, however many layers and micro-batches it holds (0 where the file
has none: the intercept then took it at the probes' mean batch, and one-layer spans at a small
batch were over-priced by 10-25%).

The analytic model (no calibration file): base 0, alpha 4 (fp32 weights, gradients and the two
AdamW moments), Kp ``activation_factor`` (default 16: a transformer layer keeps roughly that
many tensors the size of its output for backward; calibrate-memory measures it instead).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..formats import MemoryModel

ANALYTIC_ALPHA = 4.0
ANALYTIC_KP = 16.0


def held_activation_bytes(act_bytes) -> np.ndarray:
    """Per-block activation bytes per sample (embed, layers..., tail) as the memory model counts
    them: the embedding's output is 0. The first layer keeps it as its input (in its own bytes),
    and the embedding's backward needs only the token ids (``models.embedding``). Counted with
    ``Kp``, it over-priced a stage holding the embedding and 4 micro-batches of 8 by 16% (302 MiB
    against 259 measured); left out, the same calibration priced five held-out probes within 5%."""
    out = np.array(act_bytes, dtype=float)
    if len(out):
        out[0] = 0.0
    return out


def describe(mm: MemoryModel) -> str:
    """A fitted file's coefficients in words (what ``torchpp calibrate-memory`` prints and a plan
    records as its memory model's source)."""
    r2 = f", R² {mm.r2:.4f}" if mm.r2 == mm.r2 else ""
    res = f", max |residual| {max(abs(r) for r in mm.residuals) / 2**20:.1f} MiB" if mm.residuals else ""
    rt = f"; the runtime itself {mm.process_bytes / 2**20:.0f} MiB per device" if mm.process_bytes else ""
    named = [("Kt", mm.Kt, "tail"), ("Ke", mm.Ke, "end weights"), ("Kw", mm.Kw, "between I and W"),
             ("Kwt", mm.Kwt, "tail between I and W"), ("Kz", mm.Kz, "split backward, once"),
             ("Kb", mm.Kb, "one backward"), ("Kl", mm.Kl, "one layer running")]
    kc = f", Kc {mm.Kc / 2**20:.1f} MiB (each chunk beyond a device's first)" if mm.Kc is not None else ""
    terms = "".join(f", {k} {v:.3f} ({what})" for k, v, what in named if v is not None)
    return f"base {mm.base / 2**20:.1f} MiB, alpha {mm.alpha:.3f}, Kp {mm.Kp:.3f}{terms}{kc}{r2}{res}{rt}"


@dataclass(frozen=True)
class MemoryEstimator:
    base: float
    alpha: float
    kp: float
    source: str
    process: float = 0.0
    """Bytes the torch runtime takes in every process before a stage is built (calibrated; 0 for
    the analytic model). Predictions are of a stage's own peak; budgets are reduced by this."""
    kt: float | None = None
    """Factor of the tail's output (the logits); None: the same as ``kp``."""
    ke: float = 0.0
    """Factor of the stage's lm_head weights (``W_end``); 0: no such term."""
    kw: float = 0.0
    """Factor of the kept activations of each micro-batch held between its ``I`` and its ``W``
    (zero-bubble schedules); 0: no such term."""
    kb: float = 0.0
    """Factor of the layers' activations held once, by the running backward; 0: no such term."""
    kwt: float | None = None
    """Factor of the tail's logits for each micro-batch held between its ``I`` and its ``W``;
    None: as ``kw`` weighs the rest of the kept activations (the tail's by ``kt / kp``)."""
    kz: float = 0.0
    """Factor of the layers' activations held once by a device with a micro-batch
    past its ``I`` at its peak (the heap beyond the live tensors); 0: no such term."""
    kl: float = 0.0
    """Factor of the largest decoder layer's activations held once (the running layer's
    intermediate products); 0: no such term."""
    kc: float = 0.0
    """Bytes a device holds once for each chunk beyond its first (the heap its chunks' interleaved
    backwards leave); 0: no such term."""

    def chunks_heap(self, chunks: int, split_heap: float = 0.0) -> float:
        """The heap a device of ``chunks`` chunks holds beyond its live tensors, once: ``kc`` per
        chunk beyond the first, or ``split_heap`` (the ``kz`` term of a split backward) where larger."""
        return max(self.kc * max(0, chunks - 1), split_heap)

    def split_once(self, split, act_body, heap: bool = True):
        """``kz`` times ``act_body`` where ``split`` (micro-batches past their I) is at least one and,
        with ``heap`` False, none where no W has run yet (``schedules.peak_states``)."""
        return self.kz * act_body * (np.asarray(split) > 0) if self.kz and heap else 0.0

    @property
    def kw_tail_adjust(self) -> float:
        """What ``kwt`` adds per byte of logits to ``kw`` times the kept activations (in which the
        logits count ``kt / kp``): 0 without ``kwt``."""
        if self.kwt is None:
            return 0.0
        ratio = self.kt / self.kp if self.kt is not None and self.kp > 0 else 1.0
        return self.kwt - self.kw * ratio

    def activations(self, act_bytes: np.ndarray) -> np.ndarray:
        """Per-block activation bytes per sample (embed, layers..., tail) weighted so that ``kp``
        times them prices every block: the tail's entry is scaled by ``kt / kp``, the embedding's
        is 0 (:func:`held_activation_bytes`)."""
        out = held_activation_bytes(act_bytes)
        if self.kt is not None and self.kp > 0:
            out[-1] *= self.kt / self.kp
        return out

    def budgets(self, budget: dict[str, float]) -> dict[str, float]:
        """Each device's memory left for its stage once the runtime is loaded."""
        return {h: max(0.0, b - self.process) for h, b in budget.items()}

    @staticmethod
    def analytic(activation_factor: float = ANALYTIC_KP) -> "MemoryEstimator":
        return MemoryEstimator(0.0, ANALYTIC_ALPHA, activation_factor,
                               f"analytic (4×weights, activations ×{activation_factor:g} of the block outputs)")

    @staticmethod
    def fitted(mm: MemoryModel, source: str = "memory_model.json") -> "MemoryEstimator":
        return MemoryEstimator(mm.base, mm.alpha, mm.Kp, f"fitted {source} ({describe(mm)})", mm.process_bytes,
                               mm.Kt, mm.Ke or 0.0, mm.Kw or 0.0, mm.Kb or 0.0, mm.Kwt, mm.Kz or 0.0, mm.Kl or 0.0,
                               mm.Kc or 0.0)

    def static(self, weights: float, end_weights: float = 0.0) -> float:
        """Bytes independent of the samples: the base, the weights (with gradients and optimizer
        state) and the accumulation buffer of the lm_head's weights ``end_weights``."""
        return self.base + self.alpha * weights + self.ke * end_weights

    def per_sample(self, act_kept: float, act_recomputed: float, n: int, act_max_recomputed: float = 0.0,
                   split: int = 0, act_body: float = 0.0, act_tail: float = 0.0, act_layer: float = 0.0,
                   heap: bool = True) -> float:
        """Bytes per sample of one device's micro-batch share, ``n`` micro-batches held of which
        ``split`` between their I and their W (the tail's logits ``act_tail``, unweighted, priced
        there by ``kwt``), one backward running over ``act_body`` and one layer of ``act_layer``."""
        return (n * (self.kp * act_kept + act_recomputed) + self.kp * act_max_recomputed
                + split * (self.kw * act_kept + self.kw_tail_adjust * act_tail) + self.once(act_body, act_layer)
                + self.split_once(split, act_body, heap))

    def once(self, act_body: float, act_layer: float):
        """What a device holds once per sample of its micro-batch share, however many micro-batches
        it holds: the running backward's share of ``act_body`` and the running layer's of ``act_layer``."""
        return self.kb * act_body + self.kl * act_layer

    def peak(self, weights: float, act_kept: float, act_recomputed: float, samples: float, n: int,
             act_max_recomputed: float = 0.0, end_weights: float = 0.0, split: int = 0, act_body: float = 0.0,
             act_tail: float = 0.0, act_layer: float = 0.0, heap: bool = True) -> float:
        return (self.static(weights, end_weights)
                + samples * self.per_sample(act_kept, act_recomputed, n, act_max_recomputed, split, act_body, act_tail,
                                            act_layer, heap))

    def recompute_terms(self, act_layers: np.ndarray, act_fixed: float, n: int, split: int = 0,
                        act_body: float = 0.0, act_tail: float = 0.0, act_layer: float = 0.0, heap: bool = True
                        ) -> tuple[float, np.ndarray, float]:
        """``per_sample`` as a linear form in the recompute flags r_l and y = max_l r_l (the
        recompute MILP's constraint): ``const + Σ_l r_l · coef_l + y · coef_y`` for layers of
        activation bytes ``act_layers`` and never-recomputed bytes ``act_fixed`` (embed, tail);
        a recomputed layer keeps nothing between I and W either; the running backward's
        ``act_body`` and running layer's ``act_layer`` terms do not depend on the flags."""
        total = float(act_layers.sum()) + act_fixed
        const = (n * self.kp * total + split * (self.kw * total + self.kw_tail_adjust * act_tail)
                 + self.once(act_body, act_layer) + float(self.split_once(split, act_body, heap)))
        amax = float(act_layers.max()) if len(act_layers) else 0.0
        return const, n * (1.0 - self.kp) * act_layers - split * self.kw * act_layers, self.kp * amax
