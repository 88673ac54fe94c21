"""`torchpp replan`: correct the cost model from a run's timelines, then plan again.

    torchpp replan --plan out/plan.json --traces TRACE_DIR [--layers layers_*.json …] \\
        [--capacities …] [--bandwidth …] [--memory-model …] [--devices …] --out-dir out2/

The run's merged timelines (``timeline_step<N>_all.json``, read with
:mod:`torchpp.trace.analyze`) say how long each rank's forward and backward of every
micro-batch took. The plan's cost model (:class:`~torchpp.cost.MeasuredCost`) says
how long they should have taken. Per host, scale factors are fitted by non-negative least
squares (``scipy.optimize.nnls``): one forward and one backward factor per group of blocks
the data can tell apart (a host that ran two different layer ranges gets one factor per
range piece; blocks it did not run get its overall factor). The factors multiply that host's
own table (its layers file, or the scaled reference it was priced with), so the corrected
table is the host's own from then on. Links get the throughput measured from matched
send/receive pairs: a message's transfer time runs from when both ends had posted it to when
it arrived, so waiting for the sender is not counted (a message whose slice start was set by
the previous message on its row is left out). The runtime's own time between two compute
calls beyond waiting for data (dispatch, posting messages) is measured per host and priced
on every forward and backward (``LayersFile.call_overhead_s``). The optimizer's seconds per
parameter byte and, from the ranks' peak RSS, the memory model are refitted too. The corrected
layers, bandwidth, capacities and memory files are written to the output folder, the same
search as ``torchpp plan`` runs on them, and ``replan_summary.txt/json`` say what changed:
per host the old and new speed, the links that changed, the old plan's measured step time
against its prediction, the old plan re-priced with the corrected costs, the new plan's
predicted step time and the predicted gain.
"""
from __future__ import annotations

import argparse
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from ..formats import (Bandwidth, BlockProfile, Capacities, Devices, FormatError, LayersFile, MemoryModel,
                       MemorySample, Plan, RunInfo, write_json)
from ..schedules import Kind, build
from ..trace.analyze import Event, analyze, events_from_trace
from ..trace.chrome import load_trace
from ..cost import (ANALYTIC_KP, Links, MeasuredCost, MemoryEstimator, Profiles, StageMemory, block_time,
                    recompute_runs, stage_blocks)
from ..schedules import in_flight
from ..sim.measured import price

LINK_CHANGE = 0.10
"""A link whose measured rate differs from the old one by more than this is reported as changed."""


# ----------------------------------------------------------------------------- reading the run
@dataclass
class Compute:
    """One measured forward or backward of one micro-batch on one rank, with its prediction."""

    rank: int
    step: int
    kind: str            # "F" or "B"
    microbatch: int
    seconds: float
    predicted_s: float


@dataclass
class Transfer:
    src: int
    dst: int
    nbytes: int
    seconds: float
    clock_s: float = 0.0
    """Uncertainty of the two ranks' clock alignment (half their ping-pong round trips)."""
    censored: bool = False
    """The later of the two slice starts was set by the previous message on its row, not by the
    message being posted: the transfer may have begun earlier, so its time is a lower bound."""


@dataclass
class Measurements:
    steps: dict[int, float] = field(default_factory=dict)
    """Traced step -> measured step time (s)."""
    compute: list[Compute] = field(default_factory=list)
    transfers: list[Transfer] = field(default_factory=list)
    optimizer: dict[int, list[float]] = field(default_factory=lambda: defaultdict(list))
    peak_rss: dict[int, int] = field(default_factory=dict)
    """rank -> largest peak RSS over the traced steps (bytes)."""
    files: list[str] = field(default_factory=list)
    trace_hosts: dict[int, str] = field(default_factory=dict)
    gaps: dict[int, list[float]] = field(default_factory=lambda: defaultdict(list))
    """rank -> runtime seconds between consecutive compute calls beyond waiting (see call_gaps)."""

    @property
    def step_time_s(self) -> float:
        return statistics.median(self.steps.values())


def find_merged(trace_dir: Path) -> list[tuple[int, Path]]:
    """The merged timelines of a trace folder, with an error that says what is there instead."""
    from ..trace.report import find_timelines

    if not trace_dir.exists():
        raise FileNotFoundError(f"{trace_dir}: no such trace folder")
    try:
        return find_timelines(trace_dir)
    except FileNotFoundError:
        per_rank = sorted(p.name for p in trace_dir.glob("timeline_step*_rank*.json"))
        hint = (f"; it holds per-rank files ({', '.join(per_rank[:3])}{'…' if len(per_rank) > 3 else ''}) but rank 0 "
                "did not write the merged one (did the run finish its traced steps?)" if per_rank else
                "; run `torchrun -m torchpp.train --plan P --trace-dir DIR --trace-steps 2,3` to write them")
        raise FileNotFoundError(f"{trace_dir}: no merged timelines (timeline_step<N>_all.json){hint}") from None


def _check_trace(path: str, trace: dict[str, Any], events: list[Event], plan: Plan, plan_src: str) -> None:
    """The timeline must come from this plan: same ranks, stages, layer ranges and micro-batches."""
    md = trace.get("metadata") or {}
    ws = md.get("world_size")
    if ws is not None and int(ws) != plan.world_size:
        raise FormatError(path, "metadata.world_size", f"{plan.world_size} (the ranks of {plan_src})", ws)
    ranks = {d.rank for s in plan.stages for d in s.devices}
    for r, info in (md.get("ranks") or {}).items():
        if int(r) not in ranks:
            raise FormatError(path, f"metadata.ranks.{r}", f"a rank of {plan_src} (0..{plan.world_size - 1})")
        want = plan.stage_of_rank(int(r)).index
        if isinstance(info, Mapping) and info.get("stage") is not None and int(info["stage"]) != want:
            raise FormatError(path, f"metadata.ranks.{r}.stage", f"{want} (rank {r}'s stage in {plan_src})",
                              info["stage"])
    for i, ev in enumerate(trace["traceEvents"]):
        args = ev.get("args") or {}
        if ev.get("ph") != "X" or "stage" not in args or "layers" not in args or ev.get("cat") == "block":
            continue
        r = int(ev["pid"])
        if r not in ranks:
            raise FormatError(path, f"traceEvents[{i}].pid", f"a rank of {plan_src} (0..{plan.world_size - 1})", r)
        st = plan.stage_of_rank(r)
        if int(args["stage"]) != st.index:
            raise FormatError(path, f"traceEvents[{i}].args.stage", f"{st.index} (rank {r}'s stage in {plan_src})",
                              args["stage"])
        if list(args["layers"]) != list(st.layers):
            raise FormatError(path, f"traceEvents[{i}].args.layers",
                              f"{list(st.layers)} (stage {st.index}'s layers in {plan_src})", args["layers"])
    seen: dict[int, set] = defaultdict(set)
    for e in events:
        if e.kind == "F":
            seen[e.rank].add(e.microbatch)
    want_mb = set(range(plan.num_microbatches))
    for r in sorted(ranks):
        if seen.get(r, set()) != want_mb:
            raise FormatError(path, f"traceEvents (F<mb> of rank {r})",
                              f"micro-batches 0..{plan.num_microbatches - 1} ({plan_src}: num_microbatches)",
                              sorted(seen.get(r, set())))


def read_run(trace_dir: Path, plan: Plan, profiles: Profiles, plan_src: str = "plan.json",
             steps: Sequence[int] | None = None) -> Measurements:
    """Measured compute (with the plan's predictions), transfers, optimizer time and peaks."""
    from ..trace.report import rank_memory

    found = find_merged(trace_dir)
    if steps:
        have = dict(found)
        missing = [s for s in steps if s not in have]
        if missing:
            raise FileNotFoundError(f"{trace_dir}: no timeline_step{missing[0]}_all.json "
                                    f"(traced steps: {', '.join(str(n) for n, _ in found)})")
        found = [(s, have[s]) for s in steps]
    cost = MeasuredCost(plan, profiles, Links(Bandwidth(bytes_per_sec={}), "-"))
    pred = {}
    for r, acts in build(plan).items():
        for a in acts:
            if a.kind in (Kind.FORWARD, Kind.BACKWARD):
                pred[(r, "F" if a.kind == Kind.FORWARD else "B", a.microbatch)] = cost.compute_s(r, a)
    out = Measurements()
    for n, path in found:
        tr = load_trace(path)
        evs = events_from_trace(tr)
        if not evs:
            raise FormatError(str(path), "traceEvents", "pipeline events (F<mb>/B<mb>/send/recv with args.stage)")
        _check_trace(str(path), tr, evs, plan, plan_src)
        out.files.append(str(path))
        out.steps[n] = analyze(evs).step_time_s
        for r, v in rank_memory(tr).items():
            out.peak_rss[r] = max(out.peak_rss.get(r, 0), v)
        rtt: dict[int, float] = {}
        for r, info in ((tr.get("metadata") or {}).get("ranks") or {}).items():
            if isinstance(info, Mapping) and info.get("host"):
                out.trace_hosts[int(r)] = str(info["host"])
            if isinstance(info, Mapping):
                rtt[int(r)] = float(info.get("clock_rtt_s") or 0.0)
        sends: dict[tuple, Event] = {}
        recvs: list[Event] = []
        for e in evs:
            if e.kind in ("F", "B"):
                out.compute.append(Compute(e.rank, n, e.kind, int(e.microbatch), e.dur, pred[(e.rank, e.kind,
                                                                                               int(e.microbatch))]))
            elif e.kind == "optimizer":
                out.optimizer[e.rank].append(e.dur)
            elif e.kind.startswith("send"):
                sends[(e.rank, e.peer, e.kind[5:], e.microbatch)] = e
            elif e.kind.startswith("recv"):
                recvs.append(e)
        for r, g in call_gaps(evs).items():
            out.gaps[r].extend(g)
        clipped = _row_clipped(list(sends.values()) + recvs)
        for rv in recvs:
            sd = sends.get((rv.peer, rv.rank, rv.kind[5:], rv.microbatch))
            if sd is None or not rv.bytes:
                continue
            # the message can move only once both ends have posted it; it is done when it arrived
            first = sd if sd.start >= rv.start else rv
            secs = rv.end - first.start
            unc = (rtt.get(sd.rank, 0.0) + rtt.get(rv.rank, 0.0)) / 2
            out.transfers.append(Transfer(int(sd.rank), int(rv.rank), int(rv.bytes), secs, unc, id(first) in clipped))
    return out


def call_gaps(events: Sequence[Event]) -> dict[int, list[float]]:
    """Per rank, the time between consecutive forward/backward calls not spent waiting for a
    receive: what the runtime itself costs per call (dispatching actions, posting messages,
    copying), which block timings do not contain. The end of the step (all-reduce, optimizer) is
    left out: waiting for a collective's peers is not always inside its event."""
    by: dict[int, list[Event]] = defaultdict(list)
    for e in events:
        by[e.rank].append(e)
    out: dict[int, list[float]] = {}
    for r, evs in by.items():
        comp = sorted((e for e in evs if e.kind in ("F", "B")), key=lambda e: e.start)
        waits = [(e.end, e.wait_s) for e in evs if e.kind.startswith("recv")]
        gaps = []
        for a, b in zip(comp, comp[1:]):
            waited = sum(w for end, w in waits if a.end - 1e-6 <= end <= b.start + 1e-6)
            gaps.append(max(0.0, (b.start - a.end) - waited))
        out[r] = gaps
    return out


def _row_clipped(p2p: list[Event], eps: float = 2e-6) -> set[int]:
    """ids of send/recv slices that start where the previous slice of their row ended.

    A rank's send (and recv) row is laid out one message after another: a slice starts when its
    message was posted or when the previous one finished, whichever is later. Where it starts at
    the previous end, the message may have been moving before (to another peer) already.
    """
    rows: dict[tuple[int, str], list[Event]] = defaultdict(list)
    for e in p2p:
        rows[(e.rank, e.kind[:4])].append(e)
    out = set()
    for evs in rows.values():
        evs.sort(key=lambda e: (e.start, e.end))  # a row's slices do not overlap; starts order them
        for prev, cur in zip(evs, evs[1:]):
            if abs(cur.start - prev.end) <= eps:
                out.add(id(cur))
    return out


# ----------------------------------------------------------------------------- fitting
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
    """Layer ranges [start, end) this host ran (decoder layers, as in plan.json)."""
    points: int
    factor: float
    forward: float
    backward: float
    groups: list[dict[str, Any]]
    """Per group of blocks [lo, hi) (0 = embed, N + 1 = tail): forward and backward factors."""
    rms_rel: float
    """Root mean square of the fit's residuals relative to the measured times."""
    measured_s: float
    predicted_s: float
    """Mean forward + backward per micro-batch (all of the host's ranks)."""


def fit_host(host: str, ranks: Sequence[int], plan: Plan, profiles: Profiles, meas: Measurements) -> HostFit:
    """Forward/backward factors per block group of one host (nnls), and overall ones.

    The groups are the pieces the host's block ranges cut the model into; when the ranges do not
    determine them (e.g. overlapping ranges seen only together) one factor covers all.
    """
    info = {}
    for r in ranks:
        st = plan.stage_of_rank(r)
        lo, hi = stage_blocks(st.layers, st.has_embed, st.has_tail)
        info[r] = (lo, hi, recompute_runs(st.layers[0], st.recompute), plan.device_of_rank(r).samples)
    bounds = sorted({x for lo, hi, _, _ in info.values() for x in (lo, hi)})
    groups = [(a, b) for a, b in zip(bounds, bounds[1:]) if any(lo <= a and b <= hi for lo, hi, _, _ in info.values())]
    rows_f, y_f, rows_b, y_b, rec_rows = [], [], [], [], []
    for c in meas.compute:
        if c.rank not in info:
            continue
        lo, hi, rec, n = info[c.rank]
        inside = [lo <= a and b <= hi for a, b in groups]
        if c.kind == "F":
            rows_f.append([block_time(profiles, host, a, b, n) if ok else 0.0 for (a, b), ok in zip(groups, inside)])
            y_f.append(c.seconds)
        else:
            rows_b.append([block_time(profiles, host, a, b, n, backward=True) if ok else 0.0
                           for (a, b), ok in zip(groups, inside)])
            rec_rows.append([sum(block_time(profiles, host, max(x, a), min(y, b), n) for x, y in rec
                                 if max(x, a) < min(y, b)) if ok else 0.0 for (a, b), ok in zip(groups, inside)])
            y_b.append(c.seconds)
    if not y_f or not y_b:
        raise ValueError(f"host {host}: the timelines hold no forward/backward events of its ranks {list(ranks)}")
    Af, yf, Ab, yb, Ar = (np.array(x, dtype=float) for x in (rows_f, y_f, rows_b, y_b, rec_rows))
    kf_all = _ls_factor(yf, Af.sum(axis=1))
    ok_groups = len(groups) > 1 and np.linalg.matrix_rank(np.unique(Af > 0, axis=0).astype(float)) == len(groups)
    kf = _nnls(Af, yf) if ok_groups else np.full(len(groups), kf_all)
    yb_net = yb - Ar @ kf                                   # recomputed forwards run inside backward
    kb_all = _ls_factor(yb_net, Ab.sum(axis=1))
    kb = _nnls(Ab, yb_net) if ok_groups else np.full(len(groups), kb_all)
    pf, pb_ = Af @ kf, Ab @ kb + Ar @ kf
    resid = np.concatenate([(yf - pf) / np.maximum(yf, 1e-12), (yb - pb_) / np.maximum(yb, 1e-12)])
    p_all = np.concatenate([Af.sum(axis=1), Ab.sum(axis=1) + Ar.sum(axis=1)])
    y_all = np.concatenate([yf, yb])
    return HostFit(host=host, ranks=sorted(ranks), ranges=sorted({tuple(plan.stage_of_rank(r).layers) for r in ranks}),
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
    """Messages left out because they overlapped another on their row (all of them: old rate kept)."""

    @property
    def change(self) -> float | None:
        return self.bytes_per_sec / self.old_bytes_per_sec if self.old_bytes_per_sec else None


def fit_links(plan: Plan, meas: Measurements, old: Bandwidth) -> list[LinkFit]:
    """Per directed host pair: throughput (and latency, when message sizes vary enough to tell)."""
    by: dict[tuple[str, str], list[Transfer]] = defaultdict(list)
    for t in meas.transfers:
        a, b = plan.device_of_rank(t.src).host, plan.device_of_rank(t.dst).host
        if a != b:
            by[(a, b)].append(t)
    out = []
    for (a, b), all_ts in sorted(by.items()):
        clean = [t for t in all_ts if not t.censored]
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
        out.append(LinkFit(a, b, len(all_ts), rate, lat, old_rate, old_lat, int((raw < floor).sum()),
                           len(all_ts) - len(clean) if clean else 0))
    return out


def fit_optimizer(plan: Plan, profiles: Profiles, meas: Measurements) -> dict[str, float]:
    """Seconds per parameter byte of the optimizer step, per host that ran one."""
    per: dict[str, list[float]] = defaultdict(list)
    for r, durs in meas.optimizer.items():
        w = profiles.stage_param_bytes(plan.stage_of_rank(r))
        if w > 0 and durs:
            per[plan.device_of_rank(r).host].append(statistics.median(durs) / w)
    return {h: float(statistics.mean(v)) for h, v in per.items()}


def memory_terms(plan: Plan, profiles: Profiles, rank: int, memory: MemoryEstimator
                 ) -> tuple[float, float, float, tuple[int, int, int]]:
    """(weights W, Kp's multiplier, bytes independent of the coefficients, (samples, in-flight, A)) of a rank.

    The planner's memory model is ``base + alpha·W + s·n·(Kp·A_kept + A_rec) + Kp·A_max·s``.
    """
    st = plan.stage_of_rank(rank)
    W = float(profiles.stage_param_bytes(st))
    a = StageMemory(profiles, memory).activations(st)  # the tail's logits weighted by Kt / Kp
    kept, rec, amax = float(a.kept), float(a.recomputed), float(a.largest_recomputed)
    s = plan.device_of_rank(rank).samples
    n = in_flight(plan.schedule, plan.num_stages, st.index, plan.num_microbatches)
    return W, s * (n * kept + amax), s * n * rec, (s, n, int(kept))


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
        st = plan.stage_of_rank(r)
        samples.append(MemorySample(start=st.layers[0], end=st.layers[1], has_embed=st.has_embed,
                                    has_tail=st.has_tail, weights_bytes=int(w), activation_bytes_per_sample=kept,
                                    batch=max(1, s * n), peak_bytes=int(peaks[r]),
                                    predicted_bytes=float(peaks[r] - pk + p)))
    mm = MemoryModel(base=float(base), alpha=float(alpha), Kp=float(kp),
                     r2=1.0 - float((res ** 2).sum()) / ss if ss > 0 else float("nan"),
                     residuals=[float(x) for x in res], samples=samples, model=plan.model.name,
                     microbatch=plan.micro_batch_size, host="measured ranks",
                     Kt=None if prior.kt is None or prior.kp <= 0 else float(kp) * prior.kt / prior.kp)
    return mm, how


# ----------------------------------------------------------------------------- files
def template_from_model(plan: Plan) -> LayersFile:
    """A layers file shaped by the model's per-block FLOPs at a nominal 1 GFLOP/s (no host measured);
    the fitted factors then turn it into each host's measured times."""
    from .estimate import DTYPE_BYTES, block_params
    from ..models.presets import hidden_size

    cfg, params = block_params(plan.model.source if plan.model.source not in ("", "preset") else plan.model.name,
                               plan.model.num_layers)
    by = DTYPE_BYTES.get(plan.model.dtype, 4)
    h, V, L, S = hidden_size(cfg), int(cfg.vocab_size), plan.model.num_layers, plan.seq_len
    flops = [2.0 * S * h] + [2.0 * params[1 + i] * S + 4.0 * S * S * h for i in range(L)] + [2.0 * h * V * S]
    nominal = 1e9

    def blk(name, idx, fl, p, act):
        return BlockProfile(name=name, index=idx, param_bytes=int(p * by), activation_bytes_per_sample=int(act),
                            forward_time_s=fl / nominal, backward_time_s=2 * fl / nominal)

    act = S * h * by
    layers = [blk(f"layer{i}", i, flops[1 + i], params[1 + i], act) for i in range(L)]
    embed, tail = blk("embed", None, flops[0], params[0], act), blk("tail", None, flops[-1], params[-1], S * V * by)
    return LayersFile(host="model-estimate", model=plan.model,
                      run=RunInfo(seq_len=S, batch=1, iters=1, warmup=0, threads=1, torch_version="estimate",
                                  timer="python", cpu="per-block FLOPs at a nominal 1 GFLOP/s"),
                      embed_param_bytes=embed.param_bytes, tail_param_bytes=tail.param_bytes, embed=embed, tail=tail,
                      layers=layers, step_time_s=3 * sum(flops) / nominal, peak_rss_bytes=0)


def corrected_layers_file(template: LayersFile, host: str, f: np.ndarray, b: np.ndarray, f0: np.ndarray,
                          b0: np.ndarray, call_s: float = 0.0) -> LayersFile:
    """``template``'s bytes and run with ``host``'s corrected times (per sample ``f``/``b``, per call
    ``f0``/``b0``); raw samples and per-batch means are dropped: these are corrected figures."""
    n = template.run.batch
    blocks = [template.embed, *template.layers, template.tail]
    new = [BlockProfile(name=bl.name, index=bl.index, param_bytes=bl.param_bytes,
                        activation_bytes_per_sample=bl.activation_bytes_per_sample,
                        forward_time_s=float(f0[j] + f[j] * n), backward_time_s=float(b0[j] + b[j] * n),
                        forward_fixed_s=float(f0[j]), backward_fixed_s=float(b0[j]))
           for j, bl in enumerate(blocks)]
    return LayersFile(host=host, model=template.model, run=template.run, embed_param_bytes=template.embed_param_bytes,
                      tail_param_bytes=template.tail_param_bytes, embed=new[0], tail=new[-1], layers=new[1:-1],
                      step_time_s=float(f0.sum() + b0.sum() + (f.sum() + b.sum()) * n),
                      peak_rss_bytes=template.peak_rss_bytes, call_overhead_s=float(call_s))


def capacity(profiles: Profiles, ref: str, host: str, batch: int) -> float:
    """Median over decoder layers of ref forward / host forward on ``batch`` samples (as
    ``torchpp capacities``)."""
    def t(h: str) -> np.ndarray:
        return (profiles.fixed(h)[0] + batch * profiles.table(h)[0])[1:-1]
    return float(np.median(t(ref) / np.maximum(t(host), 1e-30)))


# ----------------------------------------------------------------------------- the command
def configure(p: argparse.ArgumentParser) -> None:
    from .. import argtypes as T, validate as V

    p.add_argument("--plan", type=T.existing_path, required=True, help="plan.json the traced run used")
    p.add_argument("--traces", type=T.existing_path, required=True, help="folder with the run's timeline_step<N>_all.json")
    p.add_argument("--steps", type=T.int_list(1), default=None, help="traced steps to use, e.g. 2,3 (default: all)")
    p.add_argument("--layers", nargs="+", type=Path, default=None,
                   help="layers_<host>.json the plan was made from (default: the model's per-block FLOPs, scaled "
                        "to the measured times)")
    p.add_argument("--capacities", type=T.existing_path, default=None, help="capacities.json the plan was made from")
    p.add_argument("--bandwidth", type=Path, default=None,
                   help="bandwidth.json the plan was made from (links the run did not use keep these rates)")
    p.add_argument("--memory-model", type=T.existing_path, default=None, help="memory_model.json (default: analytic)")
    p.add_argument("--devices", type=T.existing_path, default=None,
                   help="devices.json (default: the plan's devices with the budgets in its prediction)")
    p.add_argument("--out-dir", type=T.out_dir, required=True)
    p.add_argument("--global-batch", type=T.int_in(1, V.MAX_GLOBAL_BATCH), default=None, help="default: the plan's")
    p.add_argument("--schedule", choices=["1f1b", "gpipe"], default=None, help="default: the plan's")
    p.add_argument("--max-stages", type=T.int_in(1, V.MAX_STAGES), default=None)
    p.add_argument("--micro-batch-sizes", type=T.int_list(1, V.MAX_GLOBAL_BATCH), default=None)
    p.add_argument("--no-recompute", action="store_true")
    p.add_argument("--exact-devices", type=T.int_in(1, 8), default=5)
    p.add_argument("--max-group", type=T.int_in(1, V.MAX_STAGES), default=8)
    p.add_argument("--compare", default=None, help="e.g. even,dp,pp: price these too (corrected costs)")
    p.add_argument("--no-memory-refit", action="store_true", help="keep the memory model even if peaks were traced")
    p.set_defaults(func=run)


def _budgets(args, plan: Plan, plan_src: str) -> tuple[list[str], dict[str, float], Devices | None]:
    if args.devices is not None:
        dv = Devices.load(args.devices)
        return dv.hosts, {h: dv.memory_bytes(h) for h in dv.hosts}, dv
    hosts, budget = [], {}
    stages = (plan.predicted or {}).get("stages") or []
    for s in plan.stages:
        for d in s.devices:
            got = next((x.get("budget_bytes") for ps in stages for x in ps.get("devices", [])
                        if x.get("rank") == d.rank), None)
            if got is None:
                raise FormatError(plan_src, f"predicted.stages[{s.index}].devices (rank {d.rank}).budget_bytes",
                                  "a memory budget per device; pass --devices devices.json")
            if d.host not in budget:
                hosts.append(d.host)
            budget[d.host] = float(got)
    return hosts, budget, None


def run(args: argparse.Namespace) -> int:
    from ..errors import UsageError
    from . import api

    plan_src = str(args.plan)
    plan = Plan.load(args.plan)
    from ..trace.report import check_traces_of_plan
    check_traces_of_plan([p for _, p in find_merged(args.traces)], args.plan)
    # ------------------------------------------------------------------ the old cost model
    files = [LayersFile.load(p) for p in args.layers or []]
    cap = Capacities.load(args.capacities) if args.capacities else None
    if files:
        prof = Profiles.from_layers(files, cap, [str(p) for p in args.layers],
                                    str(args.capacities or "capacities.json"))
        if prof.model.num_layers != plan.model.num_layers:
            raise FormatError(plan_src, "model.num_layers", f"{prof.model.num_layers} (the layers files' model)",
                              plan.model.num_layers)
        if prof.seq_len != plan.seq_len:
            raise FormatError(plan_src, "seq_len", f"{prof.seq_len} (the layers files' run.seq_len)", plan.seq_len)
        templates = {lf.host: lf for lf in files}
        default_template = files[0]
    else:
        default_template = template_from_model(plan)
        prof = Profiles.from_layers([default_template], None, ["model FLOPs"])
        templates = {}
    hosts, budget, devices = _budgets(args, plan, plan_src)
    planned = sorted({d.host for s in plan.stages for d in s.devices})
    if not files:
        f0, b0 = prof.table(default_template.host)
        for x in (prof.fwd, prof.bwd, prof.fwd0, prof.bwd0, prof.origin):
            del x[default_template.host]
        for h in sorted(set(hosts) | set(planned)):
            prof.set_table(h, f0, b0, 1, "model FLOPs at a nominal 1 GFLOP/s")
    prof.ensure(sorted(set(hosts) | set(planned)), str(args.devices or plan_src))
    old_origin = dict(prof.origin)
    old_bw = Bandwidth.load(args.bandwidth) if args.bandwidth else Bandwidth(bytes_per_sec={}, source="none")
    if args.memory_model:
        old_mem = MemoryEstimator.fitted(MemoryModel.load(args.memory_model), str(args.memory_model))
    else:
        old_mem = MemoryEstimator.analytic(ANALYTIC_KP)

    # ------------------------------------------------------------------ what the run measured
    meas = read_run(args.traces, plan, prof, plan_src, args.steps)
    print(f"read {len(meas.files)} timeline(s) from {args.traces}: steps {', '.join(map(str, meas.steps))}, "
          f"measured step time {meas.step_time_s:.4g} s (median)")
    ranks_of: dict[str, list[int]] = defaultdict(list)
    for s in plan.stages:
        for d in s.devices:
            ranks_of[d.host].append(d.rank)
    fits = {h: fit_host(h, rs, plan, prof, meas) for h, rs in sorted(ranks_of.items())}
    ref = cap.ref_host if cap is not None and cap.ref_host in prof.fwd else (files[0].host if files else planned[0])
    cap_batch = next((lf.run.batch for lf in files if lf.host == ref), default_template.run.batch)
    old_cap = {h: capacity(prof, ref, h, cap_batch) for h in prof.fwd}
    new = Profiles(model=prof.model, seq_len=prof.seq_len, param_bytes=prof.param_bytes, act_bytes=prof.act_bytes)
    for h in prof.fwd:
        new.fwd[h], new.bwd[h], new.fwd0[h], new.bwd0[h] = (corrected_table(prof, fits[h]) if h in fits else
                                                              (*prof.table(h), *prof.fixed(h)))
        gaps = [g for r in ranks_of.get(h, []) for g in meas.gaps.get(r, [])]
        new.call[h] = float(np.mean(gaps)) if gaps else prof.call.get(h, 0.0)
        new.origin[h] = (f"{old_origin[h]} × measured factors (forward {fits[h].forward:.3g}, backward "
                         f"{fits[h].backward:.3g})" if h in fits else old_origin[h])
    new_cap = {h: capacity(new, ref, h, cap_batch) for h in new.fwd}
    for h, fit in fits.items():
        print(f"  {h}: measured/predicted {fit.factor:.3f} (forward {fit.forward:.3f}, backward {fit.backward:.3f}) "
              f"over {fit.points} timings, capacity {old_cap[h]:.3g} -> {new_cap[h]:.3g}, runtime "
              f"{1e3 * new.call[h]:.2f} ms per call")

    links = fit_links(plan, meas, old_bw)
    bw = Bandwidth(bytes_per_sec=dict(old_bw.bytes_per_sec), latency_s=dict(old_bw.latency_s),
                   source=f"{old_bw.source or 'none'}; links measured by torchpp replan from {args.traces}")
    for lk in links:
        k = Bandwidth.key(lk.src, lk.dst)
        bw.bytes_per_sec[k] = lk.bytes_per_sec
        if lk.latency_s > 0:
            bw.latency_s[k] = lk.latency_s
        else:
            bw.latency_s.pop(k, None)
    all_hosts = sorted(set(hosts) | set(planned))
    missing = bw.missing_links(all_hosts)
    if missing:
        raise UsageError(f"--bandwidth: links {', '.join(missing[:6])}{' …' if len(missing) > 6 else ''} were not "
                         f"used by the traced run and have no rate; pass the bandwidth.json the plan was made from")

    opt_measured = fit_optimizer(plan, prof, meas)
    opt: dict[str, float] = dict(opt_measured)
    if opt_measured:  # hosts that ran no optimizer step: the measured median, scaled by relative speed
        ref_s = statistics.median(float(new.fwd[h].sum() + new.bwd[h].sum()) for h in opt_measured)
        med = statistics.median(opt_measured.values())
        for h in all_hosts:
            if h not in opt:
                opt[h] = med * float(new.fwd[h].sum() + new.bwd[h].sum()) / ref_s

    mem_model, mem_how = None, "kept (no peak RSS in the timelines)"
    memory = old_mem
    if meas.peak_rss and not args.no_memory_refit:
        mem_model, mem_how = refit_memory(plan, prof, meas.peak_rss, old_mem)
    elif args.no_memory_refit:
        mem_how = "kept (--no-memory-refit)"

    # ------------------------------------------------------------------ corrected files
    out = args.out_dir
    out.mkdir(parents=True, exist_ok=True)
    written: dict[str, Any] = {"layers": []}
    for h in all_hosts:
        lf = corrected_layers_file(templates.get(h, default_template), h, new.fwd[h], new.bwd[h], new.fwd0[h],
                                   new.bwd0[h], new.call.get(h, 0.0))
        written["layers"].append(lf.save(out / f"layers_{h}.json"))
    bw.save(out / "bandwidth.json")
    written["bandwidth"] = out / "bandwidth.json"
    new_files = [LayersFile.load(p) for p in written["layers"]]
    from .capacities import compute_capacities

    compute_capacities(new_files, ref if ref in all_hosts else all_hosts[0]).save(out / "capacities.json")
    if mem_model is not None:
        mem_model.save(out / "memory_model.json")
        written["memory_model"] = out / "memory_model.json"
        memory = MemoryEstimator.fitted(mem_model, str(out / "memory_model.json"))
    if devices is not None:
        devices.save(out / "devices.json")
        written["devices"] = out / "devices.json"
    # the new plan is priced from the files just written, as `torchpp plan` would read them
    prof2 = Profiles.from_layers(new_files, None, [str(p) for p in written["layers"]])
    links2 = Links(bw, str(out / "bandwidth.json"))

    # ------------------------------------------------------------------ the old plan, re-priced
    old_pred = (plan.predicted or {}).get("step_time_s")
    old_pred_src = "plan.json predicted.step_time_s"
    if old_pred is None and files and not old_bw.missing_links(planned):
        old_pred = price(plan, prof, Links(old_bw, str(args.bandwidth)))[0]
        old_pred_src = "priced with the input files"
    repriced, _ = price(plan, prof2, links2, opt or None)

    # ------------------------------------------------------------------ plan again
    options = api.PlanOptions(
        global_batch=args.global_batch or plan.global_batch, schedule=args.schedule or plan.schedule,
        max_stages=args.max_stages, micro_batch_sizes=args.micro_batch_sizes, recompute=not args.no_recompute,
        exact_devices=args.exact_devices, max_group=args.max_group,
        compare=api.compare_names(args.compare))
    summary = {
        "format": "torchpp.replan_summary/1",
        "plan": plan_src, "traces": str(args.traces), "timelines": meas.files,
        "measured_steps": {str(k): v for k, v in meas.steps.items()},
        "old_plan": {"measured_step_time_s": meas.step_time_s, "predicted_step_time_s": old_pred,
                     "predicted_source": old_pred_src if old_pred is not None else None,
                     "prediction_error": (old_pred - meas.step_time_s) / meas.step_time_s if old_pred else None,
                     "repriced_step_time_s": repriced,
                     "repriced_error": (repriced - meas.step_time_s) / meas.step_time_s},
        "hosts": {h: {"ranks": f.ranks, "layers": [list(r) for r in f.ranges], "timings": f.points,
                      "factor": f.factor, "forward_factor": f.forward, "backward_factor": f.backward,
                      "groups": f.groups, "fit_rms_rel": f.rms_rel,
                      "measured_s_per_microbatch": f.measured_s, "predicted_s_per_microbatch": f.predicted_s,
                      "old_capacity": old_cap[h], "new_capacity": new_cap[h], "old_table": old_origin[h],
                      "old_call_overhead_s": prof.call.get(h, 0.0), "call_overhead_s": new.call[h],
                      "trace_host": sorted({meas.trace_hosts[r] for r in f.ranks if r in meas.trace_hosts})}
                  for h, f in fits.items()},
        "unmeasured_hosts": {h: {"capacity": old_cap[h], "table": old_origin[h]} for h in all_hosts if h not in fits},
        "capacity_ref_host": ref,
        "links": [{"link": Bandwidth.key(lk.src, lk.dst), "messages": lk.messages,
                   "old_bytes_per_sec": lk.old_bytes_per_sec, "new_bytes_per_sec": lk.bytes_per_sec,
                   "old_latency_s": lk.old_latency_s, "new_latency_s": lk.latency_s, "ratio": lk.change,
                   "at_clock_resolution": lk.at_clock_resolution, "overlapped": lk.censored,
                   "kept_old": lk.censored == lk.messages,
                   "changed": lk.change is None or abs(lk.change - 1) > LINK_CHANGE} for lk in links],
        "optimizer_s_per_gb": {h: v * 1e9 for h, v in opt.items()},
        "optimizer_measured_hosts": sorted(opt_measured),
        "memory": {"how": mem_how, "old": old_mem.source,
                   "new": ({"base": mem_model.base, "alpha": mem_model.alpha, "Kp": mem_model.Kp, "r2": mem_model.r2}
                           if mem_model else None),
                   "ranks": {str(r): {"measured_peak_bytes": v,
                                      "old_predicted_bytes": _mem_pred(plan, prof, old_mem, r),
                                      "new_predicted_bytes": _mem_pred(plan, prof, memory, r)}
                             for r, v in sorted(meas.peak_rss.items())}},
        "written": [str(p) for p in written["layers"]] + [str(out / "bandwidth.json"), str(out / "capacities.json")]
        + ([str(written["memory_model"])] if "memory_model" in written else []),
    }
    print(f"old plan: measured {meas.step_time_s:.4g} s, predicted "
          + (f"{old_pred:.4g} s" if old_pred is not None else "(none)")
          + f", re-priced with corrected costs {repriced:.4g} s")
    costs = api.Costs(profiles=prof2, links=links2, hosts=hosts, budget=budget, memory=memory, devices=devices,
                      optimizer_s_per_byte=opt or None,
                      sources={"layers": written["layers"], "bandwidth": written["bandwidth"],
                               **{k: written[k] for k in ("memory_model", "devices") if k in written}})
    result = api.plan(costs, options, progress=print,
                      extra_meta={"replan": {"from_plan": plan_src, "traces": str(args.traces)}})
    api.write(result, out)
    print(api.written_text(out), end="")
    new_plan = result.plan
    new_step = float(new_plan.predicted["step_time_s"])
    summary["new_plan"] = {"predicted_step_time_s": new_step, "stages": [
        {"layers": list(s.layers), "hosts": [d.host for d in s.devices], "samples": [d.samples for d in s.devices],
         "recompute": sum(s.recompute)} for s in new_plan.stages],
        "num_microbatches": new_plan.num_microbatches, "micro_batch_size": new_plan.micro_batch_size}
    summary["old_plan"]["stages"] = [{"layers": list(s.layers), "hosts": [d.host for d in s.devices],
                                      "samples": [d.samples for d in s.devices]} for s in plan.stages]
    summary["predicted_gain"] = repriced / new_step - 1.0
    summary["layers_per_host"] = {h: {"old": _layers_of(plan, h), "new": _layers_of(new_plan, h)} for h in all_hosts}
    summary["work_share"] = {h: {"old": _work_share(plan, h), "new": _work_share(new_plan, h)} for h in all_hosts}
    write_json(out / "replan_summary.json", summary)
    text = summary_text(summary)
    (out / "replan_summary.txt").write_text(text)
    print(text, end="")
    print(f"wrote {out}/replan_summary.txt, replan_summary.json and the corrected inputs")
    return 0


def _mem_pred(plan: Plan, profiles: Profiles, memory: MemoryEstimator, rank: int) -> float:
    st = plan.stage_of_rank(rank)
    n = in_flight(plan.schedule, plan.num_stages, st.index, plan.num_microbatches)
    return float(StageMemory(profiles, memory).peak(st, plan.device_of_rank(rank).samples, n))


def _layers_of(plan: Plan, host: str) -> int:
    """Decoder layers on the host's stage(s) (0 when it is idle)."""
    return sum(s.num_layers for s in plan.stages if any(d.host == host for d in s.devices))


def _work_share(plan: Plan, host: str) -> float:
    """Fraction of the step's decoder-layer work (layers x samples) the host computes."""
    return sum(s.num_layers * d.samples for s in plan.stages for d in s.devices if d.host == host) / (
        plan.model.num_layers * plan.micro_batch_size)


def _fmt_rate(x: float | None) -> str:
    if x is None:
        return "–"
    return f"{x / 1e6:.3g} MB/s"


def summary_text(s: dict[str, Any]) -> str:
    o = s["old_plan"]
    pred = o["predicted_step_time_s"]
    lines = [f"replan of {s['plan']} from {len(s['timelines'])} timeline(s) in {s['traces']}", "",
             f"old plan: measured step {o['measured_step_time_s']:.4g} s (median of steps "
             f"{', '.join(s['measured_steps'])}); predicted "
             + (f"{pred:.4g} s ({100 * o['prediction_error']:+.1f}%)" if pred is not None else "– (no prediction)"),
             f"old plan re-priced with the corrected costs: {o['repriced_step_time_s']:.4g} s "
             f"({100 * o['repriced_error']:+.1f}% vs measured)",
             f"new plan predicted: {s['new_plan']['predicted_step_time_s']:.4g} s; predicted gain "
             f"{100 * s['predicted_gain']:+.1f}% throughput over the old plan (both with the corrected costs)", "",
             f"per host (measured / predicted compute; capacity relative to {s['capacity_ref_host']}):",
             f"  {'host':<14} {'layers':<12} {'timings':>7} {'factor':>7} {'fwd':>6} {'bwd':>6} {'fit rms':>8} "
             f"{'capacity old -> new':>20}  {'ms/call':>7}  layers old -> new  work share old -> new"]
    for h, v in s["hosts"].items():
        rng = ",".join(f"[{a},{b})" for a, b in v["layers"])
        lay, work = s["layers_per_host"].get(h, {}), s["work_share"].get(h, {})
        lines.append(f"  {h:<14} {rng:<12} {v['timings']:>7} {v['factor']:>7.3f} {v['forward_factor']:>6.3f} "
                     f"{v['backward_factor']:>6.3f} {100 * v['fit_rms_rel']:>7.1f}% "
                     f"{v['old_capacity']:>9.3g} -> {v['new_capacity']:<8.3g}  {1e3 * v['call_overhead_s']:>7.2f}  "
                     f"{lay.get('old', 0):>6} -> {lay.get('new', 0):<6}  "
                     f"{100 * work.get('old', 0):>7.1f}% -> {100 * work.get('new', 0):.1f}%")
        if len(v["groups"]) > 1:
            lines.append("      per block group: " + ", ".join(
                f"blocks [{g['blocks'][0]},{g['blocks'][1]}) fwd {g['forward']:.3f} bwd {g['backward']:.3f}"
                for g in v["groups"]))
    for h, v in s["unmeasured_hosts"].items():
        lay, work = s["layers_per_host"].get(h, {}), s["work_share"].get(h, {})
        lines.append(f"  {h:<14} {'(idle)':<12} {0:>7} {'–':>7} {'–':>6} {'–':>6} {'–':>8} "
                     f"{v['capacity']:>9.3g} (kept)    {'–':>7}  {lay.get('old', 0):>6} -> {lay.get('new', 0):<6}  "
                     f"{100 * work.get('old', 0):>7.1f}% -> {100 * work.get('new', 0):.1f}%")
    lines += ["  (ms/call: the runtime's own time between two compute calls beyond waiting, added to every "
              "forward and backward)"]
    lines += ["", "links (measured from matched send/recv pairs, waiting for the sender excluded):"]
    if not s["links"]:
        lines.append("  none between different hosts")
    for lk in s["links"]:
        ratio = f"x{lk['ratio']:.2f}" if lk["ratio"] is not None else "new"
        lines.append(f"  {lk['link']:<24} {lk['messages']:>4} msgs  {_fmt_rate(lk['old_bytes_per_sec']):>12} -> "
                     f"{_fmt_rate(lk['new_bytes_per_sec']):>12} ({ratio}){'  changed' if lk['changed'] else ''}"
                     + (f"  [{lk['at_clock_resolution']} at clock resolution]" if lk["at_clock_resolution"] else "")
                     + ("  [kept: every message overlapped another on its row]" if lk["kept_old"] else
                        f"  [{lk['overlapped']} overlapped, left out]" if lk["overlapped"] else ""))
    if s["optimizer_s_per_gb"]:
        lines += ["", "optimizer step (s per GB of parameters): " + ", ".join(
            f"{h} {v:.3g}{'' if h in s['optimizer_measured_hosts'] else ' (scaled)'}"
            for h, v in sorted(s["optimizer_s_per_gb"].items()))]
    m = s["memory"]
    lines += ["", f"memory: {m['how']}"]
    if m["new"]:
        lines.append(f"  base {m['new']['base'] / 2**20:.1f} MiB, alpha {m['new']['alpha']:.3g}, "
                     f"Kp {m['new']['Kp']:.3g}"
                     f" (was {m['old']})")
    for r, v in m["ranks"].items():
        lines.append(f"  rank {r}: measured {v['measured_peak_bytes'] / 2**20:.1f} MiB, predicted before "
                     f"{v['old_predicted_bytes'] / 2**20:.1f} MiB, now {v['new_predicted_bytes'] / 2**20:.1f} MiB")
    def layout(stages):
        return " | ".join(f"[{st['layers'][0]},{st['layers'][1]}) "
                          + "+".join(f"{h}({n})" for h, n in zip(st["hosts"], st["samples"])) for st in stages)

    lines += ["", f"old plan: {layout(o['stages'])}", f"new plan: {layout(s['new_plan']['stages'])}"
              f"   (layers [start,end), host(samples per micro-batch))"]
    return "\n".join(lines) + "\n"
