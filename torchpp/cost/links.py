"""Link rates and latencies between hosts: the one price of a transfer and of a ring all-reduce.

A link may also pass a burst at once (bandwidth.json's ``burst_bytes``): a token bucket of that
many bytes, refilled at the link's rate. :meth:`Links.time` is a transfer on a busy link (the
bucket empty: what the probe's back-to-back messages measure); :meth:`Links.burst_s` says how
much of a transfer a rested link takes off, which the simulator's FIFO links apply from each
link's own history, and the closed forms below (all-reduces, which start on links that rested
while the step's compute ran) take off once.
"""
from __future__ import annotations

from typing import Callable, Iterable, Sequence

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

    def burst_s(self, src: str, dst: str, nbytes: float) -> tuple[float, float]:
        """(the link's bucket in seconds of its rate, the seconds a full bucket takes off a transfer of
        ``nbytes`` on the wire): (0, 0) where no burst was measured."""
        b = self.bw.burst(src, dst) if src != dst and self.bw.has(src, dst) else 0.0
        if b <= 0:
            return 0.0, 0.0
        r = self.bw.rate(src, dst)
        return b / r, min(b, nbytes) / r

    def rested_time(self, src: str, dst: str, nbytes: float) -> float:
        """:meth:`time` of a transfer that finds the link rested (its bucket full)."""
        return self.time(src, dst, nbytes) - self.burst_s(src, dst, nbytes)[1]

    @property
    def shares_nics(self) -> bool:
        """Whether some host's concurrent sends or receives share one interface (the probe's fan-out
        and fan-in rates, bandwidth.json's ``egress_bytes_per_sec`` / ``ingress_bytes_per_sec``)."""
        return bool(self.bw.egress_bytes_per_sec or self.bw.ingress_bytes_per_sec)

    def nic_s(self, src: str, dst: str, nbytes: float) -> tuple[float, float]:
        """(seconds ``nbytes`` on the wire hold the sender's uplink, the receiver's downlink): each host's
        measured fan-out / fan-in rate, 0 where not measured or within one host. The simulator's
        links queue a host's transfers on its interfaces by these (``sim.links``): a host whose
        uplink is one link's rate sends to two peers one after the other, not both at once."""
        if src == dst:
            return 0.0, 0.0
        up, down = self.bw.egress(src), self.bw.ingress(dst)
        return (0.0 if up is None else nbytes / up), (0.0 if down is None else nbytes / down)

    def wire_time(self, src: str, dst: str, nbytes: float, fmt: str | None = None, row: int = 1,
                  codec: tuple[float, float] = (0.0, 0.0)) -> float:
        """``nbytes`` of fp32 data sent as wire format ``fmt`` (rows of ``row`` elements): the bytes on the
        wire over the link, plus the sender's encode and the receiver's decode CPU, ``codec`` =
        (encode, decode) seconds per fp32 byte as ``torchpp profile`` measured them on each host."""
        if fmt in (None, "fp32"):
            return self.time(src, dst, nbytes)
        return self.time(src, dst, nbytes * wire_ratio(fmt, row)) + nbytes * (codec[0] + codec[1])

    def ring_allreduce(self, hosts: Sequence[str], nbytes: float) -> float:
        """Ring all-reduce: ``2(k−1)/k · bytes / slowest link`` plus 2(k−1) worst latencies, less what the
        smallest burst of its links passes at once (it starts on rested links: every link of the
        ring sends its first bytes without waiting)."""
        k = len(hosts)
        if k <= 1 or nbytes <= 0:
            return 0.0
        return self._ring(hosts, 2 * (k - 1) / k * nbytes, 2 * (k - 1))

    def tree_broadcast(self, hosts: Sequence[str], root: int, nbytes: float) -> float:
        """A broadcast of ``nbytes`` from ``hosts[root]`` to the rest of ``hosts`` (a process group's
        members in its rank order) as gloo runs it, until the last member has it: a binomial tree
        in ranks relative to the root, where in round ``i`` every member below ``2^i`` that holds
        the buffer sends it on to the member ``2^i`` above it (its sends leave together, each on
        its own link; a member forwards once its own copy has arrived). Each hop finds its link
        rested, as the all-reduces' closed forms assume."""
        k = len(hosts)
        if k <= 1 or nbytes <= 0:
            return 0.0
        at = [0.0] * k  # by rank relative to the root
        step = 1
        while step < k:
            for v in range(min(step, k - step)):
                at[v + step] = at[v] + self.rested_time(hosts[(v + root) % k], hosts[(v + step + root) % k], nbytes)
            step *= 2
        return max(at)

    def ring_allgather(self, hosts: Sequence[str], nbytes: float, skewed: bool = False) -> float:
        """All-gather of every member's ``nbytes`` (what an int8 sync sends: each member's codes, summed
        by every member) as gloo runs it, in halves: ``(k−1) · bytes / slowest link`` plus 2(k−1)
        worst latencies, less the burst as for :meth:`ring_allreduce`; for two members that
        arrive apart (``skewed``), 1.5 bytes / rate.

        Two members: gloo's all-gather sends each member's buffer in two halves, each posted as a
        send and then a receive, and a send waits for the peer's notice that its receive is posted.
        The member that arrives last (in a pipeline the first stage, whose backward ends last)
        finds its peer's notices waiting and sends both halves at once; its own notices follow
        each half on the same in-order connection, so the peer's second half leaves only when
        this member's whole buffer has arrived. Measured on the 10 Mbit/s cluster: the last
        stage had the first stage's 1.06 MB after 0.87 s, the first stage the last's after
        1.35 s (1.5 × 0.89 s). Members that arrive together send their notices first and both
        buffers cross at once."""
        k = len(hosts)
        if k <= 1 or nbytes <= 0:
            return 0.0
        if k == 2 and skewed:
            return self._ring(hosts, 1.5 * nbytes, 2, burst_cap=nbytes)
        return self._ring(hosts, (k - 1) * nbytes, 2 * (k - 1))

    def _ring(self, hosts: Sequence[str], per_link: float, hops: int, burst_cap: float | None = None) -> float:
        """``per_link`` bytes over every link of the ring at the slowest link's rate, ``hops`` worst
        latencies, less the smallest burst (capped by ``per_link``, or ``burst_cap``)."""
        pairs = [(a, b) for a in hosts for b in hosts if a != b]
        if not pairs:
            return 0.0
        for a, b in pairs:
            if not self.bw.has(a, b):
                raise FormatError(self.source, f"bytes_per_sec.{Bandwidth.key(a, b)}", "a link rate (bytes/s)")
        slow = min(self.bw.rate(a, b) for a, b in pairs)
        lat = max(self.bw.latency(a, b) for a, b in pairs)
        burst = min(self.bw.burst(a, b) for a, b in pairs)
        return (per_link - min(burst, per_link if burst_cap is None else burst_cap)) / slow + hops * lat


class FormatLinks(Links):
    """``links`` on which every point-to-point transfer is sent as wire format ``fmt``: what a plan whose
    every pipeline link carries ``fmt`` pays, for a search that prices plans without wire fields
    (the planner's search under a lossy format). :meth:`time` is :meth:`Links.wire_time` of the
    fp32 bytes (``row``: elements per row, the hidden size; ``codec(src, dst)``: the sender's encode
    and the receiver's decode seconds per fp32 byte, ``Profiles.link_codec``), :meth:`burst_s` that
    of the bytes on the wire, as ``MeasuredCost`` prices a link whose ``wire`` is ``fmt``. The
    all-reduces and the tied rows stay as ``links`` prices them: a group's sync is not a pipeline link."""

    def __init__(self, links: Links, fmt: str, row: int, codec: Callable[[str, str], tuple[float, float]]):
        super().__init__(links.bw, f"{links.source} (as {fmt})")
        self.base, self.fmt, self.row, self.codec = links, fmt, row, codec

    def check(self, hosts: Iterable[str]) -> None:
        self.base.check(hosts)

    def time(self, src: str, dst: str, nbytes: float) -> float:
        return self.base.wire_time(src, dst, nbytes, self.fmt, self.row, self.codec(src, dst))

    def burst_s(self, src: str, dst: str, nbytes: float) -> tuple[float, float]:
        return self.base.burst_s(src, dst, nbytes * wire_ratio(self.fmt, self.row))

    def rested_time(self, src: str, dst: str, nbytes: float) -> float:
        return self.base.rested_time(src, dst, nbytes)

    def nic_s(self, src: str, dst: str, nbytes: float) -> tuple[float, float]:
        return self.base.nic_s(src, dst, nbytes * wire_ratio(self.fmt, self.row))

    def wire_time(self, src: str, dst: str, nbytes: float, fmt: str | None = None, row: int = 1,
                  codec: tuple[float, float] = (0.0, 0.0)) -> float:
        raise ValueError(f"FormatLinks prices every transfer as {self.fmt}: a plan priced on it carries no wire "
                         f"fields (got {fmt!r})")

    def ring_allreduce(self, hosts: Sequence[str], nbytes: float) -> float:
        return self.base.ring_allreduce(hosts, nbytes)

    def ring_allgather(self, hosts: Sequence[str], nbytes: float, skewed: bool = False) -> float:
        return self.base.ring_allgather(hosts, nbytes, skewed)


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

    def ring_allgather(self, hosts: Sequence[str], nbytes: float, skewed: bool = False) -> float:
        return 0.0

    def burst_s(self, src: str, dst: str, nbytes: float) -> tuple[float, float]:
        return 0.0, 0.0
