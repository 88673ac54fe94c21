"""devices.json: each host's memory, address and rank."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from .. import validate as V
from .base import FormatError, Reader, _load, write_json


@dataclass(kw_only=True)
class DeviceInfo:
    host: str
    memory_bytes: int
    address: str = ""
    rank: int | None = None


@dataclass(kw_only=True)
class Devices:
    """devices.json: ``{"host": memory_gb}`` (seed 000) or ``{"host": {"memory_gb", "address", "rank"}}``."""

    devices: dict[str, DeviceInfo]

    @property
    def hosts(self) -> list[str]:
        return list(self.devices)

    def memory_bytes(self, host: str) -> int:
        return self.devices[host].memory_bytes

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for h, d in self.devices.items():
            e: dict[str, Any] = {"memory_gb": d.memory_bytes / GB}
            if d.address:
                e["address"] = d.address
            if d.rank is not None:
                e["rank"] = d.rank
            out[h] = e
        return out

    def save(self, path: str | os.PathLike) -> Path:
        return write_json(path, self.to_json())

    @staticmethod
    def parse(data: Any, source: str) -> "Devices":
        r = Reader(data, source)
        out: dict[str, DeviceInfo] = {}
        for h, v in r.data.items():
            if h == "format":
                continue
            if isinstance(v, Mapping):
                dr = r.obj(h)
                _device_host(source, h)
                gb = dr.float("memory_gb", positive=True, max_value=V.MAX_MEMORY_GB)
                rank = dr.int("rank", None, min_value=0)
                out[h] = DeviceInfo(host=h, memory_bytes=int(gb * GB), address=dr.str("address", ""), rank=rank)
            else:
                _device_host(source, h)
                out[h] = DeviceInfo(host=h, memory_bytes=int(r.float(h, positive=True, max_value=V.MAX_MEMORY_GB) * GB))
        if not out:
            raise FormatError(source, "<root>", "at least one host")
        for d in out.values():  # one rank per host: a rank beyond them could never be used
            if d.rank is not None and d.rank >= len(out):
                raise FormatError(source, f"{d.host}.rank", f"a rank in 0..{len(out) - 1} (one per host of the file)",
                                  d.rank)
        ranks = [d.rank for d in out.values() if d.rank is not None]
        if len(set(ranks)) != len(ranks):
            raise FormatError(source, "*.rank", "distinct ranks", sorted(ranks))
        return Devices(devices=out)

    @staticmethod
    def load(path: str | os.PathLike) -> "Devices":
        return _load(path, Devices.parse)


GB = 1 << 30
"""devices.json counts memory in GiB (seed 000's ``"cpu1": 24``)."""


def _device_host(source: str, h: str) -> str:
    """A host named by a key (devices.json, capacities.json): safe in file names and link keys."""
    try:
        return V.host_name(h, h)
    except ValueError:
        raise FormatError(source, h, "a host name of letters, digits, '.', '_' or '-' (no '..')") from None


