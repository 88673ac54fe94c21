"""The one price of a stage: its compute time on a host and its peak memory on a device.

A block is the embedding, one decoder layer or the tail; block ``0`` is the embedding, block
``i + 1`` decoder layer ``i`` and block ``N + 1`` the tail, so a stage owns a contiguous run of
blocks ``[lo, hi)`` and its recomputed layers are runs of blocks inside it. Every quantity is a
difference of prefix sums over blocks (:class:`BlockSums`) or a range maximum
(:class:`BlockMax`), whose indices may be plain integers (one stage: the simulator, reports,
re-planning) or numpy index arrays (the planner's tables over every cut ``(c, c2)``): both go
through the same arithmetic, so the planner's tables equal the scalar accessor exactly.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Sequence, Union

import numpy as np

from ..formats import Plan, PlanStage, tied_rows
from ..schedules import PeakState
from .memory import held_activation_bytes

if TYPE_CHECKING:
    from .memory import MemoryEstimator
    from .profiles import Profiles

Index = Union[int, np.ndarray]
"""A block index: an integer, or an array of them (broadcast elementwise)."""


def stage_blocks(layers: tuple[int, int], has_embed: bool, has_tail: bool) -> tuple[int, int]:
    """Block range [lo, hi) of a stage holding decoder layers [a, b) (plus embed / tail)."""
    a, b = layers
    return (0 if has_embed else a + 1), (b + 2 if has_tail else b + 1)


def recompute_runs(first_layer: int, flags: Sequence[bool]) -> tuple[tuple[int, int], ...]:
    """Block ranges of the recomputed layers of a stage starting at decoder layer ``first_layer``
    (layer ``first_layer + i`` is block ``first_layer + 1 + i``), merged into contiguous runs."""
    runs: list[tuple[int, int]] = []
    for i, r in enumerate(flags):
        if not r:
            continue
        blk = layer_blocks(first_layer + i, first_layer + i + 1).start
        if runs and runs[-1][1] == blk:
            runs[-1] = (runs[-1][0], blk + 1)
        else:
            runs.append((blk, blk + 1))
    return tuple(runs)


@dataclass(frozen=True)
class Span:
    """The blocks a stage holds, [lo, hi), and the block runs it recomputes."""

    lo: Index
    hi: Index
    runs: tuple[tuple[Index, Index], ...] = ()

    @staticmethod
    def of_stage(stage: PlanStage) -> "Span":
        lo, hi = stage_blocks(stage.layers, stage.has_embed, stage.has_tail)
        return Span(lo, hi, recompute_runs(stage.layers[0], stage.recompute))

    @staticmethod
    def of_cut(c: Index, c2: Index, num_layers: int, recompute: bool | Sequence[bool] = False) -> "Span":
        """Stage [c, c2) of a plan cut at layer boundaries (embed with c = 0, tail with c2 = N).

        ``recompute``: a flag per layer, or True for every layer (the only form for arrays)."""
        lo = np.where(np.asarray(c) == 0, 0, np.asarray(c) + 1)
        hi = np.where(np.asarray(c2) == num_layers, np.asarray(c2) + 2, np.asarray(c2) + 1)
        if np.ndim(lo) == 0 and np.ndim(hi) == 0:
            lo, hi = int(lo), int(hi)
        if recompute is True:
            runs: tuple = ((np.asarray(c) + 1, np.asarray(c2) + 1),) if np.ndim(c) or np.ndim(c2) else \
                ((int(c) + 1, int(c2) + 1),)
        elif recompute is False:
            runs = ()
        else:
            runs = recompute_runs(int(c), recompute)
        return Span(lo, hi, runs)


class BlockSums:
    """Prefix sums of a per-block quantity: the sum over blocks [lo, hi) for integers or index arrays."""

    def __init__(self, values: Sequence[float] | np.ndarray):
        self.prefix = np.concatenate([[0.0], np.cumsum(np.asarray(values, dtype=float))])

    def __call__(self, lo: Index, hi: Index) -> float | np.ndarray:
        return self.prefix[hi] - self.prefix[lo]

    def over(self, runs: tuple[tuple[Index, Index], ...]) -> float | np.ndarray:
        """Sum over several block runs (0 for none)."""
        return sum((self(lo, hi) for lo, hi in runs), 0.0)


class BlockMax:
    """Range maxima of a per-block quantity (0 over an empty range), for integers or index arrays."""

    def __init__(self, values: Sequence[float] | np.ndarray):
        v = np.asarray(values, dtype=float)
        n = len(v)
        self.table = np.zeros((n + 1, n + 1))
        for lo in range(n):
            self.table[lo, lo + 1:] = np.maximum.accumulate(v[lo:])

    def __call__(self, lo: Index, hi: Index) -> float | np.ndarray:
        return self.table[lo, hi]

    def over(self, runs: tuple[tuple[Index, Index], ...]) -> float | np.ndarray:
        out: float | np.ndarray = 0.0
        for lo, hi in runs:
            out = np.maximum(out, self(lo, hi))
        return out


# ----------------------------------------------------------------------------- compute time
@dataclass(frozen=True)
class StageTime:
    """A stage's seconds on one host: per sample and per call, forward, backward without the
    recomputed forwards, and those recomputed forwards (which run inside the backward).

    A call on ``n`` samples costs ``per call + n · per sample``; the per-call part holds the
    blocks' fixed time and the runtime's own cost of a call (``call``, once per forward and once
    per backward)."""

    fwd: float | np.ndarray
    bwd: float | np.ndarray
    rec: float | np.ndarray
    fwd0: float | np.ndarray
    bwd0: float | np.ndarray
    rec0: float | np.ndarray
    call: float = 0.0
    bwd_in: float | np.ndarray = 0.0
    """Part of ``bwd`` computing the input gradient (``I``), per sample; ``bwd - bwd_in`` is ``W``'s."""
    bwd_in0: float | np.ndarray = 0.0
    """Part of ``bwd0`` computing the input gradient, per call."""
    split: float = 1.0
    """``I + W`` over ``B`` when the backward is split (measured: about 1 since W computes the linear
    layers' weight products outside autograd)."""
    split_call: float | np.ndarray = 0.0
    """Seconds one split backward call (``I + W``) adds for the span's decoder layers beyond
    ``split`` times ``B`` (measured per layer and call), half in each."""
    whole: bool | np.ndarray = False
    """The span holds the embedding: its input takes no gradient, so ``I`` computes nothing and
    ``W`` runs the whole backward in one pass (``models.stages.backward_input``)."""

    @property
    def forward_per_sample(self):
        return self.fwd

    @property
    def backward_per_sample(self):
        """Backward per sample, the forward of recomputed layers included."""
        return self.bwd + self.rec

    @property
    def forward_per_call(self):
        return self.fwd0 + self.call

    @property
    def backward_per_call(self):
        return self.bwd0 + self.rec0 + self.call

    @property
    def per_sample(self):
        """Forward + backward per sample, recomputation included (the planner's τ)."""
        return self.fwd + self.bwd + self.rec

    @property
    def per_call(self):
        """Forward + backward per call, recomputation included."""
        return self.fwd0 + self.bwd0 + 2 * self.call + self.rec0

    def forward(self, samples: int) -> float:
        """Seconds of one forward call on ``samples`` samples (0 for none)."""
        return float(self.forward_per_call + samples * self.forward_per_sample) if samples > 0 else 0.0

    def backward(self, samples: int) -> float:
        """Seconds of one backward call on ``samples`` samples, recomputation included (0 for none)."""
        return float(self.backward_per_call + samples * self.backward_per_sample) if samples > 0 else 0.0

    def backward_input(self, samples: int) -> float:
        """Seconds of a zero-bubble schedule's ``I`` call: the input gradient, with the recomputed
        forwards (the activations are rebuilt before any gradient), and the runtime's call cost."""
        if samples <= 0:
            return 0.0
        if self.whole:
            return float(self.call)
        return float(self.split * self.bwd_in0 + self.split_call / 2 + self.rec0 + self.call
                     + samples * (self.split * self.bwd_in + self.rec))

    def backward_weight(self, samples: int) -> float:
        """Seconds of a ``W`` call: the rest of the backward, plus the runtime's cost of one more call
        (so ``I + W = split · B + split_call + call``, recomputation counted once); where the span
        holds the embedding, the whole backward."""
        if samples <= 0:
            return 0.0
        if self.whole:
            return self.backward(samples)
        return float(self.split * (self.bwd0 - self.bwd_in0) + self.split_call / 2 + self.call
                     + samples * self.split * (self.bwd - self.bwd_in))

    def recompute(self, samples: int) -> float:
        """Per-sample seconds of the recomputed forwards of ``samples`` samples."""
        return float(samples * self.rec)


def stage_time(profiles: "Profiles", host: str, span: Span | PlanStage) -> StageTime:
    """THE accessor of a stage's compute time on ``host`` (scalar spans or index arrays)."""
    sp = span if isinstance(span, Span) else Span.of_stage(span)
    f, b, f0, b0, bi, bi0 = _host_sums(profiles, host)
    return StageTime(fwd=f(sp.lo, sp.hi), bwd=b(sp.lo, sp.hi), rec=f.over(sp.runs),
                     fwd0=f0(sp.lo, sp.hi), bwd0=b0(sp.lo, sp.hi), rec0=f0.over(sp.runs),
                     call=profiles.call.get(host, 0.0), bwd_in=bi(sp.lo, sp.hi), bwd_in0=bi0(sp.lo, sp.hi),
                     split=profiles.backward_split_factor(host),
                     split_call=profiles.backward_split_layer_s(host) * decoder_layers(sp, profiles.num_blocks),
                     whole=np.asarray(sp.lo) == 0 if np.ndim(sp.lo) else sp.lo == 0)


def _host_sums(profiles: "Profiles", host: str) -> tuple[BlockSums, ...]:
    """Prefix sums of ``host``'s per-sample and per-call forward, backward and input-gradient
    seconds, kept in ``profiles.sums`` while the tables are the same arrays (a search asks for
    thousands of stages of the same few hosts)."""
    src = (*profiles.table(host), *profiles.fixed(host), profiles.backward_share(host))
    got = profiles.sums.get(host)
    if got is not None and all(x is y for x, y in zip(got[0][:4], src[:4])) and \
            (got[0][4] is src[4] or np.array_equal(got[0][4], src[4])):
        return got[1]
    f, b, f0, b0, share = src
    sums = (BlockSums(f), BlockSums(b), BlockSums(f0), BlockSums(b0), BlockSums(b * share), BlockSums(b0 * share))
    profiles.sums[host] = (src, sums)
    return sums


def decoder_layers(sp: Span, num_blocks: int) -> int | np.ndarray:
    """Decoder layers among the span's blocks (block 0 is the embedding, the last the tail)."""
    n = np.maximum(np.minimum(sp.hi, num_blocks - 1) - np.maximum(sp.lo, 1), 0)
    return int(n) if np.ndim(n) == 0 else n


def model_time(profiles: "Profiles", host: str) -> StageTime:
    """The whole model's compute time on ``host`` (every block, nothing recomputed): what hosts'
    speeds are compared by (the plan's lower bound, scaling a measured optimizer step)."""
    return stage_time(profiles, host, Span(0, profiles.num_blocks))


def block_time(profiles: "Profiles", host: str, lo: Index, hi: Index, samples: float,
               backward: bool = False) -> float | np.ndarray:
    """Seconds of blocks [lo, hi) on ``samples`` samples, without the runtime's per-call cost
    (what re-planning fits its per-block-group factors against)."""
    per, fixed = (profiles.table(host), profiles.fixed(host))
    k = 1 if backward else 0
    return BlockSums(fixed[k])(lo, hi) + samples * BlockSums(per[k])(lo, hi)


def layer_forward_calls(profiles: "Profiles", host: str, samples: int) -> np.ndarray:
    """Seconds of one forward call of each decoder layer on ``samples`` samples (what hosts'
    capacities compare)."""
    n = profiles.num_blocks
    return (profiles.fixed(host)[0] + samples * profiles.table(host)[0])[layer_blocks(0, n - 2)]


def layer_blocks(c: int, c2: int) -> slice:
    """The blocks of decoder layers [c, c2)."""
    return slice(c + 1, c2 + 1)


def layer_forward(profiles: "Profiles", host: str, c: int, c2: int) -> np.ndarray:
    """Forward seconds per sample of each decoder layer of [c, c2): what recomputing it adds."""
    return profiles.table(host)[0][layer_blocks(c, c2)]


# ----------------------------------------------------------------------------- memory and bytes
def stage_weights(profiles: "Profiles", span: Span | PlanStage) -> float | np.ndarray:
    """Parameter bytes of a stage."""
    sp = span if isinstance(span, Span) else Span.of_stage(span)
    got = profiles.sums.get("param_bytes")
    if got is None or got[0] is not profiles.param_bytes:
        got = profiles.sums["param_bytes"] = (profiles.param_bytes, BlockSums(profiles.param_bytes))
    return got[1](sp.lo, sp.hi)


def boundary_bytes(profiles: "Profiles", span: Span | PlanStage) -> float | np.ndarray:
    """Bytes per sample of a stage's output (what its next stage receives)."""
    sp = span if isinstance(span, Span) else Span.of_stage(span)
    return profiles.act_bytes[np.asarray(sp.hi) - 1] if np.ndim(sp.hi) else float(profiles.act_bytes[sp.hi - 1])


def rank_weights(profiles: "Profiles", chunks: Sequence[PlanStage]) -> float:
    """Parameter bytes of the chunks one rank holds, the tied weight once where they hold both
    ends (one chunk holding the whole model included): what its one optimizer step updates."""
    w = sum(float(stage_weights(profiles, s)) for s in chunks)
    return w - (profiles.tied_bytes if chunks and chunks[0].has_embed and chunks[-1].has_tail else 0)


def tied_rows_bytes(profiles: "Profiles", plan: Plan) -> float:
    """Bytes a ``rows`` tied sync moves each way per step: the touched rows of the tied weight
    (``formats.tied_rows``), in the weight's own dtype (no indices: both ends read them off the batch)."""
    assert plan.tied_sync is not None
    vocab = max(1, plan.model.vocab_size)
    return profiles.tied_bytes * tied_rows(plan.tied_sync, vocab, plan.global_batch * plan.seq_len) / vocab


def tied_sync_bytes(profiles: "Profiles", plan: Plan) -> float:
    """Bytes of the tied-weight sync as an all-reduce buffer: the weight, or for ``rows`` both of its
    one-way messages (sent one after the other, they take what a two-member ring all-reduce of
    that many bytes takes)."""
    if plan.tied_sync is not None and plan.tied_sync.kind == "rows":
        return 2 * tied_rows_bytes(profiles, plan)
    return float(profiles.tied_bytes)


@dataclass(frozen=True)
class StageActivations:
    """A stage's activation bytes per sample as the memory model weighs them: kept for backward,
    recomputed (only their input kept), and the largest recomputed layer (live while recomputing)."""

    kept: float | np.ndarray
    recomputed: float | np.ndarray
    largest_recomputed: float | np.ndarray
    body: float | np.ndarray = 0.0
    """The layers' bytes, kept or recomputed, unweighted (what ``Kb`` prices; the embedding's
    output counts 0: ``cost.memory.held_activation_bytes``)."""
    tail: float | np.ndarray = 0.0
    """The tail's logits bytes, unweighted, where the span holds it (what ``Kwt`` prices)."""
    layer: float | np.ndarray = 0.0
    """The largest decoder layer's bytes, unweighted (what ``Kl`` prices)."""


@dataclass(frozen=True)
class MemoryTerms:
    """A device's predicted peak split by the memory model's coefficients (see :meth:`StageMemory.terms`)."""

    weights: float
    """Parameter bytes (alpha's multiplier)."""
    kp_bytes: float
    """Kp's multiplier: samples x (in flight x kept activations + the largest recomputed layer)."""
    fixed_bytes: float
    """Bytes no coefficient scales: the recomputed layers' inputs held per micro-batch in flight."""
    kept_per_sample: float
    """Kept activation bytes per sample (as the model weighs them)."""


class StageMemory:
    """THE accessor of a stage's peak memory per device, for one model and one memory model."""

    def __init__(self, profiles: "Profiles", memory: "MemoryEstimator"):
        self.profiles, self.memory = profiles, memory
        self.weights = BlockSums(profiles.param_bytes)
        self.acts = BlockSums(memory.activations(profiles.act_bytes))
        self.raw_acts = BlockSums(held_activation_bytes(profiles.act_bytes))
        self._largest: BlockMax | None = None
        self._layer: BlockMax | None = None

    @property
    def largest(self) -> BlockMax:
        if self._largest is None:
            self._largest = BlockMax(self.profiles.act_bytes)
        return self._largest

    @property
    def largest_layer(self) -> BlockMax:
        """Range maxima over the decoder layers only (the embedding and tail count 0)."""
        if self._layer is None:
            acts = np.array(self.profiles.act_bytes, dtype=float)
            acts[0] = acts[-1] = 0.0
            self._layer = BlockMax(acts)
        return self._layer

    def activations(self, span: Span | PlanStage) -> StageActivations:
        sp = span if isinstance(span, Span) else Span.of_stage(span)
        rec = self.acts.over(sp.runs)
        tail = np.where(np.asarray(sp.hi) == len(self.profiles.act_bytes), float(self.profiles.act_bytes[-1]), 0.0)
        body = self.raw_acts(sp.lo, sp.hi) - tail
        layer = self.largest_layer(sp.lo, sp.hi)
        scalar = lambda x: float(x) if np.ndim(x) == 0 else x  # noqa: E731
        return StageActivations(self.acts(sp.lo, sp.hi) - rec, rec, self.largest.over(sp.runs), scalar(body),
                                scalar(tail), scalar(layer))

    def end_weights(self, span: Span | PlanStage) -> float | np.ndarray:
        """Parameter bytes of the tail (the lm_head) where the span holds it, else 0: what the
        memory model's ``Ke`` prices (``cost.memory``): 0 in files fitted on a runtime that adds
        the lm_head's weight gradient in place, as the embedding's (``models.embedding``)."""
        sp = span if isinstance(span, Span) else Span.of_stage(span)
        pb = np.asarray(self.profiles.param_bytes, dtype=float)
        out = np.where(np.asarray(sp.hi) == len(pb), pb[-1], 0.0)
        return float(out) if np.ndim(out) == 0 else out

    def layer_activations(self, c: int, c2: int) -> np.ndarray:
        """Activation bytes per sample of each decoder layer of [c, c2) (as the model weighs them)."""
        return self.memory.activations(self.profiles.act_bytes)[layer_blocks(c, c2)]

    @staticmethod
    def split_of(sp: Span, split: int) -> int | np.ndarray:
        """``split`` where the span's input takes a gradient; 0 where it holds the embedding (its
        ``I`` computes nothing: the whole backward waits for ``W`` and holds no more)."""
        return np.where(np.asarray(sp.lo) == 0, 0, split) if np.ndim(sp.lo) else (0 if sp.lo == 0 else split)

    def terms(self, span: Span | PlanStage, samples: float, in_flight: int, split: int = 0, heap: bool = True
              ) -> MemoryTerms:
        """The peak of a device as a linear form in the memory model's coefficients (what
        re-planning refits them by): ``base + alpha·weights + kp·kp_bytes + fixed_bytes``; the
        micro-batches between I and W (``split``) count in ``fixed_bytes`` with the model's Kw, the
        running backward and layer with its Kb and Kl."""
        sp = span if isinstance(span, Span) else Span.of_stage(span)
        a = self.activations(sp)  # the tail's logits weighted by Kt / Kp
        kept, rec, amax = float(a.kept), float(a.recomputed), float(a.largest_recomputed)
        held_w = samples * float(self.split_of(sp, split)) * (self.memory.kw * kept
                                                              + self.memory.kw_tail_adjust * float(a.tail))
        running = samples * (self.memory.once(float(a.body), float(a.layer))
                             + float(self.memory.split_once(self.split_of(sp, split), float(a.body), heap)))
        return MemoryTerms(weights=float(self.weights(sp.lo, sp.hi)), kp_bytes=samples * (in_flight * kept + amax),
                           fixed_bytes=(samples * in_flight * rec + self.memory.ke * float(self.end_weights(sp)) + held_w
                                        + running),
                           kept_per_sample=kept)

    def per_sample(self, span: Span | PlanStage, in_flight: int, split: int = 0, heap: bool = True
                   ) -> float | np.ndarray:
        """Bytes per sample of one device's share of a micro-batch, ``in_flight`` micro-batches held,
        ``split`` of them between their I and their W (``heap``: a W ran before)."""
        sp = span if isinstance(span, Span) else Span.of_stage(span)
        a = self.activations(sp)
        return self.memory.per_sample(a.kept, a.recomputed, in_flight, a.largest_recomputed, self.split_of(sp, split),
                                      a.body, a.tail, a.layer, heap)

    def peak_per_sample(self, span: Span | PlanStage, states: Sequence[PeakState]) -> float | np.ndarray:
        """Bytes per sample at the worst of a one-chunk stage's ``states`` (``schedules.peak_states``;
        elementwise for a vector of spans): the weights do not depend on the state, so the worst
        per sample is the worst peak."""
        sp = span if isinstance(span, Span) else Span.of_stage(span)
        return functools.reduce(np.maximum, (self.per_sample(sp, n, w, heap) for n, w, heap in states))

    def peak_over(self, span: Span | PlanStage, samples: float, states: Sequence[PeakState]) -> float | np.ndarray:
        """Predicted peak bytes of a one-chunk stage: its worst state (:meth:`peak_per_sample`)."""
        sp = span if isinstance(span, Span) else Span.of_stage(span)
        return self.static(sp) + samples * self.peak_per_sample(sp, states)

    def static(self, span: Span | PlanStage) -> float | np.ndarray:
        """Bytes independent of the samples: the base and the weights' (with gradients, optimizer state)."""
        sp = span if isinstance(span, Span) else Span.of_stage(span)
        return self.memory.static(self.weights(sp.lo, sp.hi), self.end_weights(sp))

    def chunks_peak(self, chunks: Sequence[tuple[PlanStage, float]], held: Iterable[Iterable[tuple[int, ...]]],
                    shared_bytes: float = 0.0) -> float:
        """Predicted peak bytes of a device holding several chunks (``(chunk, samples)`` each): the
        weights of all of them (``shared_bytes`` held once though two chunks own them: the tied
        weight of a V placement), plus the activations at the worst of the ``held`` profiles
        (``(chunk, micro-batches held)`` at each step of the device's order,
        ``schedules.in_flight_chunks``; with a third entry, those of them between their I and
        their W: ``schedules.held_profiles``), plus the largest recomputed layer and running
        backward of any chunk (one backward runs at a time), plus the heap its chunks leave
        (``MemoryEstimator.chunks_heap``). With one chunk this is :meth:`peak`."""
        acts = {c.index: (s, self.activations(c)) for c, s in chunks}
        embed = {c.index: c.has_embed for c, _ in chunks}
        static = self.memory.static(sum(float(self.weights(*stage_blocks(c.layers, c.has_embed, c.has_tail)))
                                        for c, _ in chunks) - shared_bytes,
                                    max(float(self.end_weights(c)) for c, _ in chunks))
        worst = max((sum(acts[c][0] * self.memory.per_sample(acts[c][1].kept, acts[c][1].recomputed, n, 0.0,
                                                              0 if embed[c] or not w else w[0], 0.0, acts[c][1].tail)
                         for c, n, *w in prof if c in acts) for prof in held), default=0.0)
        largest = max(s * self.memory.per_sample(0.0, 0.0, 0, a.largest_recomputed, 0, a.body, 0.0, a.layer)
                      for s, a in acts.values())
        # the heap a split backward leaves (Kz): once, for the worst chunk with a micro-batch past its I;
        # the heap the chunks' interleaved backwards leave (Kc per chunk beyond the first): the larger
        past = {c for prof in held for c, n, *w in prof if c in acts and not embed[c] and w and w[0] > 0}
        split = max((acts[c][0] * float(self.memory.split_once(1, float(acts[c][1].body))) for c in past), default=0.0)
        return float(static + worst + largest + self.memory.chunks_heap(len(acts), split))

    def peak(self, span: Span | PlanStage, samples: float, in_flight: int, split: int = 0,
             heap: bool = True) -> float | np.ndarray:
        """Predicted peak bytes of a device computing ``samples`` samples of each micro-batch,
        ``in_flight`` micro-batches held, ``split`` of them between their I and their W (``heap``:
        a W ran before)."""
        sp = span if isinstance(span, Span) else Span.of_stage(span)
        a = self.activations(sp)
        return self.memory.peak(self.weights(sp.lo, sp.hi), a.kept, a.recomputed, samples, in_flight,
                                a.largest_recomputed, self.end_weights(sp), self.split_of(sp, split), a.body, a.tail,
                                a.layer, heap)
