"""Every rank hears why any rank cannot start, before the first collective.

A rank whose own checks fail (a bad argument, plan or data file) says so in one line and exits 2.
Alone, that leaves its peers waiting in the first collective for a rank that has gone ("peer
closed" after --timeout-s), and under torchrun the first rank to exit makes the agent kill the
others, often before they have printed their own line. So before the process group exists,
every rank posts its problem ("" for none) in the rendezvous store and reads everyone's: a rank
with a problem has already said it; a rank without one says which ranks failed and why; all
exit 2. No rank leaves before every rank has read the answers (rank 0 may host the store; the
agent stops the others once one exits).
"""
from __future__ import annotations

import datetime
import os
import threading
import time

import torch.distributed as dist

from .exchange import _ranks

KEY = "preflight"


def attempt_store(store: dist.Store) -> dist.Store:
    """Keys of this attempt only: a restarted attempt never meets what a killed rank left in a
    store that outlived it (``TORCHELASTIC_RESTART_COUNT``, as torchrun and ``torchpp run`` set it)."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT") or "0"
    return dist.PrefixStore(f"torchpp/attempt{attempt}", store)


def exchange(store: dist.Store, rank: int, world: int, problem: str | None, timeout_s: float) -> list[str]:
    """Each rank's problem ("" for none), once every rank has posted one. Returns only when every
    rank has read them all, or ``timeout_s`` after that began (they were read; leaving is safe)."""
    store.set(f"{KEY}/{rank}", problem or "")
    keys = [f"{KEY}/{r}" for r in range(world)]
    store.wait(keys, datetime.timedelta(seconds=timeout_s))
    out = [store.get(k).decode("utf-8", "replace") for k in keys]
    store.add(f"{KEY}/read", 1)
    deadline = time.monotonic() + timeout_s
    try:
        while store.add(f"{KEY}/read", 0) < world and time.monotonic() < deadline:
            time.sleep(0.02)
        # rank 0 may host the store: it leaves last, so no rank's next request meets a closed store
        # (c10d prints a multi-line warning for that, even when the error is caught)
        store.add(f"{KEY}/left", 1)
        while rank == 0 and store.add(f"{KEY}/left", 0) < world and time.monotonic() < deadline:
            time.sleep(0.02)
    except RuntimeError:  # the store's host has read everything and left
        pass
    return out


def peer_problems(problems: list[str], rank: int) -> str | None:
    """One line naming the other ranks' problems (grouped by text), or None when they have none."""
    bad: dict[str, list[int]] = {}
    for r, p in enumerate(problems):
        if p and r != rank:
            bad.setdefault(p, []).append(r)
    return "; ".join(f"{_ranks(rs)}: {p}" for p, rs in bad.items()) or None


def tell_peers(problem: str, timeout_s: float) -> None:
    """From a rank that failed its own checks (and has said so): post ``problem`` for the others,
    at most ``timeout_s``. Quiet: whatever goes wrong here, the rank's own line is its answer."""
    try:
        rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return
    if world <= 1 or "MASTER_ADDR" not in os.environ or dist.is_initialized():
        return

    def post() -> None:
        from .rendezvous import env_store

        try:
            store = attempt_store(env_store(rank, world, datetime.timedelta(seconds=timeout_s)))
            exchange(store, rank, world, problem, timeout_s)
        except Exception:  # noqa: BLE001 (no store, a peer gone: the rank's line already said why)
            pass

    t = threading.Thread(target=post, name="preflight", daemon=True)
    t.start()
    t.join(timeout_s + 5)
