"""A certificate for a plan: a lower bound on the priced step of every plan in the planner's own
space (contiguous stage splits or chunk placements × device groups in pipeline order × micro-batch
size × recomputation × the schedule kinds searched, under each device's memory), so the chosen
plan is proven within ``step / bound − 1`` of the optimum of that space.

Every bound term is something the replay (``sim.replay``, the planner's one pricing) cannot avoid:

- a rank's compute actions run one after another: ``m`` forwards and backwards of its samples
  (per call + samples × per sample; a split backward counted as ``min(1, split)`` of the whole),
  the recomputation memory forces (at least the bytes it lacks times the cheapest seconds per
  byte any of its layers saves), its all-reduces and its optimizer step;
- the first forward of a stage waits for one micro-batch's forward through every stage before
  it and the transfers between, and after its last backward the gradient still crosses every
  stage before it (their input-gradient passes where the backward is split);
- a directed link between two single-device stages carries ``m`` activations one after another
  (and ``m`` gradients back), and a tied embedding kept on two groups is all-reduced between them.

These are minimised exactly over the one-chunk kinds' space by a dynamic programme over (first
layer of a suffix of stages, the devices it uses, its head device, stages after the head), with
groups of any devices not used yet. For the chunked kinds (interleaved, V) a device's chunks are
not contiguous: the programme runs over the number of decoder layers each group holds, pricing
them as its cheapest that many layers (a relaxation, so still a bound), with one micro-batch of
each chunk's activations held at once (every placement holds that much at some point).
States whose value already reaches the plan's step are dropped (they cannot lower the bound).

A second programme over the same space bounds each plan by the largest of its positions' own
bounds, none chained after the others' fill: a position's load, and what its kind's order forces
on it (``planner/orderbound.py``): the order's steps at every position, the position's own steps
priced from its cell and every other position's at the least one chunk of its class can take
anywhere, the hops at the fastest link; a longest path then holds the fill before the position's
steps, the idle between them (a V's round trip, the input gradients of a split backward coming
back) and the drain after. It is run once over the plans without a group of several devices
(every other position on ``b`` samples) and once over those with one (one sample: a group shares
``b``); a family's bound is the larger of the two programmes' (each is a bound on every plan).

With at most :data:`MAX_DEVICES` devices the programme's ``3^N`` (device set, group) pairs stay small.

Up to :data:`EXACT_DEVICES` devices each family is first enumerated exactly (:mod:`.exact`,
:mod:`.exactchunks`): every layout priced or proven no faster than the plan. Where that completes
the family's value is its optimum, not a bound; where it finds a faster plan, that plan is the one
certified (:attr:`Certificate.plan`).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from ..cost import Span, stage_time
from ..cost.actions import optimizer_rate
from ..formats import Plan
from ..schedules import REGISTRY, peak_states, schedule_kinds
from .allocate import waterfill
from .chunks import chunk_counts, placement
from .exact import one_chunk
from .exactchunks import chunked
from .orderbound import rank_paths
from .tables import Tables
from .types import INF, Problem, micro_batch_sizes

EXACT_DEVICES = 5
"""Up to this many devices every family is enumerated exactly where that fits :data:`EXACT_WORK`."""
EXACT_WORK = 500_000
"""Each family's enumeration budget (:func:`.exact.one_chunk`, :func:`.exactchunks.chunked`, the
chunked kinds' for each of their two passes): 10-20 s of CPU at most; the homelab's four hosts take
5,500 (one-chunk), 88,000 (V) and 280,000 (interleaved). The whole certificate of 19 random 3-5-host
clusters took 0.1-69 s of CPU (16 of them enumerated completely)."""
MAX_DEVICES = 8
"""Largest cluster certified: the programme visits every (devices used, next group) pair, 3^N of them."""


@dataclass
class Certificate:
    """A lower bound on the step of every plan in the space, and the plan's distance to it."""

    bound_s: float
    step_s: float
    method: str
    time_s: float
    families: dict[str, float] = field(default_factory=dict)
    """The bound of each family of kinds searched (one placement, full or split backward), seconds."""
    plan: Plan | None = None
    """A plan of the space faster than the one certified, found by the enumeration (``step_s`` is
    then its step, and the certificate is this plan's)."""
    searched_s: float | None = None
    """Where ``plan`` was found: the step of the plan the search had chosen."""

    @property
    def gap(self) -> float:
        """How far above the optimum the plan can be, as a fraction (0.03: within 3%)."""
        return max(0.0, self.step_s / self.bound_s - 1.0) if self.bound_s > 0 else INF

    def line(self) -> str:
        found = (f"a faster plan found while certifying, {self.step_s:.4g} s against the search's "
                 f"{self.searched_s:.4g} s, taken instead: " if self.plan is not None else "")
        return (f"{found}within {100 * self.gap:.1f}% of optimal in this space (step {self.step_s:.4g} s, proven "
                f"bound {self.bound_s:.4g} s; {self.method}, {self.time_s:.2f} s)")

    def as_dict(self) -> dict:
        out = {"bound_s": self.bound_s, "step_s": self.step_s, "gap": self.gap, "method": self.method,
               "time_s": self.time_s, "families": dict(self.families)}
        if self.plan is not None:
            out["searched_step_s"] = self.searched_s
        return out


def certify(pb: Problem, step_s: float) -> Certificate:
    """The certificate of a plan priced ``step_s`` on ``pb``'s costs, over ``pb``'s space."""
    if len(pb.hosts) > MAX_DEVICES:
        raise ValueError(f"certify: at most {MAX_DEVICES} devices, got {len(pb.hosts)}")
    t0 = time.perf_counter()
    enumerated: list[str] = []
    found: list[tuple[float, Plan]] = []
    bound, fams = space_bound(pb, cap=step_s, enumerated=enumerated, found=found)
    method = ("exact DP over splits, device groups and micro-batch sizes of a per-plan lower bound (compute, forced "
              "recomputation, fill/drain, links, all-reduces; each position's fill, idle and drain read off its "
              "kind's order)")
    if enumerated and len(enumerated) == len(fams):
        method = ("every family enumerated exactly: each layout (split or chunk placement, device groups, "
                  "micro-batch size) priced or proven no faster by its compute, memory and its order's longest path")
    elif enumerated:
        method += f"; {', '.join(enumerated)} enumerated exactly (every layout priced or bounded)"
    faster = min(found, key=lambda x: x[0], default=None)
    if faster is not None and faster[0] < step_s:
        return Certificate(bound_s=min(bound, faster[0]), step_s=faster[0], time_s=time.perf_counter() - t0,
                           families=fams, method=method, plan=faster[1], searched_s=step_s)
    return Certificate(bound_s=min(bound, step_s), step_s=step_s, time_s=time.perf_counter() - t0, families=fams,
                       method=method)


def space_bound(pb: Problem, cap: float = INF, enumerated: list[str] | None = None,
                found: list | None = None) -> tuple[float, dict[str, float]]:
    """The least lower bound over the space, each family's (values at or above the least found so far
    read as that: a family that cannot lower the bound is not solved further).

    The space's bound is the least over (family, micro-batch size) of the larger of two programmes'
    values. Every pair is solved with the least value found so far as its cap (its states at or
    above it are dropped), the second, dearer programme only where the first leaves it below that:
    the same least as solving every pair in full. The chunked families come first, whose bound is
    usually the lowest, so the one-chunk families' programmes run under a tight cap.

    Given a plan's step (``cap``), on clusters of at most :data:`EXACT_DEVICES` devices each family
    is first enumerated (:mod:`.exact`, :mod:`.exactchunks`: every layout priced or bounded, within
    :data:`EXACT_WORK`): where that completes, its value is the family's least priced step (``cap``
    where none is below it), and its name is added to ``enumerated``; a plan it priced below ``cap``
    is added to ``found`` (as (step, plan)), complete or not."""
    pb.profiles.ensure(pb.hosts)
    kinds = schedule_kinds(pb.schedule)
    t = Tables(pb)
    fams: dict[str, float] = {}
    best = cap
    for placement in ("v", "interleaved", "single"):
        for split in (True, False):
            ks = [k for k in kinds if REGISTRY[k].placement == placement and REGISTRY[k].split_backward == split]
            if not ks:
                continue
            mine = best
            if len(pb.hosts) <= EXACT_DEVICES and cap < INF:  # its own least, up to the plan's step
                got = (one_chunk if placement == "single" else chunked)(pb, t, ks, cap, max_work=EXACT_WORK)
                if got.plan is not None and found is not None:
                    found.append((got.step_s, got.plan))
                if got.complete:
                    fams["/".join(ks)] = got.step_s
                    best = min(best, got.step_s)
                    if enumerated is not None:
                        enumerated.append("/".join(ks))
                    continue
            for b in micro_batch_sizes(pb):
                fam = _Family(pb, t, ks, b, placement)
                got = fam.solve(best)
                if got < best:  # the order's idle per device, a bound of its own (see _Family.solve)
                    alone = fam.solve(best, standalone=True, grouped=False)
                    if b > 1 and alone > got:
                        alone = min(alone, fam.solve(alone, standalone=True, grouped=True))
                    got = max(got, alone)
                mine = min(mine, got)
                best = min(best, got)
            fams["/".join(ks)] = mine
    return min(fams.values(), default=cap), fams


def _subsets(mask: int):
    s = mask
    while s:
        yield s
        s = (s - 1) & mask


class _Family:
    """The bound's terms for one family of kinds at one micro-batch size, and the programme over them."""

    def __init__(self, pb: Problem, t: Tables, kinds: Sequence[str], b: int, placement: str):
        self.pb, self.t, self.kinds, self.b, self.name = pb, t, list(kinds), b, placement
        self.m = pb.global_batch // b
        self.N, self.L = len(pb.hosts), t.L
        self.chunked = placement != "single"
        self.split = any(REGISTRY[k].split_backward for k in kinds)
        self.full = any(not REGISTRY[k].split_backward for k in kinds)
        self.vmin = 2 if self.chunked else 1
        p = pb.profiles
        self.tied = float(p.tied_bytes) if p.model.tied_embeddings else 0.0
        self.opt = [optimizer_rate(pb.optimizer_s_per_byte, h) if pb.optimizer_s_per_byte is not None
                    else p.optimizer_rate(h)[0] for h in pb.hosts]
        self._load: dict = {}
        self._fd: dict = {}
        if self.chunked:
            self._chunk_terms()
        else:
            self._stage_terms()
        self._order_steps()

    # ------------------------------------------------------------------ one-chunk terms over cuts (c, c2)
    def _stage_terms(self) -> None:
        pb, t, b, L = self.pb, self.t, self.b, self.L
        p = pb.profiles
        span = t.span[0]
        valid = t.valid
        self.ps, self.pc, self.fd1, self.fdb = [], [], [], []
        self.f1, self.fb = [], []  # the first micro-batch's forward alone (one sample, b samples)
        for h, name in enumerate(pb.hosts):
            st = stage_time(p, name, span)
            sf = min(1.0, float(st.split)) if self.split else 1.0
            ps = st.fwd + sf * st.bwd
            pc = st.fwd0 + sf * st.bwd0 + 2 * st.call
            self.ps.append(np.where(valid, ps, INF))
            self.pc.append(np.where(valid, pc, INF))
            fd, fo = [], []
            for n in (1, b):
                fwd = st.fwd0 + st.call + n * st.fwd
                # where the backward is split a stage's W may run after the gradient left it: its
                # drain is not on every path, only its forward's fill
                back = 0.0 if self.split else st.bwd0 + st.call + n * st.bwd
                fd.append(np.where(valid, fwd + back, INF))
                fo.append(np.where(valid, fwd, INF))
            self.fd1.append(fd[0])
            self.fdb.append(fd[1])
            self.f1.append(fo[0])
            self.fb.append(fo[1])
        # seconds of forward per byte of activations a recomputed layer saves (per in-flight unit),
        # the cheapest layer of each cut
        acts = t.mem.memory.activations(p.act_bytes)
        self.ratio = []
        for h, name in enumerate(pb.hosts):
            f = p.table(name)[0]
            r = np.full(p.num_blocks, INF)
            for k in range(1, L + 1):  # decoder layer k-1 is block k
                if acts[k] > 0:
                    r[k] = f[k] / acts[k]
            mat = np.full((L + 1, L + 1), INF)
            for c in range(L):
                mat[c, c + 1:] = np.minimum.accumulate(r[c + 1:L + 1])
            self.ratio.append(mat)
        self.weights = np.where(valid, t.W, 0.0)
        if self.tied:
            self.weights[0, L] -= self.tied  # one stage holds both ends: the tied weight once
        self.out = t.out_bytes

    def _states(self, j: int) -> list[tuple]:
        """Each way the kinds can hold micro-batches at a stage with ``j`` stages after it: a
        list of states (held, past I, after a W); the bound takes the least demanding way."""
        out = []
        for k in self.kinds:
            for S in range(j + 1, self.N + 1):
                try:
                    out.append(peak_states(k, S, S - 1 - j, self.m))
                except ValueError:
                    continue
        return list(dict.fromkeys(out)) or [((1, 0, False),)]

    def _recompute(self, h: int, j: int) -> np.ndarray:
        """Per micro-batch seconds device h must add by recomputation holding b samples of each cut
        with j stages after it (inf where nothing fits)."""
        pb, t, b = self.pb, self.t, self.b
        mem = t.mem.memory
        budget = pb.budget[pb.hosts[h]]
        static = np.where(t.valid, t.static, INF)
        acts = mem.activations(pb.profiles.act_bytes)
        total_acts = np.concatenate([[0.0], np.cumsum(acts)])
        layer_acts = np.zeros((self.L + 1, self.L + 1))
        c, c2 = np.arange(self.L + 1)[:, None], np.arange(self.L + 1)[None, :]
        layer_acts = np.where(t.valid, total_acts[np.minimum(c2, self.L) + 1] - total_acts[np.minimum(c, self.L) + 1],
                              0.0)
        best = np.full((self.L + 1, self.L + 1), INF)
        for states in self._states(j):
            extra = np.zeros_like(best)
            for held, w, heap in states:
                ps = np.maximum(t.mem.per_sample(t.span[0], held, w, heap), 0.0)
                need = static + b * ps - budget
                coef = held * (mem.kp - 1.0) + w * mem.kw
                if coef > 0 and pb.allow_recompute:
                    add = np.where(need > 0, need * self.ratio[h] / coef, 0.0)
                    add = np.where(need > b * coef * layer_acts + 1e-6, INF, add)
                else:
                    add = np.where(need > 0, INF, 0.0)
                extra = np.maximum(extra, add)
            best = np.minimum(best, np.where(static > budget, INF, extra))
        return best

    def _group_load(self, g: tuple[int, ...], j: int) -> np.ndarray:
        key = (g, j if len(g) == 1 else -1)
        got = self._load.get(key)
        if got is not None:
            return got
        pb, t, b, m = self.pb, self.t, self.b, self.m
        names = [pb.hosts[h] for h in g]
        if len(g) == 1:
            h = g[0]
            load = m * (self.pc[h] + b * self.ps[h] + self._recompute(h, j)) + self.opt[h] * self.weights
        else:
            # samples shared as evenly as the devices' speeds and memory allow (every layer recomputed
            # for the memory, none for the time: both only lower the group's time)
            per = self._least_per_sample(j)
            static = np.where(t.valid, t.static, INF)
            caps = np.stack([np.maximum(pb.budget[pb.hosts[h]] - static, 0.0) / per for h in g])
            samples = waterfill(b, np.stack([self.ps[h] for h in g]), caps)
            per_call = np.minimum.reduce([self.pc[h] for h in g])
            unit = pb.links.ring_allreduce(names, 1.0)
            lat = pb.links.ring_allreduce(names, 0.0)
            ar = lat + (unit - lat) * self.weights
            load = m * (samples + per_call) + ar + min(self.opt[h] for h in g) * self.weights
        load = np.where(t.valid, load, INF)
        self._load[key] = load
        return load

    def _least_per_sample(self, j: int) -> np.ndarray:
        """Least bytes per sample a stage with ``j`` stages after it can hold (recomputing every
        layer where allowed), over the kinds' ways to hold micro-batches there."""
        key = ("per", j)
        got = self._load.get(key)
        if got is None:
            t = self.t
            span = t.span[1] if self.pb.allow_recompute else t.span[0]
            got = np.minimum.reduce([
                np.maximum.reduce([np.asarray(t.mem.per_sample(span, held, w, heap), dtype=float)
                                   for held, w, heap in states]) for states in self._states(j)])
            got = self._load[key] = np.where(t.valid, np.maximum(got, 1e-30), INF)
        return got

    def _group_fd(self, g: tuple[int, ...]) -> np.ndarray:
        got = self._fd.get(g)
        if got is None:
            got = self._fd[g] = self.fdb[g[0]] if len(g) == 1 else np.minimum.reduce([self.fd1[h] for h in g])
        return got

    # ------------------------------------------------------------------ chunked terms over layer counts
    def _chunk_terms(self) -> None:
        """Matrices over (layers before, layers through) a group: its cheapest that many layers."""
        pb, t, b, L = self.pb, self.t, self.b, self.L
        p = pb.profiles
        mem = t.mem.memory
        vee = self.name == "v"
        K = p.num_blocks
        acts = mem.activations(p.act_bytes)
        pbytes = np.asarray(p.param_bytes, dtype=float)
        lay = slice(1, L + 1)
        cum = lambda x: np.concatenate([[0.0], np.cumsum(np.sort(np.asarray(x, dtype=float)))])  # noqa: E731
        k0 = np.arange(L + 1)[:, None]
        k1 = np.arange(L + 1)[None, :]
        cnt = np.clip(k1 - k0, 0, L)
        ok = (k1 - k0) >= self.vmin
        head = (k0 == 0)
        has_tail = head if vee else (k1 == L)
        self.valid_k = ok
        w_cum = cum(pbytes[lay])
        weights = w_cum[cnt] + np.where(head, pbytes[0], 0.0) + np.where(has_tail, pbytes[K - 1], 0.0)
        if vee and self.tied:
            weights = weights - np.where(head, self.tied, 0.0)
        self.weights = weights
        static = mem.base + mem.alpha * weights + mem.ke * np.where(has_tail, pbytes[K - 1], 0.0)
        self.static, self.has_tail, self.cnt = static, has_tail, cnt
        self.a_sorted = np.sort(np.asarray(acts[lay], dtype=float))
        self.a_tail = float(acts[K - 1])
        self.ps, self.pc, self.fd1, self.fdb, self.ratio_h = [], [], [], [], []
        self.f1, self.fb = [], []
        self._held: dict[int, tuple[np.ndarray, float]] = {}
        for h, name in enumerate(pb.hosts):
            f, bw = p.table(name)
            f0, b0 = p.fixed(name)
            call = p.call.get(name, 0.0)
            split = p.backward_split_factor(name)
            sf = min(1.0, split) if self.split else 1.0
            ls, lc = f + sf * bw, f0 + sf * b0
            ends_s = np.where(head, ls[0], 0.0) + np.where(has_tail, ls[K - 1], 0.0)
            ends_c = np.where(head, lc[0], 0.0) + np.where(has_tail, lc[K - 1], 0.0)
            self.ps.append(np.where(ok, cum(ls[lay])[cnt] + ends_s, INF))
            self.pc.append(np.where(ok, cum(lc[lay])[cnt] + ends_c + 2 * self.vmin * call, INF))
            # one chain element: the cheapest one-layer chunk's forward (and backward, unless split)
            one, fo = [], []
            for n in (1, b):
                for back, into in ((0.0 if self.split else 1.0, one), (0.0, fo)):
                    chain = np.min(f0[lay] + n * f[lay] + back * (b0[lay] + n * bw[lay])) + (1 + back) * call
                    embed = f0[0] + n * f[0] + back * (b0[0] + n * bw[0])  # the head's first chunk holds the embedding
                    into.append(np.where(ok, chain + np.where(head, embed, 0.0), INF))
            self.fd1.append(one[0])
            self.fdb.append(one[1])
            self.f1.append(fo[0])
            self.fb.append(fo[1])
            self.ratio_h.append(float(np.min([f[k] / acts[k] if acts[k] > 0 else INF for k in range(1, L + 1)]))
                                if L else INF)
        self.out = float(np.min(p.act_bytes[1:K - 1])) if K > 2 else 0.0

    def _held_acts(self, j: int) -> tuple[np.ndarray, float]:
        """(activation bytes per sample a device holds at its peak with ``j`` groups after it, over
        (layers before, layers through) as :meth:`_chunk_terms`' matrices; the most micro-batches
        one chunk holds): read off each kind's order at every pipeline depth it could have, the least
        of them. Per order, the largest over its steps of the least its chunks can hold (the
        layers it holds, cheapest first, given to the chunk holding the most where there are two)."""
        got = self._held.get(j)
        if got is not None:
            return got
        from ..schedules import held_profiles
        from .chunks import chunk_counts, placement

        L = self.L
        cum = np.concatenate([[0.0], np.cumsum(self.a_sorted)])
        k = np.arange(L + 1)
        best = [np.full(L + 1, INF), np.full(L + 1, INF)]  # without, with the tail
        n_top = 1.0
        for kind in self.kinds:
            for p in range(max(2, j + 1), self.N + 1):
                q = p - 1 - j
                for v in chunk_counts(kind, p, L):
                    try:
                        pl = placement(kind, p, v)
                        profs = held_profiles(kind, pl, q, self.m)
                    except (ValueError, RuntimeError):
                        continue
                    mine = pl.chunks[q]
                    worst = [np.zeros(L + 1), np.zeros(L + 1)]
                    for prof in profs:
                        held = {c: n for c, n, *_ in prof}
                        ns = [held.get(c, 0) for c in mine]
                        n_top = max(n_top, max(ns))
                        lo = min(ns)
                        if len(mine) == 2:  # the chunk holding more gets the cheapest k1 layers, k1 >= 1
                            big, small = max(ns), min(ns)
                            k1 = np.arange(L + 1)[None, :]
                            val = big * cum[np.clip(k1, 0, L)] + small * (cum[k[:, None]] - cum[np.clip(k1, 0, L)])
                            val = np.where((k1 >= 1) & (k1 <= k[:, None] - 1), val, INF).min(axis=1)
                            val = np.where(k >= 2, val, INF)
                        else:
                            val = lo * cum[k]
                        for t, tail in enumerate((0.0, lo * self.a_tail)):
                            worst[t] = np.maximum(worst[t], val + tail)
                    for t in (0, 1):
                        best[t] = np.minimum(best[t], worst[t])
        out = np.where(self.has_tail, best[1][self.cnt], best[0][self.cnt])
        self._held[j] = (out, n_top)
        return out, n_top

    def _chunk_extra(self, h: int, j: int) -> np.ndarray:
        """Per micro-batch seconds device h adds by recomputation (inf where nothing fits)."""
        pb, b = self.pb, self.b
        mem = self.t.mem.memory
        budget = pb.budget[pb.hosts[h]]
        held, n_top = self._held_acts(j)
        kp = mem.kp + min(0.0, mem.kw)
        need = self.static + b * kp * held - budget
        if pb.allow_recompute and mem.kp > 0:
            # a recomputed layer saves at most kp x its bytes for each micro-batch its chunk holds
            extra = np.where(need > 0, need * self.ratio_h[h] / (n_top * mem.kp), 0.0)
            extra = np.where(need > b * mem.kp * held + 1e-6, INF, extra)
        else:
            extra = np.where(need > 0, INF, 0.0)
        return np.where(self.static > budget, INF, extra)

    def _chunk_load(self, g: tuple[int, ...], j: int) -> np.ndarray:
        key = (g, j if len(g) == 1 else -1)
        got = self._load.get(key)
        if got is not None:
            return got
        pb, b, m = self.pb, self.b, self.m
        if len(g) == 1:
            h = g[0]
            load = m * (self.pc[h] + b * self.ps[h] + self._chunk_extra(h, j)) + self.opt[h] * self.weights
        else:
            names = [pb.hosts[h] for h in g]
            held, _ = self._held_acts(j)
            mem = self.t.mem.memory
            factor = min(1.0, mem.kp + min(0.0, mem.kw)) if pb.allow_recompute else mem.kp + min(0.0, mem.kw)
            per = np.maximum(factor * held, 1e-30)
            caps = np.stack([np.maximum(pb.budget[pb.hosts[h]] - self.static, 0.0) / per for h in g])
            samples = waterfill(b, np.stack([self.ps[h] for h in g]), caps)
            per_call = np.minimum.reduce([self.pc[h] for h in g])
            unit = pb.links.ring_allreduce(names, 1.0)
            lat = pb.links.ring_allreduce(names, 0.0)
            load = m * (samples + per_call) + lat + (unit - lat) * self.weights + min(self.opt[h] for h in g) * self.weights
            for h in g:
                load = np.where(self.static > pb.budget[pb.hosts[h]], INF, load)
        load = np.where(self.valid_k, load, INF)
        self._load[key] = load
        return load

    # ------------------------------------------------------------------ the order's fill and drain
    def _order_steps(self) -> None:
        """What :mod:`.orderbound` prices a rank's paths with: per host and step type (F, B, and
        I + W together: each at least ``min(1, split)`` of B plus two calls), its steps' seconds at
        ``b`` samples over the programme's cells, and the least step any device takes for a chunk
        of each class (middle, embedding, tail) at one sample and at ``b``, and the fastest hop."""
        pb, b, L = self.pb, self.b, self.L
        p = pb.profiles
        K = p.num_blocks
        self.calls = [p.call.get(name, 0.0) for name in pb.hosts]
        self._paths: dict = {}
        self._order: dict = {}
        self._priced_of: dict = {}
        self.one_sample = True
        """Price the order's other positions at one sample where the depth leaves room for a group."""
        # "all": a step on b samples; "call" and "sample": its part per call and per sample (a
        # device of a group runs its share of the b samples)
        self.steps: dict[str, list[dict]] = {mode: [] for mode in ("all", "call", "sample")}
        for h, name in enumerate(pb.hosts):
            sf = min(1.0, p.backward_split_factor(name)) if self.split else 1.0
            for mode, (w0, w1, wc) in {"all": (1.0, b, 1.0), "call": (1.0, 0.0, 1.0), "sample": (0.0, 1.0, 0.0)}.items():
                c = wc * self.calls[h]
                if self.chunked:
                    f, bw = p.table(name)
                    f0, b0 = p.fixed(name)
                    x = {"F": w0 * f0 + w1 * f, "B": w0 * b0 + w1 * bw, "IW": sf * (w0 * b0 + w1 * bw)}
                    lay = slice(1, L + 1)
                    self.steps[mode].append({t: (np.concatenate([[0.0], np.cumsum(np.sort(v[lay]))]), np.sort(v[lay]),
                                                 float(v[0]), float(v[K - 1])) for t, v in x.items()})
                else:
                    st = stage_time(p, name, self.t.span[0])
                    self.steps[mode].append({
                        "F": np.where(self.t.valid, w0 * st.fwd0 + c + w1 * st.fwd, INF),
                        "B": np.where(self.t.valid, w0 * st.bwd0 + c + w1 * st.bwd, INF),
                        "IW": np.where(self.t.valid, 2 * c + sf * (w0 * st.bwd0 + w1 * st.bwd), INF)})
        # per host: each block's forward per sample; per host and sample count, the least step of
        # each (chunk class, type) it could take, and (n = 0) the least forward per call of a
        # one-layer chunk of each class (the fill before the last chunk, orderbound.RankPath.fill_call)
        self.fwd_ps = [np.asarray(p.table(name)[0], dtype=float) for name in pb.hosts]
        self.least_h: dict[int, list[dict]] = {n: [{} for _ in pb.hosts] for n in sorted({0, 1, b})}
        for h, name in enumerate(pb.hosts):
            for c in range(L):
                cls = (c == 0, c == L - 1)
                st = stage_time(p, name, Span.of_cut(c, c + 1, L))
                steps = {n: (("F", st.forward(n)), ("B", st.backward(n)), ("I", st.backward_input(n)),
                             ("W", st.backward_weight(n))) for n in self.least_h if n}
                steps[0] = (("F", float(st.forward_per_call)),)
                for n, these in steps.items():
                    least = self.least_h[n][h]
                    for t, s in these:
                        least[(cls, t)] = min(least.get((cls, t), INF), s)
        self._least_memo: dict = {}
        out = self.t.out_bytes[1:L] if L > 1 else np.zeros(1)
        out_min = float(np.min(out)) if not self.chunked else float(self.out)
        self.hop_mat = {n: [[self._xfer(a, c, n * out_min) if a != c else INF for c in range(self.N)]
                            for a in range(self.N)] for n in sorted({1, b})}

    def _outside(self, mine: frozenset) -> list[int]:
        """The devices other positions of a plan can hold: those outside ``mine`` (all where none is left)."""
        return [h for h in range(self.N) if h not in mine] or list(range(self.N))

    def _least(self, n: int, mine: frozenset) -> dict:
        """The least step of each (chunk class, type) on ``n`` samples any device outside ``mine``
        takes (n = 0: the least forward per call, keyed (class, "F"))."""
        key = (n, mine)
        got = self._least_memo.get(key)
        if got is None:
            got = {}
            for h in self._outside(mine):
                for k, v in self.least_h[n][h].items():
                    got[k] = min(got.get(k, INF), v)
            self._least_memo[key] = got
        return got

    def _others_forward(self, mine: frozenset, holds_embed: bool) -> np.ndarray:
        """Over the programme's cells, the least per-sample forward of every layer a position
        holding the cell's layers (and the last chunk) leaves to the others, on the fastest device
        outside ``mine`` for each: one-chunk cells (c, L) leave the embedding and layers [0, c);
        chunked cells leave L - (their count) decoder layers, the cheapest, and the embedding unless
        the position holds chunk 0."""
        key = ("others", mine, holds_embed)
        got = self._least_memo.get(key)
        if got is None:
            ps = np.minimum.reduce([self.fwd_ps[h] for h in self._outside(mine)])
            L = self.L
            capped = self._capped_forward(mine)  # by how many layers each device's memory holds
            if self.chunked:
                cum = np.concatenate([[0.0], np.cumsum(np.sort(ps[1:L + 1]))])
                k = np.clip(L - self.cnt, 0, L)
                got = np.maximum(cum[k], capped[k]) + (0.0 if holds_embed else float(ps[0]))
            else:
                pre = np.cumsum(ps[:L + 1])  # pre[c]: the embedding and decoder layers [0, c)
                pre = np.maximum(pre, capped + float(ps[0]))
                pre[0] = 0.0  # a stage from layer 0 holds the embedding itself
                got = np.broadcast_to(pre[:, None], (L + 1, L + 1)).copy()
            self._least_memo[key] = got
        return got

    def _capped_forward(self, mine: frozenset) -> np.ndarray:
        """Per count k of decoder layers, the least per-sample forward of k layers on devices outside
        ``mine`` where each device holds no more layers than its memory has room for their weights
        (the model's base plus alpha times the lightest layers' bytes), each layer at its device's
        cheapest: inf where they do not fit."""
        mem, L = self.t.mem.memory, self.L
        light = np.concatenate([[0.0], np.cumsum(np.sort(np.asarray(self.pb.profiles.param_bytes[1:L + 1],
                                                                     dtype=float)))])
        devs = []
        for h in self._outside(mine):
            room = int(np.searchsorted(mem.base + mem.alpha * light, self.pb.budget[self.pb.hosts[h]],
                                       side="right")) - 1
            devs.append((float(np.min(self.fwd_ps[h][1:L + 1])) if L else 0.0, max(room, 0)))
        out = np.full(L + 1, INF)
        out[0], total, held = 0.0, 0.0, 0
        for per, room in sorted(devs):
            for _ in range(room):
                if held == L:
                    break
                held += 1
                total += per
                out[held] = total
        return out

    def _hop(self, n: int, mine: frozenset, into: bool | None) -> float:
        """The fastest transfer of ``n`` samples' activations: out of the devices ``mine`` (``into``
        False), into them (True), or between two others (None)."""
        key = ("hop", n, mine, into)
        got = self._least_memo.get(key)
        if got is None:
            others = [h for h in range(self.N) if h not in mine]
            ins = list(mine) if mine else list(range(self.N))
            if into is None:
                pairs = [(a, c) for a in others for c in others] if len(others) > 1 else []
            elif into:
                pairs = [(a, c) for a in others for c in ins]
            else:
                pairs = [(a, c) for a in ins for c in others]
            if not pairs:  # nothing known of who sits there: any pair
                pairs = [(a, c) for a in range(self.N) for c in range(self.N)]
            got = self._least_memo[key] = min((self.hop_mat[n][a][c] for a, c in pairs if a != c), default=0.0)
        return got

    def _kind_paths(self, kind: str, p: int, q: int, v: int, mine: frozenset = frozenset()) -> list[list] | None:
        """Paths :func:`.orderbound.rank_paths` keeps for position q of ``kind`` at depth p, one list
        per way the other positions could be shared: a plan is bounded by the largest path of at
        least one list. Where a group may sit at the depth, its devices run one sample at least:
        with one device to spare one position may be a group (each choice a list), with more any.
        ``mine``: the devices at position q, which no other position holds (their steps and hops
        are priced over the other devices)."""
        key = (kind, p, q, v, self.one_sample, mine)
        if key in self._paths:
            return self._paths[key]
        pl = placement(kind, p, v)
        last = len(pl.position) - 1
        L, b = self.L, self.b
        spare = self.N - p if self.one_sample else 0
        if spare == 0 or b == 1:
            cheap = [set()]
        elif spare == 1:
            cheap = [{k} for k in range(p)]  # k == q: every other position alone on b samples
        else:
            cheap = [set(range(p))]

        def least_of(n: int, t: str, c: int) -> float:
            least = self._least(n, mine)
            got = least.get(((c == 0, c == last), t))
            if got is None:  # no one-layer chunk of that class (few layers): the least of any
                got = min(vv for (kk, tt), vv in least.items() if tt == t)
            return got

        def hop(x: int, y: int, n: int) -> float:
            return self._hop(n, mine, None if q not in (x, y) else y == q)

        def typical(t: str, c: int) -> float:
            return least_of(b, t, c) * max(1.0, L / (p * v))

        def call_of(t: str, c: int) -> float:
            return least_of(0, t, c)

        got: list[list] | None = []
        for few in cheap:
            try:
                paths = rank_paths(kind, pl, q, self.m,
                                   lambda pos, t, c: least_of(1 if pos in few else b, t, c),
                                   lambda x, y: hop(x, y, 1 if (x in few or y in few) else b), typical,
                                   lambda pos, t, c: call_of(t, c))
            except (ValueError, RuntimeError):
                got = None
                break
            # the samples every other position's forward runs at least: one where a group may sit
            got.append((paths, 1 if few - {q} else b))
        self._paths[key] = got
        return got

    def _priced(self, h: int, counts: dict[str, tuple[int, ...]], mine: Sequence[int], last_chunk: int,
                mode: str = "all") -> np.ndarray:
        """Least seconds device h spends on ``counts`` of its steps (per type, per chunk ``mine[k]``)
        over the programme's cells: a one-chunk stage's own steps; chunks priced at the cheapest
        layers the device could hold, the chunk running most given its cheapest layer each.
        ``mode``: steps on b samples ("all"), or their part per call or per sample (kept: every
        group holding the device and every depth asks again)."""
        key = (h, mode, tuple(counts[t] for t in ("F", "B", "I", "W")), tuple(mine), last_chunk)
        got = self._priced_of.get(key)
        if got is None:
            got = self._priced_of[key] = self._price_steps(h, counts, mine, last_chunk, mode)
        return got

    def _price_steps(self, h: int, counts: dict[str, tuple[int, ...]], mine: Sequence[int], last_chunk: int,
                     mode: str) -> np.ndarray:
        steps, call = self.steps[mode][h], (0.0 if mode == "sample" else self.calls[h])
        iw = tuple(min(a, w) for a, w in zip(counts["I"], counts["W"]))
        calls = sum(counts["I"]) + sum(counts["W"]) - 2 * sum(iw)
        val = np.full((self.L + 1, self.L + 1), calls * call)
        for t, ns in (("F", counts["F"]), ("B", counts["B"]), ("IW", iw)):
            if not any(ns):
                continue
            if not self.chunked:
                val = val + ns[0] * steps[t]
                continue
            cum, xs, embed, tail = steps[t]
            srt = sorted(ns, reverse=True)
            small = srt[-1]
            v_here = len(ns)
            extra = sum((srt[i] - small) * xs[i] for i in range(min(v_here - 1, len(xs))))
            cnt = np.minimum(self.cnt, self.L)
            part = np.where(self.cnt >= v_here, small * cum[cnt] + extra, INF)
            part = part + (2 if t == "IW" else 1) * call * sum(ns)
            for k, c in enumerate(mine):
                if c == 0:
                    part = part + ns[k] * embed
                if c == last_chunk:
                    part = part + ns[k] * tail
            val = val + part
        return val

    def _path_value(self, g: tuple[int, ...], kind: str, p: int, q: int, v: int) -> np.ndarray | None:
        """Seconds no plan of ``kind`` at depth p with the devices g at position q beats, over the
        programme's cells (the largest of the kept paths through its steps; None: no such plan).
        A group's devices each run the position's order on their share of the b samples: a path
        through one of them is at least the least per-call part of its steps plus the shares'
        least largest per-sample part (every device runs at least one sample)."""
        alone = frozenset(g) if len(g) == 1 else frozenset()  # devices no other position holds
        paths = self._kind_paths(kind, p, q, v, alone)
        if paths is None:
            return None
        pl = placement(kind, p, v)
        mine = pl.chunks[q]
        last_chunk = len(pl.position) - 1
        opt = min(self.opt[h] for h in g) * self.weights
        priced: dict = {}
        out = None
        holds_embed = 0 in mine
        for alt, n_fill in paths:
            best = None
            for path in alt:
                key = repr(path.counts)
                if key not in priced:
                    if len(g) == 1:
                        priced[key] = self._priced(g[0], path.counts, mine, last_chunk)
                    else:
                        per_call = np.minimum.reduce([self._priced(h, path.counts, mine, last_chunk, "call")
                                                      for h in g])
                        # the shares' least largest time, b / Σ 1/per (water-filling without caps)
                        with np.errstate(divide="ignore"):
                            inv = sum(1.0 / self._priced(h, path.counts, mine, last_chunk, "sample") for h in g)
                        priced[key] = per_call + np.where(inv > 0, self.b / np.where(inv > 0, inv, 1.0), INF)
                before = path.before
                if path.fill_call is not None:  # every other layer's forward runs before its first
                    before = np.maximum(before, path.fill_call + n_fill * self._others_forward(alone, holds_embed))
                val = before + priced[key]
                val = val + (np.maximum(path.after, opt) if path.last else path.after)
                best = val if best is None else np.maximum(best, val)
            if best is None:  # no step to bound it: nothing known of that way
                best = np.zeros((self.L + 1, self.L + 1))
            out = best if out is None else np.minimum(out, best)
        return out

    def _order_term(self, g: tuple[int, ...], j: int) -> np.ndarray:
        """The least over the family's kinds, depths and chunk counts of :meth:`_path_value` for
        the devices g with j groups after them: the first row (the head) at depth j + 1, the other
        rows deeper (0 where no plan is known to exist)."""
        key = (g, j, self.one_sample)
        got = self._order.get(key)
        if got is not None:
            return got
        rows = [np.full((self.L + 1, self.L + 1), INF), np.full((self.L + 1, self.L + 1), INF)]
        for kind in self.kinds:
            for p in range(max(j + 1, self.vmin if self.chunked else 1), self.N + 1):
                q = p - 1 - j
                vs = chunk_counts(kind, p, self.L) if self.chunked else [1]
                for v in vs:
                    if len(g) > 1 and p == self.N:
                        continue  # N positions of N devices: one device each
                    val = self._path_value(g, kind, p, q, v)
                    if val is not None:
                        r = 0 if q == 0 else 1
                        rows[r] = np.minimum(rows[r], val)
        out = np.where(np.arange(self.L + 1)[:, None] == 0, rows[0], rows[1])
        out = np.where(np.isfinite(out), out, 0.0)
        self._order[key] = out
        return out

    # ------------------------------------------------------------------ links
    def _xfer(self, a: int, c: int, nbytes) -> np.ndarray | float:
        pb = self.pb
        return pb.links.time(pb.hosts[a], pb.hosts[c], nbytes)

    def _link_terms(self, g: tuple[int, ...], h: int | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(the two transfers a micro-batch makes between group g and the next, g's head device h
        (None: a group), the links' throughput bound, the forward transfer alone) over the boundary
        position."""
        b, m = self.b, self.m
        if self.chunked:
            nbytes = np.full(self.L + 1, self.out)
        else:
            nbytes = np.asarray(self.out, dtype=float)
        if len(g) == 1 and h is not None:
            d = g[0]
            fw, bw = self._xfer(d, h, b * nbytes), self._xfer(h, d, b * nbytes)
            lat = fw if self.split else fw + bw  # a split stage's last W may follow its gradient's return
            if self.chunked:  # each direction carries 2m transfers (V: m activations and m gradients)
                return lat, 2 * m * np.maximum(fw, bw), fw + np.zeros(self.L + 1)
            return lat, np.maximum(m * fw + bw, m * bw + fw), fw + np.zeros(self.L + 1)
        one = min((self._xfer(a, x, 0.0) + (0.0 if self.split else self._xfer(x, a, 0.0))
                   for a in g for x in range(self.N) if x != a), default=0.0)
        per = (1 if self.split else 2) * self._per_byte_min(g)
        one_fw = min((self._xfer(a, x, 0.0) for a in g for x in range(self.N) if x != a), default=0.0)
        return (np.full(self.L + 1, one) + per * nbytes, np.zeros(self.L + 1),
                np.full(self.L + 1, one_fw) + self._per_byte_min(g) * nbytes)

    def _per_byte_min(self, g: tuple[int, ...]) -> float:
        best = INF
        for a in g:
            for x in range(self.N):
                if x != a:
                    best = min(best, self._xfer(a, x, 1.0) - self._xfer(a, x, 0.0),
                               self._xfer(x, a, 1.0) - self._xfer(x, a, 0.0))
        return 0.0 if best == INF else best

    def _tied(self, g: tuple[int, ...], U: int) -> np.ndarray:
        """The tied-weight all-reduce between head group g and the last stage's device e, per tail
        column e (the last column: a group, the least over the later stages' devices U)."""
        out = np.zeros(self.cols)
        if self.cols == 1:
            return out
        names = [self.pb.hosts[h] for h in g]
        ring = [self.pb.links.ring_allreduce(sorted(names + [self.pb.hosts[e]]), self.tied) if U >> e & 1 else INF
                for e in range(self.N)]
        out[:self.N] = ring
        out[self.N] = min(ring)
        return out

    # ------------------------------------------------------------------ the programme
    def solve(self, cap: float, standalone: bool = False, grouped: bool | None = None) -> float:
        """Least bound over the family's plans at this micro-batch size (``cap`` if none is lower).

        ``standalone``: the least over the plans of the largest of each device's own bound, its
        load or what its kind's order forces on it (:meth:`_order_term`), with the links'
        throughput. An order's bound already holds the fill before the device, so it cannot be
        chained after the fill of the stages before it: the family's bound is the larger of the two
        programmes' (the least of a maximum is at least the maximum of the two least).
        ``grouped``: only the plans with a group of several devices (True: the order's other
        positions priced at one sample), or with none (False: at b samples).

        V[j][U][(head, grouped)] is an array over (first position of a suffix of j + 1 stages using
        devices U whose first group is ``head``: a device, or -1 for a group; whether the suffix has
        a group) x (the last stage's device, or a group in the last column, where a tied weight is
        all-reduced between the ends).

        With a tied weight, T (same keys, same arrays) keeps the least over the same suffixes of the
        first micro-batch's forward from the suffix's first stage to the last stage's input plus
        the last stage's own load: the last stage all-reduces the tied weight after its work and
        before its optimizer step, so a plan lasts at least that plus the all-reduce with its head
        (kept apart from V: the least of each over merged suffixes bounds the least of their
        largest)."""
        self.cols = self.N + 1 if (self.tied and self.name != "v" and not standalone) else 1
        self.one_sample = grouped is not False
        return _Programme(self, cap, standalone, grouped).run()


class _Programme:
    """One run of :meth:`_Family.solve`: its terms chosen once, then the suffixes extended stage by stage."""

    def __init__(self, fam: _Family, cap: float, standalone: bool, grouped: bool | None):
        self.fam, self.best, self.standalone = fam, cap, standalone
        N, b = fam.N, fam.b
        self.whole = (1 << N) - 1
        groups = {g: tuple(h for h in range(N) if g >> h & 1) for g in range(1, self.whole + 1)}
        self.groups = {g: hs for g, hs in groups.items() if len(hs) <= (1 if grouped is False else b)}
        load_of = fam._chunk_load if fam.chunked else fam._group_load
        if standalone:
            plain = load_of
            load_of = lambda hs, j: np.maximum(plain(hs, j), fam._order_term(hs, j))  # noqa: E731
        self.load_of = load_of
        self.fd_of = (lambda hs: fam.fdb[hs[0]] if len(hs) == 1 else np.minimum.reduce([fam.fd1[h] for h in hs])) \
            if fam.chunked else fam._group_fd
        self.f_of = lambda hs: fam.fb[hs[0]] if len(hs) == 1 else np.minimum.reduce([fam.f1[h] for h in hs])  # noqa: E731
        self.tail_tied = fam.cols > 1
        self.counts = (lambda fl: fl) if grouped else (lambda fl: True)  # noqa: E731  a whole plan that counts
        self.V: list[dict[int, dict[tuple[int, bool], np.ndarray]]] = [dict() for _ in range(N)]
        self.T: list[dict[int, dict[tuple[int, bool], np.ndarray]]] = [dict() for _ in range(N)]
        self.links: dict[tuple[int, int], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}

    def run(self) -> float:
        self._last_stages()
        for j in range(self.fam.N - 1):
            for U, heads in self.V[j].items():
                for g in _subsets(self.whole & ~U):
                    hs = self.groups.get(g)
                    if hs is not None:
                        self._stage_before(j, U, heads, g, hs)
        return self.best

    def _last_stages(self) -> None:
        fam, L, N = self.fam, self.fam.L, self.fam.N
        for g, hs in self.groups.items():
            last = self.load_of(hs, 0)[:, L].copy()
            tail = last.copy()
            fl = len(hs) > 1
            if not fam.chunked and self.counts(fl):  # one stage: the whole model on one group
                self.best = min(self.best, float(last[0]))
            last[last >= self.best] = INF
            last[0] = INF
            if not np.isfinite(last).any():
                continue
            key = (hs[0] if len(hs) == 1 else -1, fl)
            col = (hs[0] if len(hs) == 1 else N) if fam.cols > 1 else 0
            arr = np.full((L + 1, fam.cols), INF)
            arr[:, col] = last
            self.V[0].setdefault(g, {})[key] = arr
            if self.tail_tied:
                tarr = np.full((L + 1, fam.cols), INF)
                tarr[:, col] = tail
                self.T[0].setdefault(g, {})[key] = tarr

    def _stage_before(self, j: int, U: int, heads: dict, g: int, hs: tuple[int, ...]) -> None:
        """The group ``hs`` as the stage before each suffix of ``heads`` (devices U, j + 1 stages)."""
        fam = self.fam
        Ms: dict[bool, np.ndarray] = {}
        Ts: dict[bool, np.ndarray] = {}
        for (h, fl0), arr in heads.items():
            key = (g, h)
            if key not in self.links:
                self.links[key] = fam._link_terms(hs, None if h < 0 else h)
            lat, thr, fw = self.links[key]
            cand = np.maximum((0.0 if self.standalone else lat[:, None]) + arr, thr[:, None])
            fl = fl0 or len(hs) > 1
            Ms[fl] = np.minimum(Ms[fl], cand) if fl in Ms else cand
            if self.tail_tied:
                tc = fw[:, None] + self.T[j][U][(h, fl0)]
                Ts[fl] = np.minimum(Ts[fl], tc) if fl in Ts else tc
        load = self.load_of(hs, j + 1)
        fd = np.zeros_like(load) if self.standalone else self.fd_of(hs)
        ff = self.f_of(hs) if self.tail_tied else None
        for fl, M in Ms.items():
            tot = np.maximum(load[:, :, None], fd[:, :, None] + M[None, :, :])
            if fam.cols > 1:
                tied = fam._tied(hs, U)
                # the head stage all-reduces the tied weight after its own work; without a split
                # backward every stage's gradient reaches it first (its drain)
                head = np.maximum(load[0][:, None] + tied[None, :], tot[0])
                if not fam.split:
                    head = np.maximum(head, fd[0][:, None] + M + tied[None, :])
                # the last stage's work from the first forward's arrival, then the all-reduce
                head = np.maximum(head, ff[0][:, None] + Ts[fl] + tied[None, :])
                tot[0] = head
            new = tot.min(axis=1)
            if self.counts(fl):
                self.best = min(self.best, float(new[0].min()))
            new[new >= self.best] = INF
            new[0] = INF  # a suffix starting at layer 0 is a whole plan: counted above
            if not np.isfinite(new).any():
                continue
            key = (hs[0] if len(hs) == 1 else -1, fl)
            slot = self.V[j + 1].setdefault(U | g, {})
            slot[key] = np.minimum(slot[key], new) if key in slot else new
            if self.tail_tied:
                tnew = (ff[:, :, None] + Ts[fl][None, :, :]).min(axis=1)
                tslot = self.T[j + 1].setdefault(U | g, {})
                tslot[key] = np.minimum(tslot[key], tnew) if key in tslot else tnew
