"""`torchpp bandwidth probe`: all-pairs point-to-point throughput and latency over gloo.

Run one process per host under torchrun or `torchpp cluster run` (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT in the environment). Pairs are measured one at a time, so each
measurement has the link to itself, using the same transport training uses (gloo over TCP),
so the numbers include its overheads.

Per ordered pair (src, dst): latency is half the smallest round trip of a 4-byte ping-pong;
for each message size, src sends the message and waits for dst's 4-byte acknowledgement, once
untimed (the link's bucket is then empty) and then ``repeats`` times, and throughput is the
slope of a least-squares line through (bytes, median time), matching the planner's cost model
``time = latency + bytes / rate``. Larger sizes are skipped when the rate seen so far says they
would overrun ``--pair-budget`` seconds.

Then the link's burst: after ``rest_s`` of silence, one message of ``burst_size`` bytes. A link
that passes a burst at once after a rest (a token bucket: a shaper's burst, a NIC's offload
segment) delivers it sooner than the rate says; the bytes it gained are its burst,
``size − rate · (time − round trip)`` (bandwidth.json's ``burst_bytes``; see ``cost.links``).

With three or more hosts, each host's interfaces: the host sends one message to every other
host at once (fan-out), then every other host sends one to it at once (fan-in), each message
``fan_s`` seconds at its own link's rate. Their bytes over the time the last one took are
the host's ``egress_bytes_per_sec`` and ``ingress_bytes_per_sec``: about one link's rate where
the host's sends (receives) share one interface (a Pi's Ethernet port, a Wi-Fi radio, a shaped
interface), the sum of its links' where they do not (then nothing is written: :data:`SHARED`).
Pairs measured one at a time cannot tell the two apart, and a pipeline's middle stage sends a
gradient back and an activation on at once.
"""
from __future__ import annotations

import dataclasses
import datetime
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable


@dataclass
class ProbeSettings:
    """What one probe measures, and how long it may take."""

    host: str | None = None
    """This process's host name (default: $TORCHPP_HOST, else $HOST, else the hostname)."""
    sizes: list[int] = dataclasses.field(default_factory=lambda: [64 << 10, 512 << 10, 2 << 20, 8 << 20])
    """Message sizes in bytes."""
    repeats: int = 3
    """Messages per size (the median is used)."""
    pings: int = 10
    """Ping-pongs for latency."""
    pair_budget: float = 8.0
    """Seconds per ordered pair before larger sizes are skipped."""
    timeout: float = 300.0
    """Seconds any collective may block."""
    burst_size: int = 256 << 10
    """Bytes of the message sent after a rest to measure the link's burst (0: not measured)."""
    rest_s: float = 0.3
    """Seconds of silence before each burst message (long enough for the link's bucket to refill)."""
    fan_s: float = 0.25
    """Seconds at its link's rate of each message of a host's fan-out and fan-in (0: not measured)."""
    fan_repeats: int = 2
    """Timed fan-outs and fan-ins per host (after one untimed; the median is used)."""


@dataclass
class PairResult:
    src: str
    dst: str
    bytes_per_sec: float
    latency_s: float
    points: list[tuple[int, float]]
    """(message bytes, median seconds to deliver and acknowledge)."""
    burst_bytes: float = 0.0
    """Bytes the link passed at once after a rest (:func:`burst_of`); 0 when not measured or none."""


@dataclass
class NicResult:
    """One host's interfaces: bytes/s of its sends to every other host at once, and of theirs to it."""
    host: str
    egress_bytes_per_sec: float
    ingress_bytes_per_sec: float


@dataclass
class Probed:
    """What a probe measured: every ordered pair, and each host's interfaces (empty under 3 hosts)."""
    pairs: list[PairResult]
    nics: list[NicResult]


def fan_size(rate: float, fan_s: float) -> int:
    """Bytes of one fan message on a link of ``rate`` bytes/s: ``fan_s`` seconds of it, in whole
    floats, between 64 KiB and 16 MiB (a message must outlast a link's burst, and a fast link, or
    loopback, must not copy gigabytes). Each link gets its own seconds' worth, so that on
    independent links every message of a fan ends together and the fan reads their sum."""
    return int(min(max(rate * fan_s, 64 << 10), 16 << 20)) // 4 * 4


SHARED = 0.9
"""A host's fan-out (fan-in) below this fraction of the sum of its links' rates is a shared
interface, written to bandwidth.json; above it the links are independent and nothing is written
(the cost model then queues nothing, and prices as it did without a fan)."""


def shared_nics(pairs: list[PairResult], nics: list[NicResult]) -> tuple[dict[str, float], dict[str, float]]:
    """(egress, ingress) bytes/s of the hosts whose sends (receives) share one interface."""
    out_sum: dict[str, float] = {}
    in_sum: dict[str, float] = {}
    for r in pairs:
        out_sum[r.src] = out_sum.get(r.src, 0.0) + r.bytes_per_sec
        in_sum[r.dst] = in_sum.get(r.dst, 0.0) + r.bytes_per_sec
    return ({n.host: n.egress_bytes_per_sec for n in nics if n.egress_bytes_per_sec < SHARED * out_sum.get(n.host, 0)},
            {n.host: n.ingress_bytes_per_sec for n in nics if n.ingress_bytes_per_sec < SHARED * in_sum.get(n.host, 0)})


def fit_rate(points: list[tuple[int, float]], rtt: float) -> float:
    """Bytes/s from (bytes, seconds): the slope of a least-squares line when two or more sizes
    were measured, else bytes / (time - round trip)."""
    if len(points) >= 2:
        xs, ys = [p[0] for p in points], [p[1] for p in points]
        mx, my = statistics.fmean(xs), statistics.fmean(ys)
        sxx = sum((x - mx) ** 2 for x in xs)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
        if slope > 0:
            return 1.0 / slope
    b, t = max(points)
    return b / max(t - rtt, t * 0.05)


def burst_of(size: int, rested_s: float, rate: float, rtt: float) -> float:
    """Bytes a rested link passed at once: a ``size``-byte message delivered and acknowledged in
    ``rested_s`` after a rest, on a link of ``rate`` bytes/s and round trip ``rtt``, gained
    ``size − rate · (rested_s − rtt)`` over a busy link (clamped to [0, size])."""
    return min(float(size), max(0.0, size - rate * (rested_s - rtt)))


def _measure(src: int, dst: int, rank: int, args: ProbeSettings
             ) -> tuple[float, list[tuple[int, float]], float | None]:
    """Both ends call this; only src's return value is meaningful."""
    import torch
    import torch.distributed as dist

    ping = torch.zeros(1)
    me_src = rank == src
    peer = dst if me_src else src

    def pingpong() -> float:
        return _round_trips(ping, ping, peer, me_src, 1)[0]

    pingpong()  # connection set-up
    rtt = min(pingpong() for _ in range(args.pings))
    points: list[tuple[int, float]] = []
    spent, rate_guess = 0.0, None
    ctl = torch.zeros(1, dtype=torch.int64)
    for size in args.sizes:
        if me_src:  # src decides (from what it has seen) and tells dst whether to go on
            go = rate_guess is None or spent + (args.repeats + 1) * size / rate_guess <= args.pair_budget
            ctl[0] = size if go else 0
            dist.send(ctl, peer)
        else:
            dist.recv(ctl, peer)
        if int(ctl[0]) == 0:
            break
        buf = torch.empty(size // 4, dtype=torch.float32)
        # the first message after the control exchange finds the link partly rested (its bucket refilled):
        # untimed, so that every timed one follows a busy link (with two timed repeats, their median is
        # their mean, and a rested first one read a 10 Mbit/s link 5% slow over 64 kB and 512 kB)
        times = _round_trips(buf, ping, peer, me_src, args.repeats + 1)
        spent += sum(times)
        times = times[1:]
        med = statistics.median(times)
        points.append((buf.numel() * 4, med))
        rate_guess = buf.numel() * 4 / max(med - rtt, 1e-6)
    rested = None
    if args.burst_size > 0:  # both ends know the settings: no control message needed
        buf = torch.empty(args.burst_size // 4, dtype=torch.float32)
        rested = statistics.median(_round_trips(buf, ping, peer, me_src, args.repeats, rest_s=args.rest_s))
    return rtt, points, rested


def _round_trips(buf, ping, peer: int, me_src: bool, repeats: int, rest_s: float = 0.0) -> list[float]:
    """Seconds for ``buf`` one way and ``ping`` back, ``repeats`` times (after ``rest_s`` each: a rested link)."""
    import torch.distributed as dist

    times = []
    for _ in range(repeats):
        if rest_s:
            time.sleep(rest_s)
        t0 = time.perf_counter()
        if me_src:
            dist.send(buf, peer)
            dist.recv(ping, peer)
        else:
            dist.recv(buf, peer)
            dist.send(ping, peer)
        times.append(time.perf_counter() - t0)
    return times


def _fan(hub: int, rank: int, world: int, sizes: list[int], inward: bool, repeats: int) -> float:
    """Every rank calls this; on ``hub``, the median seconds until ``sizes[i]`` bytes have crossed
    between it and its ``i``-th peer, all peers at once (``inward``: they send when the hub's go
    reaches them, so that no sender starts before the hub's clock; else it sends and each
    acknowledges), after one untimed round; 0.0 elsewhere."""
    import torch
    import torch.distributed as dist

    peers = [p for p in range(world) if p != hub]
    ping = torch.zeros(1)
    if rank == hub:
        bufs = [torch.empty(n // 4) for n in sizes]
    else:
        bufs = [torch.empty(sizes[peers.index(rank)] // 4)]
    times = []
    for i in range(repeats + 1):
        dist.barrier()
        t0 = time.perf_counter()
        if rank == hub:
            if inward:
                for p in peers:
                    dist.send(ping, p)
                for w in [dist.irecv(b, p) for b, p in zip(bufs, peers)]:
                    w.wait()
            else:
                for w in [dist.isend(b, p) for b, p in zip(bufs, peers)]:
                    w.wait()
                for p in peers:
                    dist.recv(ping, p)
            if i:
                times.append(time.perf_counter() - t0)
        elif inward:
            dist.recv(ping, hub)
            dist.send(bufs[0], hub)
        else:
            dist.recv(bufs[0], hub)
            dist.send(ping, hub)
    return statistics.median(times) if times else 0.0


def _fans(pairs: list[PairResult], hosts: list[str], rank: int, args: ProbeSettings,
          on_nic: Callable[[NicResult], None] | None) -> list[NicResult]:
    """Each host's fan-out and fan-in (every rank calls this with every pair's result); every
    rank gets every host's :class:`NicResult`."""
    from ..runtime.exchange import all_gather_json

    world = len(hosts)
    rate = {(r.src, r.dst): r.bytes_per_sec for r in pairs}
    mine = None
    for hub in range(world):
        others = [h for i, h in enumerate(hosts) if i != hub]
        got = []
        for inward in (False, True):
            sizes = [fan_size(rate[(o, hosts[hub])] if inward else rate[(hosts[hub], o)], args.fan_s) for o in others]
            got.append(sum(sizes) / max(_fan(hub, rank, world, sizes, inward, args.fan_repeats), 1e-9))
        if rank == hub:
            mine = NicResult(hosts[hub], got[0], got[1])
            if on_nic is not None:
                on_nic(mine)
    return [NicResult(**r) for r in all_gather_json(dataclasses.asdict(mine))]


def probe(args: ProbeSettings, on_pair: Callable[[PairResult], None] | None = None,
          on_nic: Callable[[NicResult], None] | None = None) -> Probed | None:
    """Measure every ordered pair, then (three hosts or more) each host's interfaces; returns the
    results on rank 0, None elsewhere.

    ``on_pair`` sees each pair this rank sent as soon as it is measured, ``on_nic`` this rank's
    host's interfaces (progress for people)."""
    import torch.distributed as dist

    from ..hostname import host_name
    from ..runtime.exchange import all_gather_json

    rank, world = dist.get_rank(), dist.get_world_size()
    host = host_name(args.host)
    hosts = [str(h) for h in all_gather_json(host)]
    if len(set(hosts)) < world:  # several processes named alike (torchrun --nproc-per-node > 1, no TORCHPP_HOST)
        hosts = [f"{h}-r{r}" for r, h in enumerate(hosts)]
    mine: list[PairResult] = []
    for src in range(world):
        for dst in range(world):
            if src == dst:
                continue
            if rank in (src, dst):
                rtt, points, rested = _measure(src, dst, rank, args)
                if rank == src:
                    rate = fit_rate(points, rtt)
                    burst = 0.0 if rested is None else burst_of(args.burst_size // 4 * 4, rested, rate, rtt)
                    res = PairResult(hosts[src], hosts[dst], rate, rtt / 2, points, burst)
                    mine.append(res)
                    if on_pair is not None:
                        on_pair(res)
            dist.barrier()
    gathered = all_gather_json([dataclasses.asdict(r) for r in mine])
    results = [PairResult(src=r["src"], dst=r["dst"], bytes_per_sec=float(r["bytes_per_sec"]),
                          latency_s=float(r["latency_s"]), points=[(int(b), float(t)) for b, t in r["points"]],
                          burst_bytes=float(r["burst_bytes"]))
               for part in gathered for r in part]
    nics = _fans(results, hosts, rank, args, on_nic) if world >= 3 and args.fan_s > 0 else []
    return Probed(results, nics) if rank == 0 else None


def write(probed: Probed, out_dir: Path, csv_name: str, json_name: str, sizes: list[int]) -> None:
    from ..formats import Bandwidth
    from ..formats.bandwidth import PROBE_SOURCE
    out_dir.mkdir(parents=True, exist_ok=True)
    results = probed.pairs
    egress, ingress = shared_nics(results, probed.nics)
    lines = [f"{r.src},{r.dst},{r.bytes_per_sec * 8 / 1e9:.6f}" for r in results]
    (out_dir / csv_name).write_text("\n".join(lines) + "\n")
    bw = Bandwidth(bytes_per_sec={Bandwidth.key(r.src, r.dst): r.bytes_per_sec for r in results},
                   latency_s={Bandwidth.key(r.src, r.dst): r.latency_s for r in results},
                   burst_bytes={Bandwidth.key(r.src, r.dst): r.burst_bytes for r in results if r.burst_bytes > 0},
                   egress_bytes_per_sec=egress, ingress_bytes_per_sec=ingress,
                   source=f"{PROBE_SOURCE} (gloo p2p, sizes {','.join(str(s) for s in sizes)} bytes)")
    bw.save(out_dir / json_name)


def run(args: ProbeSettings, on_pair: Callable[[PairResult], None] | None = None,
        on_nic: Callable[[NicResult], None] | None = None) -> Probed | None:
    """Join the world from the environment (torchrun's variables), probe, leave; rank 0's results.

    Raises ``UsageError`` (before any collective) when the environment or settings cannot work."""
    import torch.distributed as dist

    from ..errors import UsageError
    missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
    if missing:
        raise UsageError(f"needs {', '.join(missing)} in the environment: run under torchrun or "
                         f"`torchpp cluster run -- torchpp bandwidth probe`")
    if int(os.environ["WORLD_SIZE"]) < 2:
        raise UsageError("WORLD_SIZE: expected at least 2 processes to measure a link")
    if args.repeats < 1 or args.pings < 1 or args.fan_repeats < 1:
        raise UsageError("--repeats, --pings and --fan-repeats: expected at least 1")
    if not 0 <= args.fan_s <= 60:
        raise UsageError(f"--fan-seconds: expected 0 to 60 seconds, got {args.fan_s}")
    from ..hostname import host_name
    try:
        host_name(args.host)  # a bad --host or TORCHPP_HOST/HOST stops this rank before any collective
    except ValueError as e:
        raise UsageError(str(e)) from None
    from ..runtime.rendezvous import RendezvousError, env_store

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = datetime.timedelta(seconds=args.timeout)
    try:
        store = env_store(rank, world, timeout)  # rank 0 listens on MASTER_ADDR only
    except RendezvousError as e:
        raise UsageError(str(e)) from None
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    try:
        return probe(args, on_pair, on_nic)
    finally:
        dist.destroy_process_group()
