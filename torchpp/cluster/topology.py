"""The emulated cluster as a topology: a star, each host's link at its configured rate.

``cluster up`` joins every host's veth to one bridge (the switch) and shapes the host's uplink
and the switch port towards it, so the cluster *is* :func:`torchpp.topology.templates.star`
with per-host rates and latencies, when each host's ``rate`` and ``down_rate`` (and delays)
agree. A topology link is full duplex with one rate, so a host whose uplink and downlink
differ (an unset ``down_rate`` is an unshaped port), or a per-pair override, has no star of
its own: those are refused rather than approximated. The veths keep the kernel's default
MTU (1500), which sets how much of each rate the TCP headers take.
"""
from __future__ import annotations

from ..topology.graph import Topology
from ..topology.templates import star
from ..topology.wire import TC_FRAMING, goodput_gbps
from .config import ClusterConfig


def star_of(cfg: ClusterConfig, wire: bool = True, mtu: int = 1500) -> Topology:
    """The star the cluster's tc shaping builds: host ``i`` of the config is topology host ``i``.

    With ``wire`` (the default) each link offers the TCP goodput of its tc rate
    (:mod:`torchpp.topology.wire`: htb counts headers, transfers move payload), else the rate itself."""
    if cfg.links:
        raise ValueError(f"{cfg.source}: per-pair links ({cfg.links[0].src} -> {cfg.links[0].dst}) are not a star")
    rates, lats = [], []
    for h in cfg.hosts:
        if h.up.rate is None or h.down.rate != h.up.rate:
            raise ValueError(f"{cfg.source}: host {h.name}: expected one rate both ways for a star link, got up "
                             f"{h.up.describe()}, down {h.down.describe()}")
        if h.down.delay != h.up.delay:
            raise ValueError(f"{cfg.source}: host {h.name}: expected one delay both ways, got up {h.up.delay} s, "
                             f"down {h.down.delay} s")
        gbps = h.up.rate / 1e9
        rates.append(goodput_gbps(gbps, mtu, TC_FRAMING) if wire else gbps)
        lats.append(h.up.delay)
    t = star(len(cfg.hosts), rates, lats)
    t.name = f"{cfg.name}_star"
    return t
