"""Topology templates: the shapes a user asks about, built as :class:`Topology` data.

- :func:`star`: every host on one switch (64 Pis on one 1 Gbit/s switch; or per-host link rates).
- :func:`tree`: hosts on leaf switches, leaves on one spine through uplinks ``oversubscription``
  times thinner than the hosts below them.
- :func:`wifi`: every host on one access point, all sharing one channel (a transfer goes up to
  the access point and down again, so it uses the air twice).
- :func:`spectrum_x`: seed 001's rail-optimised fabric: GPU ``i`` of every server on rail
  switch ``i`` (ASW) of its segment, every ASW on every pod switch (PSW), the GPUs of a server
  on one NVSwitch.
- :func:`nvl`: NVLink domains of ``gpus_per_domain`` GPUs on one NVSwitch, each domain's GPUs
  on a leaf switch, leaves on one spine (``oversubscription`` as in :func:`tree`).
"""
from __future__ import annotations

from typing import Callable, Sequence

from .graph import Link, Topology


def star(hosts: int, gbps: float | Sequence[float] = 1.0, latency_s: float | Sequence[float] = 0.0) -> Topology:
    """``gbps`` and ``latency_s``: one for every link, or one per host (an uneven home network)."""
    rates, lats = _per_host(gbps, hosts, "gbps"), _per_host(latency_s, hosts, "latency_s")
    sw = hosts
    speed = f"{rates[0]:g}Gbps" if len(set(rates)) == 1 else "mixed"
    return Topology(name=f"star_{hosts}h_{speed}", hosts=hosts, switches=[sw],
                    links=[Link(h, sw, rates[h], lats[h]) for h in range(hosts)])


def _per_host(value: float | Sequence[float], hosts: int, what: str) -> list[float]:
    if isinstance(value, (int, float)):
        return [float(value)] * hosts
    out = [float(v) for v in value]
    if len(out) != hosts:
        raise ValueError(f"star: expected one {what} per host ({hosts}), got {len(out)}")
    return out


def tree(hosts: int, hosts_per_leaf: int = 8, gbps: float = 1.0, oversubscription: float = 1.0,
         latency_s: float = 0.0) -> Topology:
    if hosts_per_leaf < 1 or oversubscription <= 0:
        raise ValueError(f"tree: expected hosts_per_leaf >= 1 and oversubscription > 0, got {hosts_per_leaf}, "
                         f"{oversubscription}")
    leaves = -(-hosts // hosts_per_leaf)
    spine = hosts + leaves
    links = [Link(h, hosts + h // hosts_per_leaf, gbps, latency_s) for h in range(hosts)]
    up = hosts_per_leaf * gbps / oversubscription
    links += [Link(hosts + i, spine, up, latency_s) for i in range(leaves)]
    return Topology(name=f"tree_{hosts}h_{hosts_per_leaf}pl_{gbps:g}Gbps_os{oversubscription:g}", hosts=hosts,
                    switches=list(range(hosts, spine + 1)), links=links)


def wifi(hosts: int, gbps: float = 0.1, latency_s: float = 0.0) -> Topology:
    ap = hosts
    return Topology(name=f"wifi_{hosts}h_{gbps:g}Gbps", hosts=hosts, switches=[ap], media={"air": gbps},
                    links=[Link(h, ap, gbps, latency_s, medium="air") for h in range(hosts)])


def spectrum_x(gpus: int, gpus_per_server: int = 8, gbps: float = 100.0, nvlink_gbps: float = 2400.0,
               psw: int = 64, servers_per_segment: int = 64, latency_s: float = 5e-7,
               nvlink_latency_s: float = 2.5e-8, gpu_type: str = "A100") -> Topology:
    if gpus % gpus_per_server:
        raise ValueError(f"spectrum_x: {gpus} GPUs is not a multiple of {gpus_per_server} per server")
    servers = gpus // gpus_per_server
    segments = -(-servers // servers_per_segment)
    nvs0 = gpus
    asw0 = nvs0 + servers
    psw0 = asw0 + segments * gpus_per_server
    links = []
    for g in range(gpus):
        srv, rail = divmod(g, gpus_per_server)
        links.append(Link(g, nvs0 + srv, nvlink_gbps, nvlink_latency_s))
        links.append(Link(g, asw0 + (srv // servers_per_segment) * gpus_per_server + rail, gbps, latency_s))
    for a in range(segments * gpus_per_server):
        links += [Link(asw0 + a, psw0 + p, gbps * servers_per_segment / psw, latency_s) for p in range(psw)]
    return Topology(name=f"Spectrum-X_{gpus}g_{gpus_per_server}gps_{gbps:g}Gbps_{gpu_type}", hosts=gpus,
                    switches=list(range(nvs0, psw0 + psw)), nvswitches=servers, links=links,
                    gpus_per_server=gpus_per_server, gpu_type=gpu_type)


def nvl(gpus: int, gpus_per_domain: int = 72, gbps: float = 400.0, nvlink_gbps: float = 7200.0,
        oversubscription: float = 1.0, latency_s: float = 5e-7, nvlink_latency_s: float = 2.5e-8,
        gpu_type: str = "GB200") -> Topology:
    domains = -(-gpus // gpus_per_domain)
    nvs0, leaf0 = gpus, gpus + domains
    spine = leaf0 + domains
    links = []
    for g in range(gpus):
        d = g // gpus_per_domain
        links += [Link(g, nvs0 + d, nvlink_gbps, nvlink_latency_s), Link(g, leaf0 + d, gbps, latency_s)]
    links += [Link(leaf0 + d, spine, gpus_per_domain * gbps / oversubscription, latency_s) for d in range(domains)]
    return Topology(name=f"NVL{gpus_per_domain}_{gpus}g_{gbps:g}Gbps", hosts=gpus,
                    switches=list(range(nvs0, spine + 1)), nvswitches=domains, links=links,
                    gpus_per_server=gpus_per_domain, gpu_type=gpu_type)


TEMPLATES: dict[str, Callable[..., Topology]] = {"star": star, "tree": tree, "wifi": wifi,
                                                  "spectrum-x": spectrum_x, "nvl": nvl}
