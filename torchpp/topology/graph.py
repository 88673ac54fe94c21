"""A topology as data: hosts (devices) and switches joined by links, in JSON and in seed 001's text.

Nodes ``0 .. hosts-1`` are the devices (rank ``r`` of a plan runs on host ``r`` unless a
placement says otherwise); every other node id is a switch. A link is full duplex: each
direction carries its full rate. A link may belong to a *medium* (Wi-Fi: one channel for
everyone): every transfer over any link of the medium, in either direction, shares the
medium's one rate.

Seed 001 (SimAI) text format::

    <nodes> <gpus_per_server> <nvswitches> <switches> <links> <gpu_type>
    <switch id> <switch id> ...
    <src> <dst> <bandwidth, e.g. 100Gbps> <latency, e.g. 0.0005ms> <error rate>
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..formats import FormatError, Reader, check_format, read_json, write_json

TOPOLOGY_KIND, TOPOLOGY_VERSION = "topology", 1
GBPS = 1e9 / 8
"""Bytes per second in one Gbit/s."""


@dataclass(frozen=True, slots=True)
class Link:
    src: int
    dst: int
    gbps: float
    latency_s: float = 0.0
    error_rate: float = 0.0
    medium: str | None = None
    """Name of the shared medium this link is part of (None: a link of its own)."""

    @property
    def bytes_per_s(self) -> float:
        return self.gbps * GBPS


@dataclass(kw_only=True)
class Topology:
    """Hosts ``0..hosts-1``, switches (the other ids), links and shared media."""

    name: str
    hosts: int
    switches: list[int]
    links: list[Link]
    gpus_per_server: int = 1
    nvswitches: int = 0
    """How many of ``switches`` (the first ones) are NVSwitches (the seed's header counts them)."""
    gpu_type: str = "cpu"
    media: dict[str, float] = field(default_factory=dict)
    """Medium name -> its shared rate in Gbit/s."""
    format: str = f"torchpp.{TOPOLOGY_KIND}/{TOPOLOGY_VERSION}"

    def __post_init__(self) -> None:
        validate_topology(self)

    @property
    def num_nodes(self) -> int:
        return self.hosts + len(self.switches)

    # ------------------------------------------------------------------ JSON
    def to_json(self) -> dict[str, Any]:
        links = []
        for ln in self.links:
            d: dict[str, Any] = {"src": ln.src, "dst": ln.dst, "gbps": ln.gbps, "latency_s": ln.latency_s}
            if ln.error_rate:
                d["error_rate"] = ln.error_rate
            if ln.medium is not None:
                d["medium"] = ln.medium
            links.append(d)
        return {"format": self.format, "name": self.name, "hosts": self.hosts, "gpus_per_server": self.gpus_per_server,
                "nvswitches": self.nvswitches, "gpu_type": self.gpu_type, "switches": list(self.switches),
                "media": dict(self.media), "links": links}

    def save(self, path: str | os.PathLike) -> Path:
        return write_json(path, self.to_json())

    @staticmethod
    def parse(data: Any, source: str) -> "Topology":
        check_format(data, source, TOPOLOGY_KIND, [TOPOLOGY_VERSION])
        r = Reader(data, source)
        media = r.obj("media", {})
        links = []
        for lr in r.objs("links", min_len=0):
            links.append(Link(lr.int("src", min_value=0), lr.int("dst", min_value=0), lr.float("gbps", positive=True),
                              lr.float("latency_s", 0.0, min_value=0.0), lr.float("error_rate", 0.0, min_value=0.0),
                              lr.str("medium", None)))
        try:
            return Topology(name=r.str("name", "topology"), hosts=r.int("hosts", min_value=1),
                            switches=r.ints("switches", []), links=links,
                            gpus_per_server=r.int("gpus_per_server", 1, min_value=1),
                            nvswitches=r.int("nvswitches", 0, min_value=0), gpu_type=r.str("gpu_type", "cpu"),
                            media={k: media.float(k, positive=True) for k in media.data})
        except FormatError as e:
            raise FormatError(source, e.field_path, e.expected) from None

    @staticmethod
    def load(path: str | os.PathLike) -> "Topology":
        p = Path(path)
        if p.suffix != ".json":
            return read_simai(p)
        return Topology.parse(read_json(p), str(p))


def validate_topology(t: Topology, source: str = "topology") -> None:
    """Ids in range, switches distinct and not hosts, every medium named, every host reachable."""
    n = t.num_nodes
    sw = set(t.switches)
    if len(sw) != len(t.switches) or any(not t.hosts <= s < n for s in sw):
        raise FormatError(source, "switches", f"distinct ids in {t.hosts}..{n - 1} (hosts are 0..{t.hosts - 1})",
                          t.switches[:8])
    if not 0 <= t.nvswitches <= len(sw):
        raise FormatError(source, "nvswitches", f"0..{len(sw)}", t.nvswitches)
    for i, ln in enumerate(t.links):
        if not (0 <= ln.src < n and 0 <= ln.dst < n) or ln.src == ln.dst:
            raise FormatError(source, f"links[{i}]", f"two distinct node ids in 0..{n - 1}", (ln.src, ln.dst))
        if not ln.gbps > 0:
            raise FormatError(source, f"links[{i}].gbps", "a rate > 0", ln.gbps)
        if ln.medium is not None and ln.medium not in t.media:
            raise FormatError(source, f"links[{i}].medium", f"one of media {sorted(t.media)}", ln.medium)
    if t.hosts > 1:
        seen = _reachable(t, 0)
        lost = [h for h in range(t.hosts) if h not in seen]
        if lost:
            raise FormatError(source, "links", f"a path from host 0 to every host; none to {lost[:8]}")


def _reachable(t: Topology, start: int) -> set[int]:
    adj: dict[int, list[int]] = {}
    for ln in t.links:
        adj.setdefault(ln.src, []).append(ln.dst)
        adj.setdefault(ln.dst, []).append(ln.src)
    seen, todo = {start}, [start]
    while todo:
        for m in adj.get(todo.pop(), ()):
            if m not in seen:
                seen.add(m)
                todo.append(m)
    return seen


# ----------------------------------------------------------------------------- seed 001's text format
_UNITS = {"bps": 1e-9, "kbps": 1e-6, "mbps": 1e-3, "gbps": 1.0, "tbps": 1e3}
_TIME = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}


def _value(text: str, units: dict[str, float], what: str, source: str, line: int) -> float:
    m = re.fullmatch(r"([0-9.eE+-]+)\s*([A-Za-z]*)", text.strip())
    unit = (m.group(2) if m else "").lower() or next(iter(units))
    if not m or unit not in units:
        raise FormatError(source, f"line {line}", f"a {what} such as 100Gbps / 0.0005ms", text)
    return float(m.group(1)) * units[unit]


def read_simai(path: str | os.PathLike) -> Topology:
    """Parse seed 001's topology text (SimAI's gen_Topo_Template.py output)."""
    src = str(path)
    lines = [ln.split() for ln in Path(path).read_text().splitlines() if ln.strip()]
    if len(lines) < 2 or len(lines[0]) < 5:
        raise FormatError(src, "line 1", "'<nodes> <gpus_per_server> <nvswitches> <switches> <links> [gpu_type]'")
    try:
        nodes, gps, nvs, nsw, nlinks = (int(x) for x in lines[0][:5])
        switches = [int(x) for x in lines[1]]
    except ValueError:
        raise FormatError(src, "lines 1-2", "integers (counts, then switch ids)") from None
    gpu = lines[0][5] if len(lines[0]) > 5 else "cpu"
    if len(switches) != nvs + nsw:
        raise FormatError(src, "line 2", f"{nvs + nsw} switch ids (header)", len(switches))
    links = []
    for i, parts in enumerate(lines[2:], start=3):
        if len(parts) < 4:
            raise FormatError(src, f"line {i}", "'<src> <dst> <bandwidth> <latency> [error_rate]'", " ".join(parts))
        links.append(Link(int(parts[0]), int(parts[1]), _value(parts[2], _UNITS, "bandwidth", src, i),
                          _value(parts[3], _TIME, "latency", src, i), float(parts[4]) if len(parts) > 4 else 0.0))
    if len(links) != nlinks:
        raise FormatError(src, "line 1", f"a link count equal to the {len(links)} link lines", nlinks)
    hosts = nodes - len(switches)
    try:
        return Topology(name=Path(path).stem, hosts=hosts, switches=switches, links=links, gpus_per_server=gps,
                        nvswitches=nvs, gpu_type=gpu)
    except FormatError as e:
        raise FormatError(src, e.field_path, e.expected) from None


def write_simai(t: Topology, path: str | os.PathLike) -> Path:
    """Write seed 001's text format (shared media are not expressible there and are refused)."""
    if t.media:
        raise FormatError(str(path), "media", "no shared medium (SimAI's text format has none)", sorted(t.media))
    out = [f"{t.num_nodes} {t.gpus_per_server} {t.nvswitches} {len(t.switches) - t.nvswitches} {len(t.links)} "
           f"{t.gpu_type}", " ".join(str(s) for s in t.switches)]
    out += [f"{ln.src} {ln.dst} {ln.gbps:g}Gbps {ln.latency_s * 1e3:g}ms {ln.error_rate:g}" for ln in t.links]
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text("\n".join(out) + "\n")
    return p
