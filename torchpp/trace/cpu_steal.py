"""CPU time the hypervisor gave to other guests while we ran (``steal`` in ``/proc/stat``).

A virtual machine's CPUs share physical cores with other guests: while one of them runs, every
process here waits, whatever its cgroup quota or priority, and a measured step is slower than
the same step on the same machine a minute earlier. On the 2-core development VM the homelab
demo's plan, trained four times back to back with nothing else running, measured +1.8%, +3.7%
and +2.6% against its prediction in the three runs that lost no CPU, and -15.7% in the one that
lost 0.24 of a core on average (0.84 at worst, sampled every 2 s). Traces carry each step's steal so
a slow run says why; on a physical machine (a Pi, a laptop) it stays 0.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass

WARN_SHARE = 0.05
"""Steal above this share of the machine's CPUs is reported as having slowed the measurement."""


@dataclass(frozen=True)
class CpuClock:
    """One reading: the machine's steal so far (seconds, summed over its CPUs) and when it was read."""

    steal_s: float
    monotonic_s: float


def read(stat: str = "/proc/stat") -> CpuClock | None:
    """None where there is no ``/proc/stat`` with a steal column (not Linux)."""
    try:
        with open(stat) as f:
            fields = f.readline().split()
    except OSError:
        return None
    if len(fields) < 9 or fields[0] != "cpu":
        return None
    try:
        return CpuClock(int(fields[8]) / os.sysconf("SC_CLK_TCK"), time.monotonic())
    except (ValueError, OSError):
        return None


def stolen_cores(since: CpuClock | None, until: CpuClock | None = None) -> float | None:
    """Cores the machine lost to steal on average between two readings (``until`` defaults to now)."""
    until = until or read()
    if since is None or until is None or until.monotonic_s <= since.monotonic_s:
        return None
    return max(0.0, until.steal_s - since.steal_s) / (until.monotonic_s - since.monotonic_s)


def cpus() -> int:
    return os.cpu_count() or 1


def describe(cores: float, machine_cpus: int) -> str:
    """``0.24 of 2 cores (12%)``."""
    return f"{cores:.2f} of {machine_cpus} core{'s' * (machine_cpus != 1)} ({100 * cores / machine_cpus:.0f}%)"


def slowed(cores: float | None, machine_cpus: int) -> bool:
    return cores is not None and cores >= WARN_SHARE * machine_cpus
