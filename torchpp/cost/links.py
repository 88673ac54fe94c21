"""Link rates and latencies between hosts: the one price of a transfer and of a ring all-reduce."""
from __future__ import annotations

from typing import Iterable, Sequence

from ..formats import Bandwidth, FormatError, wire_ratio


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

    def wire_time(self, src: str, dst: str, nbytes: float, fmt: str | None = None, row: int = 1,
                  codec: tuple[float, float] = (0.0, 0.0)) -> float:
        """``nbytes`` of fp32 data sent as wire format ``fmt`` (rows of ``row`` elements): the bytes on the
        wire over the link, plus the sender's encode and the receiver's decode CPU, ``codec`` =
        (encode, decode) seconds per fp32 byte as ``torchpp profile`` measured them on each host."""
        if fmt in (None, "fp32"):
            return self.time(src, dst, nbytes)
        return self.time(src, dst, nbytes * wire_ratio(fmt, row)) + nbytes * (codec[0] + codec[1])

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


class FreeLinks(Links):
    """Links on which every transfer and all-reduce takes no time: what a plan would cost with
    communication taken out (the gap to the lower bound attributes the difference to it)."""

    def __init__(self) -> None:
        super().__init__(Bandwidth(bytes_per_sec={}), "no communication")

    def check(self, hosts: Iterable[str]) -> None:
        return None

    def time(self, src: str, dst: str, nbytes: float) -> float:
        return 0.0

    def wire_time(self, src: str, dst: str, nbytes: float, fmt: str | None = None, row: int = 1,
                  codec: tuple[float, float] = (0.0, 0.0)) -> float:
        return 0.0

    def ring_allreduce(self, hosts: Sequence[str], nbytes: float) -> float:
        return 0.0
