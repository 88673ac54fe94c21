"""The shared runtime's files read into the page cache by the launcher, before any host starts.

A memory cgroup is charged for a page of the page cache by the group that first reads it, and
only that group's limit reclaims it. On a machine where torch was not read since boot (a fresh
clone, a quiet machine), the first emulated host to import it paid for the pages of
``libtorch_cpu.so``, Python and transformers that it touched: measured on the homelab's pi3
(0.25 core, 750 MB) profiling two layers, 238 MB of its limit were such file pages, the group hit
its limit 14,281 times (``memory.failcnt``), 3,710 pages were read again after being reclaimed
(``workingset_refault_file``) and 148 major faults stalled it, while the same profile with the
pages already read elsewhere peaked at 515 MB and never touched the limit. Which host paid, and how
much, depended on which started first and on what earlier runs had left in the cache, which fits
a small host running far below its quota in some rounds and not in others (the demo's 15%-of-a-core
round itself was not reproduced; this mechanism was). A real device pays for its runtime's pages
too, but always the same amount; here it was a race. So ``cluster run`` reads the runtime first,
in its own group: the hosts then map pages charged elsewhere, and a host's limit holds what its own process allocates: the same
cold-cache profile then had 1 MB of file pages charged, peaked at 502 MB, never reached its limit
and took no major fault.

The CPU quota was measured too and showed no such loss: in a 0.25-core group with 10 ms periods a
busy loop got 0.242 of a core and torch forward/backward (one intra-op thread, which ``cluster
run`` sets through OMP_NUM_THREADS) 0.250; beside the three other homelab hosts running the same
and two busy processes, 0.231-0.241, each host's work within 1-6% of its quota ratio to the laptop.
tests/test_cluster_quota_root.py keeps both.
"""
from __future__ import annotations

import importlib.util
import os
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

MODULES = ("torch", "transformers", "numpy", "tokenizers", "safetensors")
"""Packages every torchpp process on a host loads (one not installed is skipped)."""


@dataclass(frozen=True)
class Warmed:
    """What the warm-up read: how many files and bytes, and the seconds it took."""

    files: int
    bytes: int
    seconds: float


def _is_runtime(name: str) -> bool:
    return name.endswith(".pyc") or ".so" in name


def runtime_files(modules: tuple[str, ...] = MODULES) -> list[Path]:
    """Shared objects and compiled modules of the interpreter, its standard library and ``modules``
    (with their vendored ``<name>.libs``), found without importing anything: every file a host's
    process maps or imports from, and a few it does not (whole files, since a host's forward and
    backward run kernels that no import reaches)."""
    roots = [Path(sysconfig.get_paths()["stdlib"])]
    for m in modules:
        spec = importlib.util.find_spec(m)
        for loc in (spec.submodule_search_locations or []) if spec else []:
            roots += [Path(loc), Path(loc).parent / f"{m}.libs"]
    files = {Path(sys.executable).resolve()}
    libdir, lib = sysconfig.get_config_var("LIBDIR"), sysconfig.get_config_var("LDLIBRARY")
    if libdir and lib and (Path(libdir) / lib).is_file():
        files.add((Path(libdir) / lib).resolve())
    for root in roots:
        for d, subdirs, names in os.walk(root):
            subdirs[:] = [s for s in subdirs if s != "site-packages"]  # the stdlib's, walked per module above
            files.update(Path(d) / n for n in names if _is_runtime(n))
    return sorted(files)


def warm(modules: tuple[str, ...] = MODULES) -> Warmed:
    """Read ``runtime_files`` whole in this process, so their pages are in the page cache charged to
    the caller's cgroup. Read, not ``posix_fadvise(WILLNEED)``: that starts a bounded readahead only
    (8 MB of a 29 MB library here), and the rest was still charged to the first host that touched it.
    Pages already cached are only copied: ~0.6 CPU-seconds for the ~0.8 GB on a warm machine."""
    import time

    t0, total, n = time.monotonic(), 0, 0
    buf = bytearray(4 << 20)
    for path in runtime_files(modules):
        try:
            with open(path, "rb", buffering=0) as f:
                while k := f.readinto(buf):
                    total += k
            n += 1
        except OSError:
            pass
    return Warmed(n, total, time.monotonic() - t0)
