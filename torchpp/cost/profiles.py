"""Measured block costs of one model on every host: per-sample and per-call seconds, bytes.

A call of a block on ``n`` samples costs ``fixed + n * per_sample``: the per-call part is
fitted by ``torchpp profile --batch 1,4`` (0 when one size was measured) and the per-sample
part is the rest of the time measured at ``run.batch``. A host with its own layers file uses its
own table; a host with only a capacity uses the reference host's table divided by its capacity
(seed 000 step 2). What a stage costs is :mod:`torchpp.cost.stage`'s to say.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

import numpy as np

from ..formats import Capacities, FormatError, HostTable, LayersFile, ModelInfo


def check_same_model(lf: LayersFile, src: str, first: LayersFile, src0: str, same_layers: bool = True) -> None:
    """``lf`` profiles ``first``'s model at its sequence length (``same_layers=False``: maybe only its
    first layers); else a FormatError naming ``src`` and the field."""
    keys = ("name", "num_layers", "hidden_size", "vocab_size", "tied_embeddings", "dtype", "autocast")
    for key in keys if same_layers else tuple(k for k in keys if k != "num_layers"):
        if getattr(lf.model, key) != getattr(first.model, key):
            raise FormatError(src, f"model.{key}", f"{getattr(first.model, key)!r} as in {src0}", getattr(lf.model, key))
    if lf.run.seq_len != first.run.seq_len:
        raise FormatError(src, "run.seq_len", f"{first.run.seq_len} as in {src0}", lf.run.seq_len)


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
    """Per host: runtime seconds per forward or backward call of a stage (LayersFile.call_overhead_s;
    for a host priced from capacities.json, its ``call_overhead_s`` entry: see capacity_call)."""
    origin: dict[str, str] = field(default_factory=dict)
    """How each host's table was obtained (its layers file, capacities table, or scaled)."""
    capacities: Capacities | None = None
    capacities_source: str = "capacities.json"
    input_share: dict[str, np.ndarray] = field(default_factory=dict)
    """Per host with a measured split: the fraction of each block's backward that computes the
    input gradient (``I``; the rest is ``W``). Hosts without one split it in halves."""
    split_factor: dict[str, float] = field(default_factory=dict)
    """Per measured host: ``I + W`` over ``B`` as the runtime splits a backward
    (LayersFile.backward_split_factor); hosts priced from capacities.json take their entry there,
    other hosts the reference host's, else 1."""

    split_layer: dict[str, float] = field(default_factory=dict)
    """Per measured host: seconds each decoder layer adds to a split backward call
    (LayersFile.backward_split_layer_s); hosts priced from capacities.json take their entry there,
    other hosts the reference host's over their capacity, else 0."""

    optim: dict[str, float] = field(default_factory=dict)
    """Per measured host: its optimizer step's seconds per parameter byte (LayersFile.optimizer_s_per_byte)."""
    codec: dict[str, dict[str, tuple[float, float]]] = field(default_factory=dict)
    """Per measured host and wire format: (encode, decode) CPU seconds per fp32 byte (LayersFile.codec_s_per_byte)."""
    sums: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    """Prefix sums over blocks kept for ``cost.stage`` (by host, with the arrays they were summed
    from: a table replaced by a new array is summed again)."""

    def codec_rate(self, host: str, fmt: str | None) -> tuple[float, float]:
        """(encode, decode) seconds per fp32 byte of ``fmt`` on ``host``; 0 for fp32 and where not measured
        (a host priced from capacities takes the reference host's figure over its capacity)."""
        if fmt in (None, "fp32"):
            return 0.0, 0.0
        if host in self.codec:
            return self.codec[host].get(fmt, (0.0, 0.0))
        cap = self.capacities
        if cap is not None and cap.ref_host in self.codec and host in cap.capacity:
            e, d = self.codec[cap.ref_host].get(fmt, (0.0, 0.0))
            return e / cap.capacity[host], d / cap.capacity[host]
        return 0.0, 0.0

    def link_codec(self, src: str, dst: str, fmt: str | None) -> tuple[float, float]:
        """(the sender's encode, the receiver's decode) seconds per fp32 byte of a transfer in ``fmt``."""
        return self.codec_rate(src, fmt)[0], self.codec_rate(dst, fmt)[1]

    left_out: dict[str, list[str]] = field(default_factory=dict)
    """Per host whose profile left blocks out (LayersFile.left_out): those blocks, priced from the
    hosts that timed them (``price_left_out``)."""
    memory_limit: dict[str, float] = field(default_factory=dict)
    """Per host that left blocks out: the memory limit its profile ran under, which the planner
    holds it to (so it is never given a block it could not hold)."""

    def backward_split_factor(self, host: str) -> float:
        cap = self.capacities
        return self._host_figure(host, self.split_factor, cap.backward_split_factor if cap else {}, 1.0)[0]

    def backward_split_layer_s(self, host: str) -> float:
        cap = self.capacities
        return self._host_figure(host, self.split_layer, cap.backward_split_layer_s if cap else {}, 0.0,
                                 by_capacity=True)[0]

    def optimizer_rate(self, host: str) -> tuple[float, str]:
        """Seconds per parameter byte of ``host``'s optimizer step and where the figure came from
        (0 where no host measured one)."""
        cap = self.capacities
        return self._host_figure(host, self.optim, cap.optimizer_s_per_byte if cap else {}, 0.0, by_capacity=True)

    def _host_figure(self, host: str, measured: dict[str, float], carried: Mapping[str, float], default: float,
                     by_capacity: bool = False) -> tuple[float, str]:
        """A per-host figure ``torchpp profile`` measures, and where it came from: the host's own
        (its layers file), else its entry carried in capacities.json, else the reference host's
        (over the host's relative capacity with ``by_capacity``: a time that scales with speed),
        else ``default``."""
        if host in measured:
            return float(measured[host]), self.origin.get(host, "its layers file")
        cap = self.capacities
        if cap is None:
            return default, "not measured"
        if host in carried:
            return float(carried[host]), f"{self.capacities_source}'s entry"
        if cap.ref_host not in measured and cap.ref_host not in carried:
            return default, "not measured"
        ref = float(measured.get(cap.ref_host, carried.get(cap.ref_host, default)))
        if not by_capacity:
            return ref, f"{cap.ref_host}'s"
        c = cap.capacity.get(host, 0.0) / cap.capacity[cap.ref_host]
        return (ref / c, f"{cap.ref_host}'s / capacity {c:.3g}") if c > 0 else (0.0, "no capacity")

    @property
    def num_blocks(self) -> int:
        return len(self.param_bytes)

    @property
    def tied_bytes(self) -> int:
        """Bytes of the embedding weight shared with lm_head (0 when embeddings are not tied)."""
        return int(self.param_bytes[0]) if self.model.tied_embeddings else 0

    BACKWARD_SPLIT_ASSUMED = "assumed: input gradient = weight gradient = backward / 2 (not measured)"

    def backward_share(self, host: str) -> np.ndarray:
        """Fraction of each block's backward on ``host`` that is the input gradient (``I``)."""
        ref = self.capacities.ref_host if self.capacities is not None else None
        share = self.input_share.get(host, self.input_share.get(ref) if ref else None)
        return share if share is not None else np.full(self.num_blocks, 0.5)

    def backward_split(self, hosts: Iterable[str]) -> str:
        """How the backward of ``hosts`` is split into I and W: measured, or the halves assumption."""
        ref = self.capacities.ref_host if self.capacities is not None else None
        hosts = list(hosts)
        factors = sorted({round(self.backward_split_factor(h), 3) for h in hosts})
        layer = sorted({round(1e3 * self.backward_split_layer_s(h), 2) for h in hosts})
        per_layer = (f" + {'/'.join(f'{x:g}' for x in layer)} ms per layer and call"
                     if any(x > 0 for x in layer) else "")
        cost = (f"; I + W = {'/'.join(f'{f:g}' for f in factors)} x B{per_layer} (measured split cost)"
                if any(f != 1.0 for f in factors) or per_layer else "")
        if all(h in self.input_share or (ref in self.input_share) for h in hosts):
            return "measured (layers files' backward_input_time_s)" + cost
        return self.BACKWARD_SPLIT_ASSUMED + cost

    # ------------------------------------------------------------------ construction
    @staticmethod
    def from_layers(layers: Sequence[LayersFile], capacities: Capacities | None = None,
                    sources: Sequence[str] | None = None, capacities_source: str = "capacities.json",
                    layers_only: bool = False) -> "Profiles":
        """Every host's table; ``layers_only``: blocks a host left out stay unpriced (0), for a
        caller that reads decoder layers alone (a speed check)."""
        if not layers:
            raise ValueError("at least one layers file is needed (the model's bytes come from it)")
        sources = list(sources) if sources is not None else [f"layers_{lf.host}.json" for lf in layers]
        first, src0 = layers[0], sources[0]
        for lf, src in zip(layers[1:], sources[1:]):
            check_same_model(lf, src, first, src0)
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
            if all(b.backward_input_time_s is not None for b in bl):
                p.input_share[lf.host] = np.array([b.backward_input_time_s / b.backward_time_s for b in bl])
            p.set_table(lf.host, [b.forward_time_s for b in bl], [b.backward_time_s for b in bl], lf.run.batch, src,
                        [b.forward_fixed_s for b in bl], [b.backward_fixed_s for b in bl])
            p.call[lf.host] = lf.call_overhead_s
            if lf.optimizer_s_per_byte:
                p.optim[lf.host] = lf.optimizer_s_per_byte
            if lf.codec_s_per_byte:
                p.codec[lf.host] = {f: (v[0], v[1]) for f, v in lf.codec_s_per_byte.items()}
            if lf.backward_split_factor is not None:
                p.split_factor[lf.host] = lf.backward_split_factor
            if lf.backward_split_layer_s is not None:
                p.split_layer[lf.host] = lf.backward_split_layer_s
            if lf.left_out:
                p.left_out[lf.host] = list(lf.left_out)
                if lf.memory_limit_bytes:
                    p.memory_limit[lf.host] = float(lf.memory_limit_bytes)
        if not layers_only:
            p.price_left_out(layers, sources)
        if capacities is not None:
            for h, t in capacities.tables.items():
                if h not in p.fwd:
                    if len(t.forward_time_s) != p.num_blocks:
                        raise FormatError(capacities_source, f"tables.{h}.forward_time_s",
                                          f"{p.num_blocks} entries (embed, {p.num_blocks - 2} layers, tail)",
                                          len(t.forward_time_s))
                    p.set_table(h, t.forward_time_s, t.backward_time_s, t.batch, f"{capacities_source} tables.{h}",
                                t.forward_fixed_s or None, t.backward_fixed_s or None)
                    p.call[h] = p.capacity_call(h)
        return p

    def price_left_out(self, layers: Sequence[LayersFile], sources: Sequence[str]) -> None:
        """Times of the blocks a host left out: the mean over the hosts that timed them of their
        times scaled to this host's speed (``speed_ratio``)."""
        for lf, src in zip(layers, sources):
            for name in lf.left_out:
                j = 0 if name == "embed" else self.num_blocks - 1
                donors = [m.host for m in layers if name not in m.left_out]
                if not donors:
                    raise FormatError(src, "left_out", f"a layers file among those given that timed {name} (every "
                                      "one left it out: profile a host that can hold it)", name)
                rows = [(self.speed_ratio(lf.host, m), m) for m in donors]
                for table in (self.fwd, self.bwd, self.fwd0, self.bwd0):
                    table[lf.host][j] = float(np.mean([table[m][j] * r for r, m in rows]))
                self.origin[lf.host] += (f"; {name} not timed there: from {', '.join(donors)} at its speed (x"
                                         + "/".join(f"{r:.3g}" for r, _ in rows) + ")")

    def speed_ratio(self, host: str, other: str) -> float:
        """Seconds on ``host`` per second on ``other``: their capacities' ratio where capacities.json
        has both, else the ratio of their decoder layers' measured seconds."""
        cap = self.capacities
        if cap is not None and cap.capacity.get(host, 0) > 0 and cap.capacity.get(other, 0) > 0:
            return float(cap.capacity[other] / cap.capacity[host])
        mine, theirs = self.layer_seconds(host, 1).sum(), self.layer_seconds(other, 1).sum()
        return float(mine / theirs) if theirs > 0 and mine > 0 else 1.0

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
            self.call[h] = self.capacity_call(h)
            self.origin[h] = f"{cap.ref_host} table / capacity {c:.3g}"

    def layer_seconds(self, host: str, batch: int) -> np.ndarray:
        """Forward + backward seconds of each decoder layer on ``host`` for one call of ``batch``
        samples: what capacities and speed checks compare hosts and runs by."""
        return (self.fwd0[host] + batch * self.fwd[host] + self.bwd0[host] + batch * self.bwd[host])[1:-1]

    def at_speed(self, ratios: Mapping[str, float]) -> None:
        """Every time of each host in ``ratios`` (a speed check's measured / profiled) multiplied by
        its ratio: the model priced at the speed its hosts have now rather than when profiled.
        Figures a host would take from another's (the reference table scaled by capacity) are
        made its own first, so one host's ratio never reaches another."""
        hosts = list(ratios)
        self.ensure(hosts)
        own = {h: (self.optimizer_rate(h)[0], self.backward_split_layer_s(h), self.backward_split_factor(h))
               for h in hosts}
        for h, r in ratios.items():
            if not r > 0:
                raise ValueError(f"speed ratio of host {h!r}: expected a number > 0, got {r!r}")
            opt, split_layer, split = own[h]
            self.fwd[h], self.bwd[h] = self.fwd[h] * r, self.bwd[h] * r
            self.fwd0[h], self.bwd0[h] = self.fwd0[h] * r, self.bwd0[h] * r
            self.call[h] = self.call.get(h, 0.0) * r
            self.optim[h], self.split_layer[h], self.split_factor[h] = opt * r, split_layer * r, split
            self.origin[h] = f"{self.origin.get(h, 'its table')} x {r:.3g} (speed check)"

    def per_sample_only(self, hosts: Iterable[str]) -> "Profiles":
        """A copy of these profiles with every per-call cost of ``hosts`` taken out (blocks' fixed
        seconds per call, the runtime's per call, a split backward's per layer and call): what
        the work would cost if calls were free, as the lower bound counts it."""
        hosts = list(hosts)
        self.ensure(hosts)
        out = copy.deepcopy(self)
        for h in hosts:
            out.fwd0[h], out.bwd0[h] = np.zeros_like(self.fwd0[h]), np.zeros_like(self.bwd0[h])
            out.call[h], out.split_layer[h] = 0.0, 0.0
        return out

    def without_runtime_calls(self, hosts: Iterable[str]) -> "Profiles":
        """A copy with only the runtime's seconds per call of ``hosts`` taken out (the blocks' fixed
        seconds kept): what a step would cost if the runtime itself were free."""
        hosts = list(hosts)
        self.ensure(hosts)
        out = copy.deepcopy(self)
        for h in hosts:
            out.call[h] = 0.0
        return out

    def capacity_call(self, host: str) -> float:
        """Runtime seconds per call of a host without a layers file: its own, measured on it by
        ``torchpp profile``'s call probe and carried in capacities.json, else the reference
        host's scaled by capacity (a capacities file from before the field, or a host not probed)."""
        cap = self.capacities
        return self._host_figure(host, self.call, cap.call_overhead_s if cap else {}, 0.0, by_capacity=True)[0]

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
