"""bandwidth.json: measured link throughput and latency."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

from .. import validate as V
from .base import FormatError, Reader, _load, check_format, to_dict, write_json


# --- owned by the planner ---
BANDWIDTH_KIND, BANDWIDTH_VERSION = "bandwidth", 1

PROBE_SOURCE = "torchpp bandwidth probe"
"""How a bandwidth file ``torchpp bandwidth`` wrote begins its ``source``: its rates are each link's
capacity, measured with the link to itself (``torchpp replan`` lets no fitted rate exceed them)."""


def _is_link_key(k: Any) -> bool:
    return isinstance(k, str) and k.count("|") == 1 and "" not in k.split("|")


@dataclass(kw_only=True)
class Bandwidth:
    """bandwidth.json: directed link rates ``"src|dst" -> bytes/s`` (and optional latency).

    Also reads seed 000's ``bandwidth_matrix.json`` (a bare ``{"src|dst": bytes_per_sec}`` map).
    """

    bytes_per_sec: dict[str, float]
    latency_s: dict[str, float] = field(default_factory=dict)
    burst_bytes: dict[str, float] = field(default_factory=dict)
    """Optional, per link: bytes a link that has rested passes at once before its rate holds (a
    token bucket's depth: a shaper's burst, a NIC's offload segment). A pipeline's messages of a
    few tens of kB, each after a pause, cross such a link far faster than its rate says; 0 where
    not measured."""
    egress_bytes_per_sec: dict[str, float] = field(default_factory=dict)
    """Optional, per host: bytes/s its sends to all its peers at once get together (the probe's
    fan-out). A host whose sends share one uplink (a Pi's one Ethernet port, a Wi-Fi radio, a
    shaped interface) gets about one link's rate here, not the sum of its links'; the cost model
    then queues its concurrent sends on that uplink. Absent: every link is independent."""
    ingress_bytes_per_sec: dict[str, float] = field(default_factory=dict)
    """Optional, per host: bytes/s it receives from all its peers at once (the probe's fan-in):
    the downlink its concurrent receives share."""
    source: str = ""
    """Where the numbers came from (an iperf3 CSV, ``torchpp bandwidth probe``, an estimate)."""
    format: str = f"torchpp.{BANDWIDTH_KIND}/{BANDWIDTH_VERSION}"

    @staticmethod
    def key(src: str, dst: str) -> str:
        return f"{src}|{dst}"

    def has(self, src: str, dst: str) -> bool:
        return self.key(src, dst) in self.bytes_per_sec

    def rate(self, src: str, dst: str) -> float:
        k = self.key(src, dst)
        if k not in self.bytes_per_sec:
            raise KeyError(f"bandwidth: no link {k!r} (known: {', '.join(sorted(self.bytes_per_sec)) or 'none'})")
        return self.bytes_per_sec[k]

    def latency(self, src: str, dst: str) -> float:
        return self.latency_s.get(self.key(src, dst), 0.0)

    def burst(self, src: str, dst: str) -> float:
        return self.burst_bytes.get(self.key(src, dst), 0.0)

    def egress(self, host: str) -> float | None:
        """Bytes/s the host's sends share, or None (not measured: its links are independent)."""
        return self.egress_bytes_per_sec.get(host)

    def ingress(self, host: str) -> float | None:
        """Bytes/s the host's receives share, or None (not measured)."""
        return self.ingress_bytes_per_sec.get(host)

    @property
    def probed(self) -> bool:
        """Whether the rates are a probe's (each link's capacity), not a fit or an estimate."""
        return self.source.startswith(PROBE_SOURCE)

    def hosts(self) -> list[str]:
        return sorted({h for k in self.bytes_per_sec for h in k.split("|")})

    def missing_links(self, hosts: Iterable[str]) -> list[str]:
        """Directed links between distinct ``hosts`` that have no rate."""
        hs = list(hosts)
        return [self.key(a, b) for a in hs for b in hs if a != b and not self.has(a, b)]

    def to_json(self) -> dict[str, Any]:
        d = to_dict(self)
        for k in ("burst_bytes", "egress_bytes_per_sec", "ingress_bytes_per_sec"):
            if not d[k]:  # unmeasured: files stay as they were
                del d[k]
        return {"format": d.pop("format"), **d}

    def save(self, path: str | os.PathLike) -> Path:
        data = self.to_json()
        Bandwidth.parse(data, f"{path} (being written)")
        return write_json(path, data)

    @staticmethod
    def parse(data: Any, source: str) -> "Bandwidth":
        if isinstance(data, Mapping) and "format" not in data and data and all(_is_link_key(k) for k in data):
            data = {"format": f"torchpp.{BANDWIDTH_KIND}/{BANDWIDTH_VERSION}", "bytes_per_sec": dict(data),
                    "source": "seed bandwidth_matrix.json"}
        check_format(data, source, BANDWIDTH_KIND, [BANDWIDTH_VERSION])
        r = Reader(data, source)
        rates, lats, bursts = r.obj("bytes_per_sec"), r.obj("latency_s", {}), r.obj("burst_bytes", {})
        for sub, name, positive, top in ((rates, "bytes_per_sec", True, V.MAX_RATE),
                                         (lats, "latency_s", False, V.MAX_SECONDS),
                                         (bursts, "burst_bytes", False, V.MAX_BYTES)):
            for k in sub.data:
                try:
                    V.link_key(k, f"{name}.{k}")
                except ValueError as e:
                    raise FormatError(source, f"{name}.{k}", str(e).partition(": expected ")[2] or str(e)) from None
                sub.float(k, positive=positive, min_value=None if positive else 0.0, max_value=top)
        nics = {}
        for name in ("egress_bytes_per_sec", "ingress_bytes_per_sec"):
            sub = r.obj(name, {})
            for k in sub.data:
                try:
                    V.host_name(k, f"{name}.{k}")
                except ValueError as e:
                    raise FormatError(source, f"{name}.{k}", "a host name (a key of bytes_per_sec's links)") from e
                sub.float(k, positive=True, max_value=V.MAX_RATE)
            nics[name] = {k: float(v) for k, v in sub.data.items()}
        return Bandwidth(bytes_per_sec={k: float(v) for k, v in rates.data.items()},
                         latency_s={k: float(v) for k, v in lats.data.items()},
                         burst_bytes={k: float(v) for k, v in bursts.data.items()}, **nics,
                         source=r.str("source", ""))

    @staticmethod
    def load(path: str | os.PathLike) -> "Bandwidth":
        return _load(path, Bandwidth.parse)
