"""A rank never outlives its launcher, and never waits unbounded to join the world.

- **Parent death.** Each rank asks Linux (``prctl(PR_SET_PDEATHSIG)``) for SIGTERM when the
  process that started it (``torchrun``, ``torchpp run``'s driver, a shell) exits, however it
  exits: SIGKILL included, where the launcher can forward nothing. SIGTERM then stops the rank
  at the next step boundary (``safekeeping.StopRequest``), with a checkpoint when the run keeps
  them; a rank stuck waiting for a peer is bounded by ``--timeout-s``.
- **Joining.** torch's store client can wait without bound on a foreign process that holds the
  rendezvous port and never answers; a watchdog ends the rank after ``--timeout-s`` with one line.
"""
from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
from contextlib import contextmanager
from typing import Iterator

PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGTERM) -> bool:
    """Ask for ``sig`` when the parent process exits (Linux); False where that is not available.
    A parent gone while asking sends it at once."""
    if not sys.platform.startswith("linux"):
        return False
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if os.getppid() != parent:  # the parent exited between the two calls (a launcher may be pid 1: no test on 1)
        os.kill(os.getpid(), sig)
    return True


@contextmanager
def bounded(what: str, timeout_s: float, rank: int | str) -> Iterator[None]:
    """End this process with one line (exit 1) if the body has not finished within ``timeout_s``:
    for waits inside torch that no Python timeout reaches."""
    done = threading.Event()

    def watch() -> None:
        if not done.wait(timeout_s):
            endpoint = f" at {os.environ['MASTER_ADDR']}:{os.environ.get('MASTER_PORT', '')}" \
                if "MASTER_ADDR" in os.environ else ""
            logging.getLogger("torchpp.runtime").error(
                f"torchpp.train: rank {rank}: error: {what}: no answer within --timeout-s {timeout_s:g}{endpoint} "
                "(a rank did not start, or another program holds the port)")
            for h in logging.getLogger("torchpp.runtime").handlers:
                h.flush()
            os._exit(1)

    t = threading.Thread(target=watch, name="bounded-wait", daemon=True)
    t.start()
    try:
        yield
    finally:
        done.set()
