"""Receiver congestion: no rank takes in more than ``cap`` of inbound share at once.

When the senders' three-tier shares add up to more than a receiver can absorb, every
sender into it is scaled down to fit (and marked throttled); each sender's channel then
gives what it freed to its unthrottled entries, which may overload another receiver, so
the two steps repeat until nothing is over (at most one round per action), and a last
pass scales whatever is still over.
"""
from __future__ import annotations

from typing import Callable

from .compiled import AR, Compiled
from .tiers import Allocate

Congest = Callable[[], tuple[dict[int, float], bool]]


def make_congest(c: Compiled, chan: list[list[int]], base: list[float], throttled: set[int],
                 allocate: Allocate, cap: float) -> Congest:
    """``congest()``: final shares of every channel entry, and whether any was throttled.

    ``base`` holds each entry's three-tier share before congestion; throttled entries are
    added to ``throttled``.
    """
    code, peer = c.code, c.peer
    A, R = len(code), len(c.ranks)
    scratch = [0.0] * A

    def inbound_of(final: dict[int, float]) -> dict[int, list[int]]:
        by_dst: dict[int, list[int]] = {}
        for m, s in final.items():
            if s > 0 and code[m] != AR:
                by_dst.setdefault(peer[m], []).append(m)
        return by_dst

    def refill(final: dict[int, float], fixed: set[int]) -> None:
        """Each channel with a throttled entry gives what is left to its other entries."""
        for ri in range(R):
            tasks = chan[ri]
            if not any(m in fixed for m in tasks):
                continue
            used = sum(final[m] for m in tasks if m in fixed)
            free = [m for m in tasks if m not in fixed]
            if free:
                allocate(free, max(0.0, 1.0 - used), scratch)
                for m in free:
                    final[m] = scratch[m]

    def congest() -> tuple[dict[int, float], bool]:
        final: dict[int, float] = {}
        inbound: dict[int, float] = {}
        for ri in range(R):
            for m in chan[ri]:
                s = base[m]
                final[m] = s
                if s > 0 and code[m] != AR:
                    d = peer[m]
                    inbound[d] = inbound.get(d, 0.0) + s
        if max(inbound.values(), default=0.0) <= cap * (1 + 1e-12):  # nobody over: shares stand
            return final, False
        fixed: set[int] = set()
        for _ in range(A + 1):
            over = False
            for ms in inbound_of(final).values():
                total = 0.0
                for m in ms:
                    total += final[m]
                if total > cap * (1 + 1e-12):
                    over = True
                    f = cap / total
                    for m in ms:
                        final[m] *= f
                        fixed.add(m)
                        throttled.add(m)
            if not over:
                return final, True
            refill(final, fixed)
        for ms in inbound_of(final).values():
            total = sum(final[m] for m in ms)
            if total > cap:
                for m in ms:
                    final[m] *= cap / total
                    throttled.add(m)
        return final, True

    return congest
