"""The one accessor of measured costs: per-host block times, bytes, links, and plan pricing.

Everything that needs the time of a forward, a backward, a transfer or an all-reduce asks this
module: the planner's search (through :class:`Profiles` prefix sums) and its final ranking
(through :func:`price`, which replays the action lists of ``schedules.build``), and the
simulator (through :class:`MeasuredCost`). A block is the embedding, one decoder layer, or the
tail (final norm + lm_head + loss); block ``0`` is the embedding, block ``i + 1`` decoder layer
``i`` and block ``N + 1`` the tail, so every stage owns a contiguous run of blocks.

A call of a block on ``n`` samples costs ``fixed + n * per_sample``: the per-call part is
fitted by ``torchpp profile --batch 1,4`` (0 when one size was measured) and the per-sample
part is the rest of the time measured at ``run.batch``. A host with its own layers file uses its own table; a host with only a capacity uses
the reference host's table divided by its capacity (seed 000 step 2).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

import numpy as np

from ..formats import Bandwidth, Capacities, FormatError, HostTable, LayersFile, ModelInfo, Plan, PlanStage
from ..schedules import Action, Kind, build
from ..sim.replay import Timeline, replay


def stage_blocks(layers: tuple[int, int], has_embed: bool, has_tail: bool) -> tuple[int, int]:
    """Block range [lo, hi) of a stage holding decoder layers [a, b) (plus embed / tail)."""
    a, b = layers
    return (0 if has_embed else a + 1), (b + 2 if has_tail else b + 1)


@dataclass
class Profiles:
    """Per-host, per-block seconds per sample and per-block bytes of one model.

    ``fwd[h][j]`` / ``bwd[h][j]``: seconds per sample of block j on host h; ``fwd0[h][j]`` /
    ``bwd0[h][j]``: seconds per call. ``param_bytes[j]``, ``act_bytes[j]``: parameter bytes and
    output bytes per sample of block j.
    """

    model: ModelInfo
    seq_len: int
    param_bytes: np.ndarray
    act_bytes: np.ndarray
    fwd: dict[str, np.ndarray] = field(default_factory=dict)
    bwd: dict[str, np.ndarray] = field(default_factory=dict)
    fwd0: dict[str, np.ndarray] = field(default_factory=dict)
    bwd0: dict[str, np.ndarray] = field(default_factory=dict)
    call: dict[str, float] = field(default_factory=dict)
    """Per host: runtime seconds per forward or backward call of a stage (LayersFile.call_overhead_s)."""
    origin: dict[str, str] = field(default_factory=dict)
    """How each host's table was obtained (its layers file, capacities table, or scaled)."""
    capacities: Capacities | None = None
    capacities_source: str = "capacities.json"

    @property
    def num_blocks(self) -> int:
        return len(self.param_bytes)

    @property
    def tied_bytes(self) -> int:
        """Bytes of the embedding weight shared with lm_head (0 when embeddings are not tied)."""
        return int(self.param_bytes[0]) if self.model.tied_embeddings else 0

    # ------------------------------------------------------------------ construction
    @staticmethod
    def from_layers(layers: Sequence[LayersFile], capacities: Capacities | None = None,
                    sources: Sequence[str] | None = None, capacities_source: str = "capacities.json") -> "Profiles":
        if not layers:
            raise ValueError("at least one layers file is needed (the model's bytes come from it)")
        sources = list(sources) if sources is not None else [f"layers_{lf.host}.json" for lf in layers]
        first, src0 = layers[0], sources[0]
        for lf, src in zip(layers[1:], sources[1:]):
            for key in ("name", "num_layers", "hidden_size", "vocab_size", "tied_embeddings", "dtype"):
                if getattr(lf.model, key) != getattr(first.model, key):
                    raise FormatError(src, f"model.{key}", f"{getattr(first.model, key)!r} as in {src0}",
                                      getattr(lf.model, key))
            if lf.run.seq_len != first.run.seq_len:
                raise FormatError(src, "run.seq_len", f"{first.run.seq_len} as in {src0}", lf.run.seq_len)
        blocks = [first.embed, *first.layers, first.tail]
        param = np.array([first.embed_param_bytes, *[b.param_bytes for b in first.layers], first.tail_param_bytes],
                         dtype=float)
        act = np.array([b.activation_bytes_per_sample for b in blocks], dtype=float)
        p = Profiles(model=first.model, seq_len=first.run.seq_len, param_bytes=param, act_bytes=act,
                     capacities=capacities, capacities_source=capacities_source)
        seen: dict[str, str] = {}
        for lf, src in zip(layers, sources):
            if lf.host in seen:
                raise FormatError(src, "host", f"a host not already measured by {seen[lf.host]}", lf.host)
            seen[lf.host] = src
            bl = [lf.embed, *lf.layers, lf.tail]
            p.set_table(lf.host, [b.forward_time_s for b in bl], [b.backward_time_s for b in bl], lf.run.batch, src,
                        [b.forward_fixed_s for b in bl], [b.backward_fixed_s for b in bl])
            p.call[lf.host] = lf.call_overhead_s
        if capacities is not None:
            for h, t in capacities.tables.items():
                if h not in p.fwd:
                    if len(t.forward_time_s) != p.num_blocks:
                        raise FormatError(capacities_source, f"tables.{h}.forward_time_s",
                                          f"{p.num_blocks} entries (embed, {p.num_blocks - 2} layers, tail)",
                                          len(t.forward_time_s))
                    p.set_table(h, t.forward_time_s, t.backward_time_s, t.batch, f"{capacities_source} tables.{h}",
                                t.forward_fixed_s or None, t.backward_fixed_s or None)
        return p

    def set_table(self, host: str, fwd: Sequence[float], bwd: Sequence[float], batch: int, origin: str,
                  fwd_fixed: Sequence[float] | None = None, bwd_fixed: Sequence[float] | None = None) -> None:
        """Times of every block for ``batch`` samples, of which ``*_fixed`` seconds per call."""
        tf, tb = np.asarray(fwd, dtype=float), np.asarray(bwd, dtype=float)
        f0 = np.zeros_like(tf) if fwd_fixed is None else np.asarray(fwd_fixed, dtype=float)
        b0 = np.zeros_like(tb) if bwd_fixed is None else np.asarray(bwd_fixed, dtype=float)
        if not (len(tf) == len(tb) == len(f0) == len(b0) == self.num_blocks):
            raise FormatError(origin, "layers", f"{self.num_blocks} blocks", len(tf))
        if (tf < 0).any() or (tb < 0).any() or (f0 < 0).any() or (b0 < 0).any():
            raise FormatError(origin, "forward_time_s", "times >= 0")
        f0, b0 = np.minimum(f0, tf), np.minimum(b0, tb)
        self.fwd[host], self.bwd[host] = (tf - f0) / batch, (tb - b0) / batch
        self.fwd0[host], self.bwd0[host], self.origin[host] = f0, b0, origin

    def ensure(self, hosts: Iterable[str], devices_source: str = "devices.json") -> None:
        """Make every host priceable, scaling the reference table by capacity where needed."""
        for h in hosts:
            if h in self.fwd:
                continue
            cap = self.capacities
            if cap is None or h not in cap.capacity:
                raise FormatError(self.capacities_source if cap else devices_source, f"capacity.{h}",
                                  f"a capacity for host {h!r} (it has no layers file of its own)"
                                  + ("" if cap else "; pass --capacities"))
            if cap.ref_host not in self.fwd:
                raise FormatError(self.capacities_source, "ref_host", "a host with a layers file or a table "
                                  f"(to scale for {h!r})", cap.ref_host)
            c = cap.capacity[h] / cap.capacity[cap.ref_host]
            self.fwd[h] = self.fwd[cap.ref_host] / c
            self.bwd[h] = self.bwd[cap.ref_host] / c
            self.fwd0[h] = self.fwd0[cap.ref_host] / c
            self.bwd0[h] = self.bwd0[cap.ref_host] / c
            self.call[h] = self.call.get(cap.ref_host, 0.0) / c
            self.origin[h] = f"{cap.ref_host} table / capacity {c:.3g}"

    def table(self, host: str) -> tuple[np.ndarray, np.ndarray]:
        if host not in self.fwd:
            self.ensure([host])
        return self.fwd[host], self.bwd[host]

    def fixed(self, host: str) -> tuple[np.ndarray, np.ndarray]:
        """Seconds per call of every block (forward, backward) on ``host``."""
        if host not in self.fwd:
            self.ensure([host])
        return self.fwd0[host], self.bwd0[host]

    def as_host_table(self, host: str, batch: int) -> HostTable:
        f, b = self.table(host)
        f0, b0 = self.fixed(host)
        return HostTable(batch=batch, forward_time_s=list(f0 + f * batch), backward_time_s=list(b0 + b * batch),
                         forward_fixed_s=list(f0), backward_fixed_s=list(b0))

    # ------------------------------------------------------------------ stage quantities
    def stage_fwd(self, host: str, stage: PlanStage) -> float:
        lo, hi = stage_blocks(stage.layers, stage.has_embed, stage.has_tail)
        return float(self.table(host)[0][lo:hi].sum())

    def stage_bwd(self, host: str, stage: PlanStage) -> float:
        """Backward per sample, including the forward of recomputed layers."""
        lo, hi = stage_blocks(stage.layers, stage.has_embed, stage.has_tail)
        f, b = self.table(host)
        a = stage.layers[0]
        rec = sum(f[a + 1 + i] for i, r in enumerate(stage.recompute) if r)
        return float(b[lo:hi].sum() + rec)

    def stage_recompute(self, host: str, stage: PlanStage) -> float:
        f, _ = self.table(host)
        a = stage.layers[0]
        return float(sum(f[a + 1 + i] for i, r in enumerate(stage.recompute) if r))

    def stage_fwd_fixed(self, host: str, stage: PlanStage) -> float:
        """Per-call part of the forward: the blocks' and the runtime's (``call``)."""
        lo, hi = stage_blocks(stage.layers, stage.has_embed, stage.has_tail)
        return float(self.fixed(host)[0][lo:hi].sum()) + self.call.get(host, 0.0)

    def stage_bwd_fixed(self, host: str, stage: PlanStage) -> float:
        """Per-call part of the backward, including the forward of recomputed layers."""
        lo, hi = stage_blocks(stage.layers, stage.has_embed, stage.has_tail)
        f0, b0 = self.fixed(host)
        a = stage.layers[0]
        return float(b0[lo:hi].sum() + sum(f0[a + 1 + i] for i, r in enumerate(stage.recompute) if r)) + \
            self.call.get(host, 0.0)

    def stage_time(self, host: str, stage: PlanStage, samples: int, backward: bool = False) -> float:
        """Seconds of one forward (or backward) call of the stage on ``samples`` samples (0 for none)."""
        if samples <= 0:
            return 0.0
        if backward:
            return self.stage_bwd_fixed(host, stage) + samples * self.stage_bwd(host, stage)
        return self.stage_fwd_fixed(host, stage) + samples * self.stage_fwd(host, stage)

    def stage_param_bytes(self, stage: PlanStage) -> float:
        lo, hi = stage_blocks(stage.layers, stage.has_embed, stage.has_tail)
        return float(self.param_bytes[lo:hi].sum())

    def boundary_bytes(self, stage: PlanStage) -> float:
        """Bytes per sample of the stage's output (what its next stage receives)."""
        _, hi = stage_blocks(stage.layers, stage.has_embed, stage.has_tail)
        return float(self.act_bytes[hi - 1])


class Links:
    """Link rates and latencies between hosts, with errors naming the missing link."""

    def __init__(self, bandwidth: Bandwidth, source: str = "bandwidth.json"):
        self.bw, self.source = bandwidth, source

    def check(self, hosts: Iterable[str]) -> None:
        missing = self.bw.missing_links(hosts)
        if missing:
            raise FormatError(self.source, f"bytes_per_sec.{missing[0]}",
                              f"a rate for every link between planned hosts; missing {', '.join(missing[:8])}"
                              + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""))

    def time(self, src: str, dst: str, nbytes: float) -> float:
        if src == dst and not self.bw.has(src, dst):
            return 0.0
        if not self.bw.has(src, dst):
            raise FormatError(self.source, f"bytes_per_sec.{Bandwidth.key(src, dst)}", "a link rate (bytes/s)")
        return self.bw.latency(src, dst) + nbytes / self.bw.rate(src, dst)

    def ring_allreduce(self, hosts: Sequence[str], nbytes: float) -> float:
        """Ring all-reduce: ``2(k−1)/k · bytes / slowest link`` plus 2(k−1) worst latencies."""
        k = len(hosts)
        if k <= 1 or nbytes <= 0:
            return 0.0
        pairs = [(a, b) for a in hosts for b in hosts if a != b]
        if not pairs:
            return 0.0
        for a, b in pairs:
            if not self.bw.has(a, b):
                raise FormatError(self.source, f"bytes_per_sec.{Bandwidth.key(a, b)}", "a link rate (bytes/s)")
        slow = min(self.bw.rate(a, b) for a, b in pairs)
        lat = max(self.bw.latency(a, b) for a, b in pairs)
        return 2 * (k - 1) / k * nbytes / slow + 2 * (k - 1) * lat


@dataclass
class _RankCost:
    host: str
    stage: PlanStage
    fwd: float
    bwd: float
    optimizer: float
    fwd0: float = 0.0
    bwd0: float = 0.0


class MeasuredCost:
    """replay's CostModel for one plan, from measured profiles and links.

    ``optimizer_s_per_byte[h]``: seconds per parameter byte of the optimizer step on host h
    (0 where not given: the layers file does not measure the optimizer).
    """

    def __init__(self, plan: Plan, profiles: Profiles, links: Links | Bandwidth,
                 optimizer_s_per_byte: Mapping[str, float] | float | None = None):
        self.plan, self.p = plan, profiles
        self.links = links if isinstance(links, Links) else Links(links)
        if plan.model.num_layers != profiles.model.num_layers:
            raise FormatError("plan.json", "model.num_layers", f"{profiles.model.num_layers} (the profiled model)",
                              plan.model.num_layers)
        hosts = [d.host for s in plan.stages for d in s.devices]
        profiles.ensure(hosts)
        self.rank: dict[int, _RankCost] = {}
        for s in plan.stages:
            w = profiles.stage_param_bytes(s)
            for d in s.devices:
                if isinstance(optimizer_s_per_byte, Mapping):
                    o = optimizer_s_per_byte.get(d.host, 0.0)
                else:
                    o = float(optimizer_s_per_byte or 0.0)
                self.rank[d.rank] = _RankCost(d.host, s, profiles.stage_fwd(d.host, s), profiles.stage_bwd(d.host, s),
                                              o * w, profiles.stage_fwd_fixed(d.host, s),
                                              profiles.stage_bwd_fixed(d.host, s))

    @staticmethod
    def _samples(a: Action, default: int) -> int:
        return a.samples[1] - a.samples[0] if a.samples is not None else default

    def compute_s(self, rank: int, action: Action) -> float:
        rc = self.rank[rank]
        if action.kind == Kind.OPTIMIZER:
            return rc.optimizer
        n = self._samples(action, self.plan.device_of_rank(rank).samples)
        if action.kind == Kind.FORWARD:
            return rc.fwd0 + rc.fwd * n if n > 0 else 0.0
        if action.kind == Kind.BACKWARD:
            return rc.bwd0 + rc.bwd * n if n > 0 else 0.0
        raise ValueError(f"compute_s: {action} is not a compute action")

    def transfer_s(self, src: int, dst: int, action: Action) -> float:
        n = self._samples(action, 1)
        stages = self.plan.stages
        if action.kind == Kind.SEND_ACT:
            per = self.p.boundary_bytes(stages[action.stage])
        elif action.kind == Kind.SEND_GRAD:
            per = self.p.boundary_bytes(stages[action.stage - 1])
        else:
            raise ValueError(f"transfer_s: {action} is not a send")
        return self.links.time(self.rank[src].host, self.rank[dst].host, per * n)

    def allreduce_s(self, action: Action) -> float:
        hosts = [self.rank[r].host for r in action.group or ()]
        nbytes = self.p.tied_bytes if action.tied else self.p.stage_param_bytes(self.plan.stages[action.stage])
        return self.links.ring_allreduce(hosts, nbytes)


def price(plan: Plan, profiles: Profiles, links: Links | Bandwidth,
          optimizer_s_per_byte: Mapping[str, float] | float | None = None) -> tuple[float, Timeline]:
    """Step time of ``plan``: replay its action lists (``schedules.build``) against measured costs."""
    cost = MeasuredCost(plan, profiles, links, optimizer_s_per_byte)
    tl = replay(build(plan), cost)
    return tl.makespan, tl
