"""Routes over a topology and the resources they use.

Every direction of a link is a resource of its own (links are full duplex) except on a shared
medium, whose links in both directions are one resource. A route is a shortest path in hops
on which hosts do not forward (a transfer between two hosts goes through switches, or over a
direct link); among equally short paths each pair takes one picked by a hash of the pair, as
ECMP spreads flows (so rail and two-tier fabrics spread traffic over their spines).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from .graph import Topology


@dataclass(frozen=True, slots=True)
class Route:
    resources: tuple[int, ...]
    latency_s: float


def _pick(a: int, b: int, step: int, n: int) -> int:
    return (a * 1000003 + b * 9176 + step * 131) % n


class Network:
    """Resources (capacity in bytes/s) of a topology and the route between any two hosts."""

    def __init__(self, topology: Topology):
        t = self.topology = topology
        self.hosts = t.hosts
        media = sorted(t.media)
        base = 2 * len(t.links)
        medium_res = {m: base + i for i, m in enumerate(media)}
        self.capacity: list[float] = []
        self.latency: list[float] = []
        self.adj: list[list[tuple[int, int, float]]] = [[] for _ in range(t.num_nodes)]
        """Per node: (neighbour, resource towards it, latency)."""
        self.towards: list[dict[int, tuple[int, float]]] = [{} for _ in range(t.num_nodes)]
        """Per node: neighbour -> (resource towards it, latency) of the first link between them."""
        for i, ln in enumerate(t.links):
            for d, (u, v) in enumerate(((ln.src, ln.dst), (ln.dst, ln.src))):
                res = medium_res[ln.medium] if ln.medium is not None else 2 * i + d
                self.capacity.append(ln.bytes_per_s)
                self.adj[u].append((v, res, ln.latency_s))
                self.towards[u].setdefault(v, (res, ln.latency_s))
        self.capacity += [t.media[m] * 1e9 / 8 for m in media]
        self.names = [f"{ln.src}->{ln.dst}" if d == 0 else f"{ln.dst}->{ln.src}" for ln in t.links for d in (0, 1)]
        self.names += [f"medium {m}" for m in media]
        self._is_host = [n < t.hosts for n in range(t.num_nodes)]
        self._dist: dict[int, dict[int, int]] = {}
        self._routes: dict[tuple[int, int], Route] = {}

    def _bfs(self, s: int) -> dict[int, int]:
        """Hop distances from switch ``s`` over switches only (cached)."""
        d = self._dist.get(s)
        if d is None:
            d = {s: 0}
            q = deque([s])
            adj, is_host = self.adj, self._is_host
            while q:
                u = q.popleft()
                du = d[u] + 1
                for v, _r, _l in adj[u]:
                    if not is_host[v] and v not in d:
                        d[v] = du
                        q.append(v)
            self._dist[s] = d
        return d

    def route(self, a: int, b: int) -> Route:
        """The resources a transfer from host ``a`` to host ``b`` crosses (none for a == b)."""
        if a == b:
            return Route((), 0.0)
        key = (a, b)
        r = self._routes.get(key)
        if r is None:
            r = self._routes[key] = self._find(a, b)
        return r

    def _find(self, a: int, b: int) -> Route:
        direct = [(res, lat) for v, res, lat in self.adj[a] if v == b]
        if direct:
            res, lat = direct[_pick(a, b, 0, len(direct))]
            return Route((res,), lat)
        best, choices = None, []
        into_b = {v: self.towards[v][b] for v in self.towards[b] if not self._is_host[v]}
        for s1, res1, lat1 in self.adj[a]:
            if self._is_host[s1]:
                continue
            dist = self._bfs(s1)
            for s2 in into_b:
                h = dist.get(s2)
                if h is not None and (best is None or h < best):
                    best, choices = h, [(s1, res1, lat1, s2)]
                elif h is not None and h == best:
                    choices.append((s1, res1, lat1, s2))
        if best is None:
            raise ValueError(f"topology {self.topology.name}: no route from host {a} to host {b}")
        s1, res1, lat1, s2 = choices[_pick(a, b, 0, len(choices))]
        back = self._walk_back(a, b, s1, s2)
        res_b, lat_b = into_b[s2]
        resources = (res1, *[x[0] for x in back], res_b)
        return Route(resources, lat1 + sum(x[1] for x in back) + lat_b)

    def _walk_back(self, a: int, b: int, s1: int, s2: int) -> list[tuple[int, float]]:
        """Switch-to-switch hops from ``s1`` to ``s2`` (an ECMP pick at every fork)."""
        dist = self._bfs(s1)
        out, node, step = [], s2, 1
        while node != s1:
            dn = dist[node]
            preds = [u for u in self.towards[node] if dist.get(u, -2) == dn - 1 and not self._is_host[u]]
            u = preds[_pick(a, b, step, len(preds))]
            res, lat = self.towards[u][node]
            out.append((res, lat))
            node, step = u, step + 1
        out.reverse()
        return out

    def rate(self, a: int, b: int) -> float:
        """Bytes/s a lone transfer from ``a`` to ``b`` gets: its route's narrowest resource."""
        r = self.route(a, b)
        if not r.resources:
            return float("inf")
        from collections import Counter

        return min(self.capacity[x] / k for x, k in Counter(r.resources).items())
