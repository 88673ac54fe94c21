"""The vectorised stage DP for many devices: one state per (group start, first layer), float32
tables kept across micro-batch sizes."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from ..cost import Links
from .allocate import waterfill
from .dp import suffix_in_flight
from .tables import StageCosts, Tables
from .types import StageChoice

def dp_order_fast(order: Sequence[int], sc: StageCosts, max_stages: int, max_group: int,
                  shared: dict | None = None) -> dict[int, tuple[float, list[StageChoice]]]:
    """Vectorised DP for one order when there are too many devices to try every order.

    State (j, a, c): the suffix's head group starts at position a of the order and its layers
    at cut c. The transfer to the next group is priced on the slowest link between the group
    and the next group's first device (the next group's extent is not part of the state), and
    the 1F1B in-flight count is rounded up to a power of two for the memory check.
    """
    return _FastDP(order, sc, max_group, shared if shared is not None else {}).solve(max_stages)


f32 = np.float32


def _order_tables(order: Sequence[int], t: Tables, max_group: int) -> dict:
    """What the fast DP needs of one device order whatever the micro-batch size (kept across calls):
    prefix sums of 1/τ over the order, the groups' all-reduce and next-link coefficients, each
    device's memory left for activations and its 1/τ per byte of it."""
    sh: dict = {}
    N, L1 = len(order), t.L + 1
    INV = {v: np.stack([1.0 / t.tau[(h, v)] for h in order]).astype(f32) for v in (0, 1)}  # (N, L1, L1)
    sh["CINV"] = {v: np.concatenate([np.zeros((1, L1, L1), f32),
                                     np.cumsum(INV[v], axis=0, dtype=np.float64).astype(f32)]) for v in (0, 1)}
    sh["INV"] = INV
    sh["links"] = _group_links([t.hosts[h] for h in order], t.pb.links, min(max_group, N))
    AVAIL = np.stack([np.maximum(t.pb.budget[t.hosts[h]] - t.static, 0.0) for h in order]).astype(f32)
    sh["AVAIL"] = AVAIL
    with np.errstate(divide="ignore", invalid="ignore"):
        sh["RATIO"] = {v: INV[v] / AVAIL for v in (0, 1)}              # inf where a device holds nothing
    sh["win"] = {}
    return sh


def _group_links(names: Sequence[str], links: Links, Kmax: int) -> tuple[np.ndarray, ...]:
    """All-reduce coefficients and links to the next position, per group (a, k) of ``names``:
    (all-reduce latency, all-reduce seconds per byte, next-link latency, next-link seconds per byte)."""
    N = len(names)
    ar_unit, ar_lat = np.zeros((Kmax + 1, N)), np.zeros((Kmax + 1, N))
    nx_byte, nx_lat = np.zeros((Kmax + 1, N)), np.zeros((Kmax + 1, N))
    pair: dict[tuple[str, str], tuple[float, float]] = {}  # (latency, seconds per byte + latency) of a link

    def link(x: str, y: str) -> tuple[float, float]:
        got = pair.get((x, y))
        if got is None:
            got = pair[(x, y)] = (links.time(x, y, 0.0), links.time(x, y, 1.0))
        return got

    for k in range(1, Kmax + 1):
        for a in range(N - k + 1):
            g = names[a:a + k]
            if k > 1:
                lat = links.ring_allreduce(g, 0.0)
                ar_lat[k, a], ar_unit[k, a] = lat, links.ring_allreduce(g, 1.0) - lat
            if a + k < N:
                d = names[a + k]
                pb_, lt = 0.0, 0.0
                for s in g:
                    for x, y in ((s, d), (d, s)):
                        l0, l1 = link(x, y)
                        pb_, lt = max(pb_, l1 - l0), max(lt, l0)
                nx_byte[k, a], nx_lat[k, a] = pb_, lt
    return tuple(x.astype(f32) for x in (ar_lat, ar_unit, nx_lat, nx_byte))


class _FastDP:
    """One run of :func:`dp_order_fast`: its per-order tables, its per-micro-batch-size caches and
    the stage-cost matrices of groups order[a:a+k] for every a."""

    def __init__(self, order: Sequence[int], sc: StageCosts, max_group: int, shared: dict):
        # float32 halves the memory traffic of this search; the chosen plans are re-checked in float64.
        # Everything that does not depend on the micro-batch size is kept in ``shared`` across calls.
        t = sc.t
        self.t, self.m, self.b, self.rec = t, sc.m, sc.b, sc.rec
        self.L, self.N = t.L, len(order)
        self.K = min(max_group, self.N, self.b)
        if not shared:
            shared.update(_order_tables(order, t, max_group))
        self.sh = shared
        self.INV, self.CINV, self.AVAIL, self.RATIO = shared["INV"], shared["CINV"], shared["AVAIL"], shared["RATIO"]
        self.win: dict[tuple[int, int], tuple[np.ndarray, ...]] = shared["win"]
        if "FIX" not in shared:
            shared["FIX"] = {1: np.stack([t.tau0[(h, 0)] for h in order]).astype(f32)}  # (N, L1, L1) s per call
        self.fix_win: dict[int, np.ndarray] = shared["FIX"]
        self.btt: dict[tuple[int, int], np.ndarray] = {}
        self.cost_cache: dict[tuple[int, int, bool], np.ndarray] = {}
        self.W32 = t.W.astype(f32)
        self.out32 = (t.out_bytes * self.b).astype(f32)
        self.ps_cache: dict[tuple[int, int], np.ndarray] = {}

    def window(self, k: int, v: int):
        """Per group order[a:a+k]: Σ 1/τ (time = b / it), max INV/avail, min and sum of avail."""
        win = self.win
        if (k, v) not in win:
            A = self.N - k + 1
            speed = self.CINV[v][k:k + A] - self.CINV[v][0:A]
            RATIO, AVAIL = self.RATIO, self.AVAIL
            if k == 1:
                rmax, amin, asum = RATIO[v][:A], AVAIL[:A], AVAIL[:A]
            else:
                _, r0, m0, s0 = self.window(k - 1, v)
                rmax = np.maximum(r0[:A], RATIO[v][k - 1:k - 1 + A])
                amin = np.minimum(m0[:A], AVAIL[k - 1:k - 1 + A])
                asum = s0[:A] + AVAIL[k - 1:k - 1 + A]
            win[(k, v)] = (speed, rmax, amin, asum)
        return win[(k, v)]

    def fixed_max(self, k: int) -> np.ndarray:
        """Per group order[a:a+k]: the slowest member's seconds per call."""
        if k not in self.fix_win:
            prev = self.fixed_max(k - 1)
            self.fix_win[k] = np.maximum(prev[:self.N - k + 1], self.fix_win[1][k - 1:])
        return self.fix_win[k]

    def times(self, k: int, v: int) -> np.ndarray:
        """Unconstrained group time b / Σ 1/τ for this micro-batch size."""
        if (k, v) not in self.btt:
            with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
                self.btt[(k, v)] = f32(self.b) / self.window(k, v)[0]
        return self.btt[(k, v)]

    def per_sample32(self, v: int, n: int, w: int = 0) -> np.ndarray:
        if (v, n, w) not in self.ps_cache:
            self.ps_cache[(v, n, w)] = self.t.per_sample(v, n, w).astype(f32)
        return self.ps_cache[(v, n, w)]

    def fill(self, v: int, k: int, P: np.ndarray, ia, ic, ic2) -> np.ndarray:
        """Water-fill the entries (ia, ic, ic2) of groups order[a:a+k] whose proportional share overflows."""
        tau_g = np.stack([1.0 / self.INV[v][ia + d, ic, ic2] for d in range(k)])
        cap_g = np.stack([self.AVAIL[ia + d, ic, ic2] / P[ic, ic2] for d in range(k)])
        return waterfill(self.b, tau_g, cap_g)

    def cost(self, k: int, n: int, last: bool, w: int = 0) -> np.ndarray:
        """(N−k+1, L1, L1) stage cost of groups order[a:a+k] for every a (last stage: column L only)."""
        key = (k, n, last, w)
        if key in self.cost_cache:
            return self.cost_cache[key]
        A, c0 = self.N - k + 1, (self.L if last else 0)
        ar_lat, ar_unit, nx_lat, nx_byte = self.sh["links"]
        valid = self.t.valid[None, :, c0:]
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            best = self._compute_time(k, n, c0, w) + self.fixed_max(k)[:, :, c0:]  # per call: the slowest member's
            ar = (ar_lat[k, :A, None, None] + ar_unit[k, :A, None, None] * self.W32[None, :, c0:]) / self.m
            if last:
                out = best + ar
            else:
                comm = nx_lat[k, :A, None] + nx_byte[k, :A, None] * self.out32[None, :]  # (A, L1)
                out = np.maximum(best, comm[:, None, :]) + ar
        out = np.where(valid, out, np.inf)
        self.cost_cache[key] = out
        return out

    def _compute_time(self, k: int, n: int, c0: int, w: int = 0) -> np.ndarray:
        """Per-sample time of a micro-batch on groups order[a:a+k] holding ``n`` in flight (``w``
        of them between I and W): shares
        proportional to speed, water-filled where one overflows a device, every layer recomputed
        where that fits and keeping activations does not (inf: fits neither way)."""
        b = self.b
        _, rmax, amin, asum = (x[:, :, c0:] for x in self.window(k, 0))
        tt = self.times(k, 0)[:, :, c0:]
        P = self.per_sample32(0, n, w)
        Pc = P[:, c0:]
        valid = self.t.valid[None, :, c0:]
        infeasible = (asum < b * Pc) | (amin < Pc) | ~valid
        bad = (tt * rmax * Pc > 1.0) & ~infeasible              # a proportional share overflows a device
        best = np.where(infeasible, f32(np.inf), tt)
        ia, ic, ic2 = _where(bad)
        if len(ia):
            best[ia, ic, ic2] = self.fill(0, k, P, ia, ic, ic2 + c0)
        best = np.where(np.isnan(best), np.inf, best)
        if self.rec:  # recomputing every layer can only help where keeping activations does not fit
            P1 = self.per_sample32(1, n, w)
            P1c = P1[:, c0:]
            fits1 = (asum >= b * P1c) & (amin >= P1c)         # memory allows it with every layer recomputed
            helps = (infeasible | bad) & valid & fits1
            ia, ic, ic2 = _where(helps)
            if len(ia):
                g2 = ic2 + c0
                tt1, r1 = self.times(k, 1)[ia, ic, g2], self.window(k, 1)[1][ia, ic, g2]
                p1 = P1[ic, g2]
                bad1 = tt1 * r1 * p1 > 1.0
                sel = np.nonzero(bad1)[0]
                if len(sel):
                    tt1[sel] = self.fill(1, k, P1, ia[sel], ic[sel], g2[sel])
                tt1 = np.where(np.isnan(tt1), np.inf, tt1)
                best[ia, ic, ic2] = np.minimum(best[ia, ic, ic2], tt1)
        return best

    def solve(self, max_stages: int) -> dict[int, tuple[float, list[StageChoice]]]:
        """The best bottleneck and stages per stage count, suffixes grown one stage at a time."""
        N, m = self.N, self.m
        S_max = min(max_stages, self.L, N)
        best_by_S: dict[int, tuple[float, list[StageChoice]]] = {}
        V, lastk = self._last_stage()
        ptrs: list[tuple[np.ndarray, np.ndarray]] = []
        for j in range(S_max):
            if np.isfinite(V[0, 0]):
                best_by_S[j + 1] = (float(V[0, 0]), _reconstruct_fast(ptrs, lastk, j, self.L))
            if j + 1 >= S_max:
                break
            n, w = (_round_up_in_flight(x, m) for x in suffix_in_flight(self.t.pb.schedule, j + 1, m))
            V, argk, argc = self._prepend_stage(V, n, w)
            ptrs.append((argk, argc))
        return best_by_S

    def _last_stage(self) -> tuple[np.ndarray, np.ndarray]:
        """Suffixes of one stage: the best group size for each start position and first layer."""
        N, L1 = self.N, self.L + 1
        n0, w0 = suffix_in_flight(self.t.pb.schedule, 0, self.m)
        V = np.full((N + 1, L1), np.inf, dtype=f32)
        lastk = np.zeros((N + 1, L1), dtype=int)
        for k in range(1, self.K + 1):
            ck = self.cost(k, n0, True, w0)[:, :, 0]                      # (A, L1): layers [c, L)
            A = N - k + 1
            better = ck < V[:A]
            V[:A] = np.where(better, ck, V[:A])
            lastk[:A] = np.where(better, k, lastk[:A])
        return V, lastk

    def _prepend_stage(self, V: np.ndarray, n: int, w: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Suffixes one stage longer: a head group (size k, layers [c, c2)) before the best suffix at (a + k, c2)."""
        N, L1 = self.N, self.L + 1
        newV = np.full((N + 1, L1), np.inf, dtype=f32)
        argk = np.zeros((N + 1, L1), dtype=int)
        argc = np.zeros((N + 1, L1), dtype=int)
        for k in range(1, self.K + 1):
            A = N - k
            if A <= 0:
                continue
            ck = self.cost(k, n, False, w)[:A]                      # groups starting at a < N - k (a next group exists)
            tot = np.maximum(ck, V[k:k + A, None, :])       # (A, L1 c, L1 c2)
            ac = tot.argmin(axis=2)
            val = np.take_along_axis(tot, ac[:, :, None], axis=2)[:, :, 0]
            better = val < newV[:A]
            newV[:A] = np.where(better, val, newV[:A])
            argk[:A] = np.where(better, k, argk[:A])
            argc[:A] = np.where(better, ac, argc[:A])
        return newV, argk, argc


def _where(mask: np.ndarray) -> tuple[np.ndarray, ...]:
    """``np.nonzero`` of a 3-d mask, found on its flat view (several times faster for the few true
    entries these masks have: one index array to build, unravelled for those entries only)."""
    flat = np.flatnonzero(mask)
    return np.unravel_index(flat, mask.shape)


def _round_up_in_flight(n: int, m: int) -> int:
    """In-flight count rounded up to a power of two (at most m; 0 stays 0): fewer distinct memory
    checks, never an underestimate (the final plan is checked with the exact count)."""
    return min(m, 1 << (n - 1).bit_length()) if n > 0 else 0


def _reconstruct_fast(ptrs, lastk, j: int, L: int) -> list[StageChoice]:
    out: list[StageChoice] = []
    a, c = 0, 0
    for level in range(j - 1, -1, -1):
        argk, argc = ptrs[level]
        k, c2 = int(argk[a, c]), int(argc[a, c])
        out.append(StageChoice(cut=(c, c2), hosts=(a, a + k), recompute_all=False, cost=0.0))
        a, c = a + k, c2
    k = int(lastk[a, c])
    out.append(StageChoice(cut=(c, L), hosts=(a, a + k), recompute_all=False, cost=0.0))
    return out

