"""The price of every action of a plan's schedule, from measured profiles and links.

:class:`MeasuredCost` is the simulator's cost model (``sim.replay.CostModel``, which it
satisfies by its methods; naming that protocol here would make the cost layer import the
simulator). Its compute times come from :func:`torchpp.cost.stage.stage_time`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from ..formats import POWERSGD_RANK, Bandwidth, FormatError, Plan, PlanStage, wire_ratio
from ..schedules import Action, Kind
from .links import Links
from .profiles import Profiles
from .stage import Span, StageTime, boundary_bytes, rank_weights, stage_time, stage_weights, tied_rows_bytes


def optimizer_rate(optimizer_s_per_byte: Mapping[str, float] | float | None, host: str) -> float:
    """Seconds per parameter byte of ``host``'s optimizer step: its entry in a per-host map, or the one
    rate given for every host (0 where none is known)."""
    if isinstance(optimizer_s_per_byte, Mapping):
        return float(optimizer_s_per_byte.get(host, 0.0))
    return float(optimizer_s_per_byte or 0.0)


@dataclass
class _RankCost:
    host: str
    stage: PlanStage
    """The rank's first chunk."""
    time: StageTime
    """Its first chunk's compute time (``times`` has every chunk's)."""
    optimizer: float
    times: dict[int, StageTime] = field(default_factory=dict)
    """chunk index -> that chunk's compute time on this rank's host."""


def _stage_time(profiles: Profiles, host: str, stage: PlanStage, memo: dict | None) -> StageTime:
    if memo is None:
        return stage_time(profiles, host, stage)
    key = (host, Span.of_stage(stage))
    got = memo.get(key)
    if got is None:
        got = memo[key] = stage_time(profiles, host, key[1])
    return got


class MeasuredCost:
    """replay's CostModel for one plan, from measured profiles and links.

    ``optimizer_s_per_byte[h]``: seconds per parameter byte of the optimizer step on host h; when
    not given, each host's rate as ``torchpp profile`` measured it (``Profiles.optimizer_rate``,
    0 where no host has one). A rank's one optimizer step covers every chunk it holds (the tied
    weight once when it holds both ends).
    """

    def __init__(self, plan: Plan, profiles: Profiles, links: Links | Bandwidth,
                 optimizer_s_per_byte: Mapping[str, float] | float | None = None,
                 stage_times: dict | None = None):
        """``stage_times``: a dict kept across plans priced on the same, unchanged ``profiles``
        (a search prices thousands): each (host, span)'s compute time is worked out once."""
        self.plan, self.p = plan, profiles
        self.links = links if isinstance(links, Links) else Links(links)
        if plan.model.num_layers != profiles.model.num_layers:
            raise FormatError("plan.json", "model.num_layers", f"{profiles.model.num_layers} (the profiled model)",
                              plan.model.num_layers)
        hosts = [d.host for s in plan.stages for d in s.devices]
        profiles.ensure(hosts)
        self.backward_split = profiles.backward_split(hosts)
        """How I and W are priced: measured, or the halves assumption (``Profiles.backward_split``)."""
        self._compute: dict[tuple, float] = {}
        self._out_bytes: dict[int, float] = {}
        """Bytes per sample leaving each stage (a plan's transfers ask for few stages, many times)."""
        self.burst_s = self._burst_s if self.links.bw.burst_bytes else None
        self.nic_s = self._nic_s if self.links.shares_nics else None
        self.rank: dict[int, _RankCost] = {}
        for r in plan.ranks:
            chunks = plan.stages_of_rank(r)
            host = chunks[0].device(r).host
            o = (optimizer_rate(optimizer_s_per_byte, host) if optimizer_s_per_byte is not None
                 else profiles.optimizer_rate(host)[0])
            w = rank_weights(profiles, chunks)
            times = {s.index: _stage_time(profiles, host, s, stage_times) for s in chunks}
            self.rank[r] = _RankCost(host, chunks[0], times[chunks[0].index], o * w, times)

    @staticmethod
    def _samples(a: Action, default: int) -> int:
        return a.samples[1] - a.samples[0] if a.samples is not None else default

    def compute_s(self, rank: int, action: Action) -> float:
        key = (rank, action.kind, action.stage, action.samples)
        got = self._compute.get(key)
        if got is None:
            got = self._compute[key] = self._compute_s(rank, action)
        return got

    def _compute_s(self, rank: int, action: Action) -> float:
        """One action's seconds (:meth:`compute_s` keeps them: every micro-batch asks again)."""
        rc = self.rank[rank]
        if action.kind == Kind.OPTIMIZER:
            return rc.optimizer
        own = action.stage in rc.times
        t = rc.times[action.stage] if own else rc.time
        n = self._samples(action, (self.plan.stages[action.stage].device(rank) if own
                                   else self.plan.device_of_rank(rank)).samples)
        if action.kind == Kind.FORWARD:
            return t.forward(n)
        if action.kind == Kind.BACKWARD:
            return t.backward(n)
        if action.kind == Kind.BACKWARD_INPUT:
            return t.backward_input(n)
        if action.kind == Kind.BACKWARD_WEIGHT:
            return t.backward_weight(n)
        raise ValueError(f"compute_s: {action} is not a compute action")

    def _send(self, src: int, dst: int, action: Action) -> tuple[str, str, float, PlanStage]:
        """(sender's host, receiver's host, fp32 bytes, the stage whose output link it crosses) of a send."""
        n = self._samples(action, 1)
        if action.kind == Kind.SEND_ACT:
            at = action.stage
        elif action.kind == Kind.SEND_GRAD:
            at = action.stage - 1
        else:
            raise ValueError(f"transfer_s: {action} is not a send")
        link = self.plan.stages[at]
        per = self._out_bytes.get(at)
        if per is None:
            per = self._out_bytes[at] = float(boundary_bytes(self.p, link))
        return self.rank[src].host, self.rank[dst].host, per * n, link

    def transfer_s(self, src: int, dst: int, action: Action) -> float:
        a, b, nbytes, link = self._send(src, dst, action)
        if link.wire in (None, "fp32"):
            return self.links.time(a, b, nbytes)
        return self.links.wire_time(a, b, nbytes, link.wire, self.plan.model.hidden_size,
                                    self.p.link_codec(a, b, link.wire))

    def _burst_s(self, src: int, dst: int, action: Action) -> tuple[float, float]:
        """(the link's bucket in seconds, what a full bucket takes off this send): ``Links.burst_s``
        of the bytes the send puts on the wire (its wire format's). :attr:`burst_s` where a link
        has a measured burst, else None (the simulator's FIFO links as they were)."""
        a, b, nbytes, link = self._send(src, dst, action)
        return self.links.burst_s(a, b, nbytes * wire_ratio(link.wire, self.plan.model.hidden_size))

    def _nic_s(self, src: int, dst: int, action: Action) -> tuple[str, float, str, float]:
        """(sender's host, seconds the send holds its uplink, receiver's host, seconds it holds its
        downlink): ``Links.nic_s`` of the bytes the send puts on the wire. :attr:`nic_s` where some
        host's interface is shared (measured fan-out / fan-in), else None."""
        a, b, nbytes, link = self._send(src, dst, action)
        up, down = self.links.nic_s(a, b, nbytes * wire_ratio(link.wire, self.plan.model.hidden_size))
        return a, up, b, down

    def allreduce_s(self, action: Action) -> float:
        """A ring all-reduce of the group's weights, or of what its ``sync`` puts on the wire per step
        (int8: an all-gather of every member's codes, ``Links.ring_allgather``; diloco: its outer
        all-reduce spread over H steps; the tied pair's ``rows``: two broadcasts of the touched
        rows over the first and last stages' ranks, the gradient's from the first stage's first
        device and the next step's weights from the last stage's, which the runtime makes one at
        the step's end and one at the next step's start, both on the critical path, each on links
        that rested since the last; between two devices, two one-way transfers)."""
        hosts = [self.rank[r].host for r in action.group or ()]
        nbytes = self.p.tied_bytes if action.tied else float(stage_weights(self.p, self.plan.stages[action.stage]))
        sync = self.plan.tied_sync if action.tied else self.plan.stages[action.stage].sync
        if sync is not None and sync.kind == "rows":  # the gradient's rows up, the next step's rows down
            group = list(action.group or ())
            roots = (group.index(self.plan.stages[i].devices[0].rank) for i in (0, -1))
            rows = tied_rows_bytes(self.p, self.plan)
            return sum(self.links.tree_broadcast(hosts, r, rows) for r in roots)
        if sync is None:
            return self.links.ring_allreduce(hosts, nbytes)
        codec = 0.0
        if sync.kind == "allreduce" and sync.wire != "fp32":  # every member encodes its own, decodes each
            k = len(hosts) if sync.wire == "int8" else 1
            codec = max((e + k * d for e, d in (self.p.codec_rate(h, sync.wire) for h in hosts)), default=0.0) * nbytes
        elif sync.kind == "powersgd":  # every member's matrix products, in proportion to the rank
            codec = max((e + d for e, d in (self.p.codec_rate(h, "powersgd") for h in hosts)), default=0.0) * nbytes \
                * sync.rank / POWERSGD_RANK
        m = self.plan.model
        shape = (m.vocab_size, m.hidden_size) if action.tied else None
        wire = sync.allreduce_bytes(nbytes, m.hidden_size, shape)
        if sync.wire == "int8" and sync.kind in ("allreduce", "diloco"):  # the runtime all-gathers int8 codes
            # the tied pair's ends arrive apart (the first stage's backward ends last); replicas together
            return self.links.ring_allgather(hosts, wire, skewed=action.tied) + codec
        return self.links.ring_allreduce(hosts, wire) + codec
