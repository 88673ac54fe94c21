"""Collectives on a topology, each a bundle of flows priced with contention.

A ring all-reduce over ``n`` hosts sends ``2(n−1)`` chunks of ``bytes/n`` from every host to
the next one: ``n`` flows of ``2(n−1)/n · bytes`` that advance together (each step waits for
the slowest), plus ``2(n−1)`` route latencies. All-gather and reduce-scatter are half of it
(``(n−1)/n · bytes``, ``n−1`` latencies; ``bytes`` is the full buffer). A tree all-reduce is a
pipelined binary tree (host ``i``'s parent is host ``(i−1)//2`` of the list): every edge
carries the whole buffer up (reduce) and down (broadcast) at once, plus ``2·depth`` latencies.

On a star of rate ``bw``: ring all-reduce ``2(n−1)/n · bytes/bw``; tree all-reduce
``c · bytes/bw`` with ``c`` = 1 (n = 2), 2 (n = 3, 4), 3 (n ≥ 5: an inner node sends to its
parent and two children). :func:`simultaneous` prices bundles that start together.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from .fairshare import maxmin
from .routes import Network

ALGORITHMS = ("ring", "tree")


@dataclass
class Bundle:
    volume: float
    """Bytes each flow carries."""
    usage: dict[int, float] = field(default_factory=dict)
    """Resource -> flows of the bundle crossing it."""
    latency_s: float = 0.0

    def add(self, route_resources: Sequence[int], times: float = 1.0) -> None:
        for r in route_resources:
            self.usage[r] = self.usage.get(r, 0.0) + times


def transfer(net: Network, a: int, b: int, nbytes: float) -> Bundle:
    r = net.route(a, b)
    out = Bundle(nbytes, latency_s=r.latency_s)
    out.add(r.resources)
    return out


def _ring(net: Network, hosts: Sequence[int], volume: float, steps: int) -> Bundle:
    n = len(hosts)
    out = Bundle(volume)
    lat = 0.0
    for i in range(n):
        r = net.route(hosts[i], hosts[(i + 1) % n])
        out.add(r.resources)
        lat = max(lat, r.latency_s)
    out.latency_s = steps * lat
    return out


def allreduce(net: Network, hosts: Sequence[int], nbytes: float, algorithm: str = "ring") -> Bundle:
    n = len(hosts)
    if n <= 1 or nbytes <= 0:
        return Bundle(0.0)
    if algorithm == "ring":
        return _ring(net, hosts, 2 * (n - 1) / n * nbytes, 2 * (n - 1))
    if algorithm == "tree":
        return _tree(net, hosts, nbytes)
    raise ValueError(f"all-reduce algorithm: expected one of {', '.join(ALGORITHMS)}, got {algorithm!r}")


def allgather(net: Network, hosts: Sequence[int], nbytes: float) -> Bundle:
    """Ring all-gather of a ``nbytes`` result (each host contributes ``nbytes/n``)."""
    n = len(hosts)
    return Bundle(0.0) if n <= 1 or nbytes <= 0 else _ring(net, hosts, (n - 1) / n * nbytes, n - 1)


def reduce_scatter(net: Network, hosts: Sequence[int], nbytes: float) -> Bundle:
    """Ring reduce-scatter of a ``nbytes`` input (each host keeps ``nbytes/n``)."""
    return allgather(net, hosts, nbytes)


def _tree(net: Network, hosts: Sequence[int], nbytes: float) -> Bundle:
    out = Bundle(nbytes)
    lat, depth = 0.0, 0
    for i in range(1, len(hosts)):
        p = (i - 1) // 2
        up, down = net.route(hosts[i], hosts[p]), net.route(hosts[p], hosts[i])
        out.add(up.resources)
        out.add(down.resources)
        lat = max(lat, up.latency_s, down.latency_s)
        depth = max(depth, (i + 1).bit_length() - 1)
    out.latency_s = 2 * depth * lat
    return out


def merged(bundles: Sequence[Bundle]) -> Bundle:
    """Identical bundles running in lockstep as one (their usage summed): aggregation."""
    out = Bundle(bundles[0].volume, latency_s=max(b.latency_s for b in bundles))
    for b in bundles:
        for r, c in b.usage.items():
            out.usage[r] = out.usage.get(r, 0.0) + c
    return out


def alone(net: Network, b: Bundle) -> float:
    """Seconds of one bundle on an idle network."""
    return simultaneous(net, [b])[0]


def simultaneous(net: Network, bundles: Sequence[Bundle]) -> list[float]:
    """Seconds until each bundle finishes when all start at 0 and share the network fairly.

    A bundle holds its share until its latency has passed too (as :mod:`torchpp.sim.topology`)."""
    usage = [sorted(b.usage.items()) for b in bundles]
    rem = [b.volume for b in bundles]
    tail = [b.latency_s for b in bundles]
    done = [0.0] * len(bundles)
    active = {i for i, b in enumerate(bundles)}
    now = 0.0
    while active:
        rate = maxmin(active, usage, net.capacity)
        fin = {i: now + (rem[i] / rate[i] if rate[i] > 0 else float("inf")) + tail[i] for i in active}
        i0 = min(fin, key=fin.get)
        t = fin[i0]
        for i in active:
            _advance(i, t - now, rate[i], rem, tail)
        now = t
        for i in [i for i in active if fin[i] <= t * (1 + 1e-12)]:
            active.discard(i)
            done[i] = now
    return done


def _advance(i: int, dt: float, rate: float, rem: list[float], tail: list[float]) -> None:
    flow = rem[i] / rate if rate > 0 else float("inf")
    if dt <= flow:
        rem[i] -= rate * dt
    else:
        rem[i] = 0.0
        tail[i] = max(0.0, tail[i] - (dt - flow))


def narrowest(net: Network, b: Bundle) -> float:
    """Rate of a lone bundle: min over its resources of capacity / flows crossing it."""
    return min((net.capacity[r] / c for r, c in b.usage.items()), default=float("inf"))


__all__ = ["ALGORITHMS", "Bundle", "allgather", "allreduce", "alone", "merged", "narrowest",
           "reduce_scatter", "simultaneous", "transfer"]
