"""Fitting corrected costs to a run: host factors, call overhead, links, optimizer and memory.

Per host, scale factors are fitted by non-negative least squares (``scipy.optimize.nnls``): one
forward and one backward factor per group of blocks the data can tell apart. Links get the
throughput of matched send/receive pairs; the optimizer's seconds per parameter byte and the
memory model's coefficients are refitted from the optimizer events and the ranks' peak RSS.
"""
from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import numpy as np

from ...formats import Bandwidth, MemoryModel, MemorySample, Plan
from ...cost import (MemoryEstimator, Profiles, Span, StageMemory, block_time, layer_forward_calls, model_time,
                     rank_weights, recompute_runs, stage_blocks, stage_time)
from ...schedules import peak_states, rank_profiles
from .read import Measurements, Transfer

if TYPE_CHECKING:
    from .read import OldCosts


# ----------------------------------------------------------------------------- fitting
BUSY = 0.5
"""A host that computed for less than this share of the step and ran faster than its profile keeps
its profile's speed. Its profile timed passes back to back; a host that waits between passes can
run the next one faster out of what it rested (a CPU quota refilled while it waited, a turbo or
thermal budget), a speed it loses when a new plan keeps it busy. On the demo's homelab, a Pi 3
holding one or two layers (busy 23-50% of the step) measured 0.74-0.89 of its profile's times; the
re-plans, taking that, gave it three layers, where it ran 22% slower than its profile and the step
got 5-13% slower than the plan it replaced. Slower than profiled is always taken (contention, a
hotter device: a busier plan only makes it worse). Only against measured profiles (layers files):
a table made from the model's FLOPs at a nominal speed is corrected whichever way the run says."""

def _ls_factor(y: np.ndarray, p: np.ndarray) -> float:
    """Least-squares scale k minimising Σ(y − k·p)² (k >= 0)."""
    den = float(p @ p)
    return max(0.0, float(y @ p) / den) if den > 0 else float("nan")


def _nnls(A: np.ndarray, y: np.ndarray) -> np.ndarray:
    from scipy.optimize import nnls

    scale = np.where(np.abs(A).max(axis=0) > 0, np.abs(A).max(axis=0), 1.0)
    coef, _ = nnls(A / scale, y)
    return coef / scale


@dataclass
class HostFit:
    """Measured / predicted per host: overall, forward, backward, and per block group."""

    host: str
    ranks: list[int]
    ranges: list[tuple[int, int]]
    """Layer ranges [start, end) of every chunk this host ran (decoder layers, as in plan.json)."""
    points: int
    factor: float
    forward: float
    backward: float
    groups: list[dict[str, Any]]
    """Per group of blocks [lo, hi) (0 = embed, N + 1 = tail): forward and backward factors."""
    rms_rel: float
    """Root mean square of the fit's residuals over the mean measured pass time."""
    measured_s: float
    predicted_s: float
    """Mean forward + backward per micro-batch (all of the host's ranks)."""
    busy: float = 1.0
    """Share of the step the host computed (its ranks' passes over the step time; median step)."""
    held_from: dict[str, float] | None = None
    """Where the host ran faster than its profile while mostly idle (:data:`BUSY`): the measured
    overall, forward and backward factors; the fit's factors are then held at 1 (the profile's speed)."""


@dataclass(frozen=True)
class _Chunk:
    """What one rank computes of one chunk: its blocks [lo, hi), recomputed runs and samples."""

    lo: int
    hi: int
    rec: tuple[tuple[int, int], ...]
    samples: int


def _chunks_of(plan: Plan, ranks: Sequence[int]) -> dict[tuple[int, int], _Chunk]:
    """(rank, chunk index) -> its blocks, for every chunk the ranks hold."""
    out = {}
    for r in ranks:
        for st in plan.stages_of_rank(r):
            lo, hi = stage_blocks(st.layers, st.has_embed, st.has_tail)
            out[(r, st.index)] = _Chunk(lo, hi, recompute_runs(st.layers[0], st.recompute), st.device(r).samples)
    return out


def _pass_time(profiles: Profiles, host: str, a: int, b: int, n: int, kind: str, whole: bool = False) -> float:
    """Seconds of blocks [a, b) in one ``kind`` pass on ``n`` samples, without the runtime's per-call
    cost and recomputation: F, B, or a zero-bubble schedule's I / W (the backward split as priced;
    ``whole``: of a chunk holding the embedding, whose W is its whole backward and I nothing)."""
    if whole and kind in ("I", "W"):
        return 0.0 if kind == "I" else float(block_time(profiles, host, a, b, n, backward=True))
    if kind in ("F", "B"):
        return float(block_time(profiles, host, a, b, n, backward=kind == "B"))
    t = stage_time(profiles, host, Span(a, b))
    return (t.backward_input(n) if kind == "I" else t.backward_weight(n)) - t.call


def _design(host: str, profiles: Profiles, meas: Measurements, info: Mapping[tuple[int, int], _Chunk],
            groups: Sequence[tuple[int, int]]) -> tuple[np.ndarray, ...]:
    """The least-squares rows: forwards (Af, yf); backward passes B, I and W (Ab, yb) with the
    recomputed forwards inside B and I (Ar, priced by the forward factors)."""
    rows_f, y_f, rows_b, y_b, rec_rows = [], [], [], [], []
    for c in meas.compute:
        ch = info.get((c.rank, c.stage))
        if ch is None:
            continue
        inside = [ch.lo <= a and b <= ch.hi for a, b in groups]
        row = [_pass_time(profiles, host, a, b, ch.samples, c.kind, ch.lo == 0) if ok else 0.0
               for (a, b), ok in zip(groups, inside)]
        if c.kind == "F":
            rows_f.append(row)
            y_f.append(c.seconds)
            continue
        rows_b.append(row)
        rec_rows.append([sum(block_time(profiles, host, max(x, a), min(y, b), ch.samples) for x, y in ch.rec
                             if max(x, a) < min(y, b)) if ok and c.kind != ("I" if ch.lo == 0 else "W") else 0.0
                         for (a, b), ok in zip(groups, inside)])
        y_b.append(c.seconds)
    return tuple(np.array(x, dtype=float) for x in (rows_f, y_f, rows_b, y_b, rec_rows))


def fit_host(host: str, ranks: Sequence[int], plan: Plan, profiles: Profiles, meas: Measurements) -> HostFit:
    """Forward/backward factors per block group of one host (nnls), and overall ones.

    The groups are the pieces the blocks of every chunk the host ran cut the model into; when
    those do not determine them (e.g. overlapping ranges seen only together) one factor covers all.
    A zero-bubble schedule's I and W passes are rows of the backward fit (each its part of the
    backward as priced).
    """
    info = _chunks_of(plan, ranks)
    bounds = sorted({x for ch in info.values() for x in (ch.lo, ch.hi)})
    groups = [(a, b) for a, b in zip(bounds, bounds[1:]) if any(ch.lo <= a and b <= ch.hi for ch in info.values())]
    Af, yf, Ab, yb, Ar = _design(host, profiles, meas, info, groups)
    if not len(yf) or not len(yb):
        raise ValueError(f"host {host}: the timelines hold no forward/backward events of its ranks {list(ranks)}")
    kf_all = _ls_factor(yf, Af.sum(axis=1))
    ok_groups = len(groups) > 1 and np.linalg.matrix_rank(np.unique(Af > 0, axis=0).astype(float)) == len(groups)
    kf = _nnls(Af, yf) if ok_groups else np.full(len(groups), kf_all)
    yb_net = yb - Ar @ kf                                   # recomputed forwards run inside backward
    kb_all = _ls_factor(yb_net, Ab.sum(axis=1))
    kb = _nnls(Ab, yb_net) if ok_groups else np.full(len(groups), kb_all)
    pf, pb_ = Af @ kf, Ab @ kb + Ar @ kf
    # RMS of the residuals over the mean measured pass: per-event relative errors would let one
    # near-empty pass (a W of an embedding-only chunk takes microseconds) dominate the figure.
    y_mean = max(float(np.mean(np.concatenate([yf, yb]))), 1e-12)
    resid = np.concatenate([yf - pf, yb - pb_]) / y_mean
    p_all = np.concatenate([Af.sum(axis=1), Ab.sum(axis=1) + Ar.sum(axis=1)])
    y_all = np.concatenate([yf, yb])
    ranges = sorted({tuple(st.layers) for r in ranks for st in plan.stages_of_rank(r)})
    return HostFit(host=host, ranks=sorted(ranks), ranges=ranges,
                   points=len(y_all), factor=_ls_factor(y_all, p_all), forward=kf_all, backward=kb_all,
                   groups=[{"blocks": [a, b], "forward": float(x), "backward": float(z)}
                           for (a, b), x, z in zip(groups, kf, kb)],
                   rms_rel=float(np.sqrt(np.mean(resid ** 2))),
                   measured_s=float(y_all.sum()) / (len(yf) or 1), predicted_s=float(p_all.sum()) / (len(yf) or 1))


def corrected_table(profiles: Profiles, fit: HostFit) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The host's tables times its factors, per-sample and per-call parts alike (blocks it did not
    run: its overall factors): (forward, backward per sample, forward, backward per call)."""
    f, b = profiles.table(fit.host)
    f0, b0 = profiles.fixed(fit.host)
    kf = np.full(len(f), fit.forward)
    kb = np.full(len(b), fit.backward)
    for g in fit.groups:
        lo, hi = g["blocks"]
        kf[lo:hi], kb[lo:hi] = g["forward"], g["backward"]
    return f * kf, b * kb, f0 * kf, b0 * kb


@dataclass
class LinkFit:
    src: str
    dst: str
    messages: int
    bytes_per_sec: float
    latency_s: float
    old_bytes_per_sec: float | None
    old_latency_s: float | None
    at_clock_resolution: int = 0
    """Messages faster than the clocks' alignment can resolve (counted at that resolution)."""
    censored: int = 0
    """Messages left out because they overlapped another on their row, or another on a shared
    interface of their sender or receiver (all of them: old rate kept)."""
    capped_from: float | None = None
    """The fitted rate, where it exceeded the probe's measured capacity of the link (then the
    rate is that capacity)."""

    @property
    def change(self) -> float | None:
        return self.bytes_per_sec / self.old_bytes_per_sec if self.old_bytes_per_sec else None


def fit_links(plan: Plan, meas: Measurements, old: Bandwidth) -> list[LinkFit]:
    """Per directed host pair: throughput (and latency, when message sizes vary enough to tell).

    Where ``old`` is a probe's file (:attr:`~torchpp.formats.Bandwidth.probed`), no link is fitted
    faster than the probe measured it: a pipeline message cannot beat the link, but its clock (both
    ends posted -> arrived) reads one that was already buffered when its receive was posted as nearly
    instant. On the demo's homelab the fits read pi4a -> pi3 at 523-605 MB/s (probed 102-109 MB/s, the
    link shaped to 37.5 MB/s), and the re-plans priced on them were slower than the plans they replaced."""
    probed = old.probed
    by: dict[tuple[str, str], list[Transfer]] = defaultdict(list)
    for t in meas.transfers:
        a, b = plan.device_of_rank(t.src).host, plan.device_of_rank(t.dst).host
        if a != b:
            by[(a, b)].append(t)
    queued = shared_interface_overlaps(by, old)
    out = []
    for (a, b), all_ts in sorted(by.items()):
        clean = [t for t in all_ts if not t.censored and id(t) not in queued]
        old_rate = old.rate(a, b) if old.has(a, b) else None
        if not clean and old_rate is not None:
            out.append(LinkFit(a, b, len(all_ts), old_rate, old.latency(a, b), old_rate, old.latency(a, b),
                               censored=len(all_ts)))
            continue  # every message overlapped another on its row: only a lower bound on time
        ts = clean or all_ts
        nbytes = np.array([t.nbytes for t in ts], dtype=float)
        floor = np.array([max(t.clock_s, 1e-9) for t in ts])
        raw = np.array([t.seconds for t in ts])
        secs = np.maximum(raw, floor)    # a transfer cannot be timed more finely than the clocks align
        old_lat = old.latency(a, b) if old.has(a, b) else None
        lat = None
        if len(ts) >= 3 and nbytes.max() >= 1.5 * nbytes.min():
            lat_fit, per_byte = _nnls(np.stack([np.ones_like(nbytes), nbytes], axis=1), secs)
            if per_byte > 0:
                lat, rate = float(lat_fit), 1.0 / float(per_byte)
        if lat is None:
            lat = min(old_lat or 0.0, 0.5 * float(secs.min()))
            rate = float(np.median(nbytes / np.maximum(secs - lat, floor)))
        capped = None
        if probed and old_rate is not None and rate > old_rate:
            capped, rate = rate, old_rate
        out.append(LinkFit(a, b, len(all_ts), rate, lat, old_rate, old_lat, int((raw < floor).sum()),
                           len(all_ts) - len(clean) if clean else 0, capped))
    return out


def shared_interface_overlaps(by: dict[tuple[str, str], list[Transfer]], bw: Bandwidth) -> set[int]:
    """ids of the transfers that were on the wire while another left the same host's shared uplink
    for another host, or reached the same host's shared downlink from another (``bw``'s interfaces):
    they shared the interface, so their time says less than the link's rate; left out like a
    message that overlapped another on its row."""
    out: set[int] = set()
    for key_of, shared in ((lambda ab: ab[0], bw.egress_bytes_per_sec), (lambda ab: ab[1], bw.ingress_bytes_per_sec)):
        on: dict[str, list[tuple[float, float, int, tuple[str, str]]]] = defaultdict(list)
        for ab, ts in by.items():
            if key_of(ab) in shared:
                on[key_of(ab)].extend((t.start_s + 1e9 * t.step, t.end_s + 1e9 * t.step, id(t), ab) for t in ts)
        for spans in on.values():
            spans.sort()
            for i, (s0, e0, k0, ab0) in enumerate(spans):
                for s1, e1, k1, ab1 in spans[i + 1:]:
                    if s1 >= e0:
                        break
                    if ab1 != ab0:
                        out.update((k0, k1))
    return out


def rank_param_bytes(plan: Plan, profiles: Profiles, rank: int) -> float:
    """Parameter bytes of every chunk ``rank`` holds, the tied weight once where it holds both ends
    (what its one optimizer step updates, as :class:`~torchpp.cost.MeasuredCost` prices it)."""
    return rank_weights(profiles, plan.stages_of_rank(rank))


def fit_optimizer(plan: Plan, profiles: Profiles, meas: Measurements) -> dict[str, float]:
    """Seconds per parameter byte of the optimizer step, per host that ran one."""
    per: dict[str, list[float]] = defaultdict(list)
    for r, durs in meas.optimizer.items():
        w = rank_param_bytes(plan, profiles, r)
        if w > 0 and durs:
            per[plan.device_of_rank(r).host].append(statistics.median(durs) / w)
    return {h: float(statistics.mean(v)) for h, v in per.items()}


def memory_terms(plan: Plan, profiles: Profiles, rank: int, memory: MemoryEstimator
                 ) -> tuple[float, float, float, tuple[int, int, int]]:
    """(weights W, Kp's multiplier, bytes independent of the coefficients, (samples, in-flight, A)) of a rank.

    The planner's memory model is ``base + alpha·W + s·n·(Kp·A_kept + A_rec) + Kp·A_max·s`` per
    chunk; a rank holding several chunks (``StageMemory.chunks_peak``) holds all their weights (the
    tied weight once), the activations of the worst moment of its order (``schedules.rank_profiles``,
    the worst as ``memory`` weighs them; those between their I and W priced with its Kw, which the
    refit keeps) and the largest recomputed layer of any chunk; a one-chunk rank at the worst state
    of its order (``schedules.peak_states``), as ``StageMemory.peak_over`` prices it. With
    several chunks, samples x in-flight is the sum over the chunks held at that moment and A the
    kept bytes per sample averaged over them.
    """
    sm = StageMemory(profiles, memory)
    chunks = {c.index: (c, c.device(rank).samples) for c in plan.stages_of_rank(rank)}
    none = {i: sm.terms(c, s, 0) for i, (c, s) in chunks.items()}

    def held(prof: Sequence[tuple[int, int, int]]) -> tuple[float, float, int]:
        """(Kp's multiplier, fixed bytes, samples x micro-batches) of the activations held (those
        between their I and W priced in the fixed bytes with the prior's Kw, which is kept)."""
        kp = fixed = 0.0
        sn = 0
        for i, n, w in prof:
            c, s = chunks[i]
            t = sm.terms(c, s, n, w)
            kp, fixed, sn = kp + t.kp_bytes - none[i].kp_bytes, fixed + t.fixed_bytes, sn + s * n
        return kp, fixed, sn

    if len(chunks) == 1:  # every state of its order, the heap a W leaves only after the first W
        (i, (c, s)), = chunks.items()

        def state(n: int, w: int, heap: bool) -> tuple[float, float, int]:
            t = sm.terms(c, s, n, w, heap)
            return t.kp_bytes - none[i].kp_bytes, t.fixed_bytes, s * n

        cands = [state(*x) for x in peak_states(plan.schedule, plan.num_stages, c.index, plan.num_microbatches)]
    else:
        cands = [held([p for p in prof if p[0] in chunks]) for prof in rank_profiles(plan, rank)] or [held([])]
    kp, fixed, sn = max(cands, key=lambda h: memory.kp * h[0] + h[1])
    largest = max(t.kp_bytes for t in none.values())
    if len(chunks) == 1:
        (i, (_, s)), = chunks.items()
        return none[i].weights, kp + largest, fixed, (s, sn // s if s else 0, int(none[i].kept_per_sample))
    return rank_param_bytes(plan, profiles, rank), kp + largest, fixed, (sn, 1, int(kp / sn) if sn else 0)


def refit_memory(plan: Plan, profiles: Profiles, peaks: Mapping[int, int], prior: MemoryEstimator
                 ) -> tuple[MemoryModel, str]:
    """Fit the memory model to the ranks' peaks: all three coefficients where at least three ranks
    differ and the fit keeps both slopes positive, else the base alone (the prior's slopes kept)."""
    ranks = sorted(peaks)
    rows = [memory_terms(plan, profiles, r, prior) for r in ranks]
    W = np.array([x[0] for x in rows])
    K = np.array([x[1] for x in rows])
    y = np.array([float(peaks[r]) for r in ranks]) - np.array([x[2] for x in rows])
    A = np.stack([np.ones_like(W), W, K], axis=1)
    distinct = len({(round(w), round(k)) for w, k in zip(W, K)})
    full = None
    if distinct >= 3 and np.linalg.matrix_rank(A / np.maximum(np.abs(A).max(axis=0), 1e-30)) == 3:
        full = _nnls(A, y)
    if full is not None and full[1] > 0 and full[2] > 0:
        base, alpha, kp = full
        how = f"refitted base, alpha and Kp on {len(ranks)} ranks' peak RSS"
    else:  # too few distinct ranks to tell the terms apart: keep their coefficients, fit the offset
        alpha, kp = prior.alpha, prior.kp
        base = float(np.mean(y - alpha * W - kp * K))
        how = (f"refitted base on {len(ranks)} rank(s)' peak RSS (alpha and Kp kept: "
               f"{distinct} distinct stage(s) cannot separate them)")
    pred = base + alpha * W + kp * K
    res = y - pred
    ss = float(((y - y.mean()) ** 2).sum())
    samples = []
    for r, (w, _, _, (s, n, kept)), p, pk in zip(ranks, rows, pred, y):
        ch = plan.stages_of_rank(r)  # several chunks: the span from the first's start to the last's end
        samples.append(MemorySample(start=ch[0].layers[0], end=ch[-1].layers[1], has_embed=ch[0].has_embed,
                                    has_tail=ch[-1].has_tail, weights_bytes=int(w), activation_bytes_per_sample=kept,
                                    batch=max(1, s * n), peak_bytes=int(peaks[r]),
                                    predicted_bytes=float(peaks[r] - pk + p)))
    mm = MemoryModel(base=float(base), alpha=float(alpha), Kp=float(kp),
                     r2=1.0 - float((res ** 2).sum()) / ss if ss > 0 else float("nan"),
                     residuals=[float(x) for x in res], samples=samples, model=plan.model.name,
                     microbatch=plan.micro_batch_size, host="measured ranks",
                     Kt=None if prior.kt is None or prior.kp <= 0 else float(kp) * prior.kt / prior.kp,
                     # the terms the fit takes as given stay (subtracted from y by ``StageMemory.terms``):
                     # the lm_head's (Ke), between I and W (Kw, Kz), the running backward and layer (Kb,
                     # Kl), and the runtime's own RSS, reserved from every budget
                     Ke=prior.ke or None, Kw=prior.kw or None, Kb=prior.kb or None, Kwt=prior.kwt, Kz=prior.kz or None,
                     Kl=prior.kl or None,
                     process_bytes=prior.process)
    return mm, how


def capacity(profiles: Profiles, ref: str, host: str, batch: int) -> float:
    """Median over decoder layers of ref forward / host forward on ``batch`` samples (as
    ``torchpp capacities``)."""
    t_ref, t_host = layer_forward_calls(profiles, ref, batch), layer_forward_calls(profiles, host, batch)
    return float(np.median(t_ref / np.maximum(t_host, 1e-30)))


# ----------------------------------------------------------------------------- the corrected cost model
@dataclass
class CostFit:
    """Every host's fit and the corrected profiles (factors times the old tables, measured call overhead)."""

    fits: dict[str, HostFit]
    profiles: Profiles
    ref: str
    """Capacities are relative to this host."""
    old_capacity: dict[str, float]
    new_capacity: dict[str, float]


def per_call_s(meas: Measurements, ranks: Sequence[int]) -> float | None:
    """The runtime's seconds per call on the host of ``ranks``: each traced step's mean gap, then
    the median over steps, as the measured step time is the median step (None: no gaps).

    A step the machine stalled in (preempted, page faults of the first steps) made the old plan's
    re-pricing 2.5x its measured median step under load, through one mean over every gap."""
    by_step: dict[int, list[float]] = defaultdict(list)
    for r in ranks:
        for step, gaps in meas.gaps.get(r, {}).items():
            by_step[step].extend(gaps)
    means = [float(np.mean(g)) for g in by_step.values() if g]
    return float(np.median(means)) if means else None


def busy_share(meas: Measurements, ranks: Sequence[int]) -> float:
    """Seconds the ranks computed in a step over the step's time, median over the traced steps."""
    by_step: dict[int, float] = defaultdict(float)
    for c in meas.compute:
        if c.rank in ranks:
            by_step[c.step] += c.seconds
    shares = [t / meas.steps[n] for n, t in by_step.items() if meas.steps.get(n)]
    return float(np.median(shares)) if shares else 1.0


def hold_idle_speedup(f: HostFit) -> None:
    """Raise every factor of ``f`` below 1 to 1 where the host was busy less than :data:`BUSY`."""
    if f.busy >= BUSY or min([f.factor, f.forward, f.backward, *(g[k] for g in f.groups for k in ("forward", "backward"))]) >= 1:
        return
    f.held_from = {"factor": f.factor, "forward": f.forward, "backward": f.backward}
    f.factor, f.forward, f.backward = max(1.0, f.factor), max(1.0, f.forward), max(1.0, f.backward)
    f.groups = [{**g, "forward": max(1.0, g["forward"]), "backward": max(1.0, g["backward"])} for g in f.groups]


def fit_hosts(plan: Plan, old: "OldCosts", meas: Measurements) -> CostFit:
    """Fit every host the plan used and build the corrected profiles (hosts it did not use keep theirs)."""
    prof, files = old.profiles, old.files
    ranks_of: dict[str, list[int]] = defaultdict(list)
    for r in plan.ranks:
        ranks_of[plan.device_of_rank(r).host].append(r)
    fits = {h: fit_host(h, rs, plan, prof, meas) for h, rs in sorted(ranks_of.items())}
    for h, f in fits.items():
        f.busy = busy_share(meas, ranks_of[h])
        if files:  # measured profiles; a FLOP model's nominal speed is no speed to hold a host at
            hold_idle_speedup(f)
    cap = old.capacities
    ref = cap.ref_host if cap is not None and cap.ref_host in prof.fwd else (files[0].host if files else old.planned[0])
    cap_batch = next((lf.run.batch for lf in files if lf.host == ref), old.default_template.run.batch)
    old_cap = {h: capacity(prof, ref, h, cap_batch) for h in prof.fwd}
    new = Profiles(model=prof.model, seq_len=prof.seq_len, param_bytes=prof.param_bytes, act_bytes=prof.act_bytes)
    for h in prof.fwd:
        new.fwd[h], new.bwd[h], new.fwd0[h], new.bwd0[h] = (corrected_table(prof, fits[h]) if h in fits else
                                                              (*prof.table(h), *prof.fixed(h)))
        call = per_call_s(meas, ranks_of.get(h, []))
        new.call[h] = call if call is not None else prof.call.get(h, 0.0)
        # the measured I and W were fitted against predictions that priced the split: it stays priced
        new.split_factor[h] = prof.backward_split_factor(h)
        # its per-layer call cost was fitted inside the I and W rows: it scales with the backward's factor
        new.split_layer[h] = prof.backward_split_layer_s(h) * (fits[h].backward if h in fits else 1.0)
        new.origin[h] = (f"{old.origin[h]} × measured factors (forward {fits[h].forward:.3g}, backward "
                         f"{fits[h].backward:.3g})" if h in fits else old.origin[h])
    new_cap = {h: capacity(new, ref, h, cap_batch) for h in new.fwd}
    return CostFit(fits, new, ref, old_cap, new_cap)


def corrected_bandwidth(old: Bandwidth, links: Sequence[LinkFit], traces: str) -> Bandwidth:
    """The old bandwidth file with the measured links' rates and latencies (its bursts and hosts'
    interfaces as they were measured)."""
    bw = Bandwidth(bytes_per_sec=dict(old.bytes_per_sec), latency_s=dict(old.latency_s),
                   burst_bytes=dict(old.burst_bytes), egress_bytes_per_sec=dict(old.egress_bytes_per_sec),
                   ingress_bytes_per_sec=dict(old.ingress_bytes_per_sec),
                   source=f"{old.source or 'none'}; links measured by torchpp replan from {traces}")
    for lk in links:
        k = Bandwidth.key(lk.src, lk.dst)
        bw.bytes_per_sec[k] = lk.bytes_per_sec
        if lk.latency_s > 0:
            bw.latency_s[k] = lk.latency_s
        else:
            bw.latency_s.pop(k, None)
    return bw


def optimizer_rates(plan: Plan, old: Profiles, new: Profiles, meas: Measurements, hosts: Sequence[str]
                    ) -> tuple[dict[str, float], dict[str, float]]:
    """(every host's, the measured hosts') optimizer seconds per parameter byte. Hosts that ran no
    optimizer step get the measured median scaled by their whole-model time relative to the measured
    hosts' (the corrected profiles', through the cost layer)."""
    measured = fit_optimizer(plan, old, meas)
    opt: dict[str, float] = dict(measured)
    if measured:
        def whole(h: str) -> float:
            return float(model_time(new, h).per_sample)

        ref_s = statistics.median(whole(h) for h in measured)
        med = statistics.median(measured.values())
        for h in hosts:
            if h not in opt:
                opt[h] = med * whole(h) / ref_s
    return opt, measured


@dataclass
class MemoryFit:
    """The refitted memory model (None: the old one kept), how it was obtained, and the estimator
    the new plan is priced with (the old one until the refitted model is written)."""

    model: MemoryModel | None
    how: str
    estimator: MemoryEstimator


def fit_memory(plan: Plan, profiles: Profiles, peaks: Mapping[int, int], prior: MemoryEstimator, refit: bool,
               calibrated: bool = False) -> MemoryFit:
    """Refit the memory model to the ranks' peaks unless told not to, none were traced, or the
    prior was ``calibrated`` (calibrate-memory's file). Its probes span many sizes, micro-batch
    sizes and orders, where one run's few ranks share one micro-batch size and one order: refits
    to them (three coefficients, or the base alone) priced the next plan's ranks worse than the
    calibration did (a 4-rank zb-h1 re-plan: worst 14-19% off against 6-8%)."""
    if peaks and refit and not calibrated:
        return MemoryFit(*refit_memory(plan, profiles, peaks, prior), prior)
    why = ("--no-memory-refit" if not refit else "no peak RSS in the timelines" if not peaks
           else "calibrated by calibrate-memory's probes, which one run's ranks do not improve on")
    return MemoryFit(None, f"kept ({why})", prior)
