"""CPU quota and memory limit for a process tree, on cgroup v1 or v2 (found at run time).

The cgroup filesystem is written directly rather than through cgroup-tools (cgcreate/cgexec):
the files are a stable kernel interface, the tools are often not installed, and the same code
then handles v1, v2 and hybrid machines, where each controller may live in a different
hierarchy. Controllers are resolved one by one from /proc/self/mountinfo: a controller mounted
as a v1 hierarchy is used there (it cannot be enabled in v2 while bound to v1), otherwise the
cgroup2 mount that lists it in ``cgroup.controllers``.

All groups live under a ``torchpp`` directory in each hierarchy, so ``clear_all`` removes
exactly what torchpp made.

A quota only caps a group. When the machine is busy, CFS divides it by weight (v1
``cpu.shares``, v2 ``cpu.weight``), and a group with the default weight competes like one
ordinary process however many hosts it holds: every emulated host then gets the same small
share, and a 0.8-core host runs no faster than a 0.3-core one. So a limited group also gets a
weight of ``RESERVE_WEIGHT`` ordinary processes per core of its quota (``reserve``), and each
group above it the sum of its children (``weigh_inner_groups``): the quota becomes a
reservation as well as a cap, so each host gets its quota while other processes keep the
machine busy, and never more; what the quotas leave free stays with everything else.
"""
from __future__ import annotations

import math

import contextlib
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from .system import PREFIX, NotPermitted, require_writable

MIN_CPU = 0.001
"""Fewest cores a quota may give (1 ms per 1 s period, the kernel's smallest quota)."""
MIN_MEMORY = 16 << 20
"""Smallest memory limit: below it a Python process cannot even start."""


def machine_memory() -> int:
    """Bytes of RAM on this machine (a limit above it is no limit, and cgroups may wrap it to 0)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_memory(limit_bytes: int) -> int:
    """A memory limit in ``[MIN_MEMORY, machine memory]``; anything else is refused with the range."""
    total = machine_memory()
    if isinstance(limit_bytes, bool) or not isinstance(limit_bytes, int) or not MIN_MEMORY <= limit_bytes <= total:
        raise ValueError(f"expected a memory limit between 16M and this machine's {total / 2**30:.1f}G, got "
                         f"{limit_bytes!r} bytes")
    return limit_bytes


def check_cpu(cores: float) -> float:
    """A CPU quota in ``[MIN_CPU, cores of this machine]``, finite."""
    n = os.cpu_count() or 1
    if isinstance(cores, bool) or not isinstance(cores, (int, float)) or not MIN_CPU <= cores <= n:
        raise ValueError(f"expected a positive number of cores (> 0; from {MIN_CPU:g} to this machine's {n}), "
                         f"got {cores!r}")
    return float(cores)


CFS_PERIOD_US = 100_000
"""100 ms, the kernel's default (see ``set_cpu`` for why not shorter)."""
RESERVE_WEIGHT = 64
"""Ordinary processes' worth of CPU weight per core of quota: a host of quota q with weight 64 q
beside n busy processes on its core wins 64 q / (64 q + n) of it, at least q while n <= 64 (1 - q):
a 0.7-core host holds its quota beside 19 of them, a 0.25-core one beside 48. At 16 (up to 4.8
beside the 0.7-core host) the homelab's four hosts got 82-90% of their quotas on a machine at load
39, each by how much the load beat its weight, so their speed ratios moved with the load; at 64,
95-98%. cgroup v2 caps a weight at 100 processes' worth, so an inner group holding more (homelab:
1.85 cores, 118) competes as 100 there."""
CONTROLLERS = ("cpu", "memory")

FILL = "idle-fill"
"""The child group of a host's group that holds its idle filler (:meth:`Cgroup.fill_idle`)."""


@dataclass(frozen=True)
class Hierarchy:
    """Where one controller is mounted: cgroup ``version`` 1 or 2 and the mount point."""

    controller: str
    version: int
    mount: Path


def _mounts(mountinfo: str) -> list[tuple[Path, str, set[str]]]:
    out = []
    for line in mountinfo.splitlines():
        left, _, right = line.partition(" - ")
        parts, rparts = left.split(), right.split()
        if len(parts) < 5 or len(rparts) < 3:
            continue
        out.append((Path(parts[4].replace("\\040", " ")), rparts[0], set(rparts[2].split(","))))
    return out


def detect(mountinfo: str | None = None) -> dict[str, Hierarchy]:
    """Map each available controller in CONTROLLERS to its hierarchy (v1 preferred when bound)."""
    if mountinfo is None:
        try:
            mountinfo = Path("/proc/self/mountinfo").read_text()
        except OSError:
            return {}
    found: dict[str, Hierarchy] = {}
    mounts = _mounts(mountinfo)
    for mnt, fstype, opts in mounts:
        if fstype == "cgroup":
            for c in CONTROLLERS:
                if c in opts and c not in found:
                    found[c] = Hierarchy(c, 1, mnt)
    for mnt, fstype, _ in mounts:
        if fstype == "cgroup2":
            try:
                available = set((mnt / "cgroup.controllers").read_text().split())
            except OSError:
                continue
            for c in CONTROLLERS:
                if c in available and c not in found:
                    found[c] = Hierarchy(c, 2, mnt)
    return found


def describe(hier: dict[str, Hierarchy] | None = None) -> str:
    hier = detect() if hier is None else hier
    if not hier:
        return "no cgroup cpu or memory controller is mounted"
    return ", ".join(f"{h.controller}: v{h.version} at {h.mount}" for h in hier.values())


def _hierarchy(controller: str, hier: dict[str, Hierarchy]) -> Hierarchy:
    if controller not in hier:
        raise NotPermitted(f"the cgroup '{controller}' controller is not mounted on this machine "
                           f"({describe(hier)}); mount cgroup v2 at /sys/fs/cgroup or v1 with -o {controller}")
    return hier[controller]


def _write(path: Path, value: str) -> None:
    try:
        path.write_text(value)
    except PermissionError:
        raise NotPermitted(f"writing {path} needs root (uid {os.geteuid()} may not)") from None


@dataclass
class Cgroup:
    """One torchpp group (``torchpp/<name>``) in every hierarchy of the controllers it limits."""

    name: str
    controllers: tuple[str, ...] = CONTROLLERS
    hier: dict[str, Hierarchy] = field(default_factory=detect)

    def __post_init__(self) -> None:
        if not self.name or self.name.startswith("/") or ".." in self.name.split("/"):
            raise ValueError(f"cgroup name: expected a relative name like 'cluster-pi3/pi0', got {self.name!r}")

    def paths(self) -> dict[str, Path]:
        """Controller -> directory (two controllers share one directory on cgroup v2)."""
        return {c: _hierarchy(c, self.hier).mount / PREFIX / self.name for c in self.controllers}

    def dirs(self) -> list[Path]:
        return sorted(set(self.paths().values()))

    def create(self) -> "Cgroup":
        for c, path in self.paths().items():
            h = _hierarchy(c, self.hier)
            require_writable(f"a cgroup for {c}", h.mount)
            if h.version == 2:
                # v2 delegates a controller one level at a time: enable it in every ancestor.
                node = h.mount
                for part in (PREFIX, *self.name.split("/")):
                    if f"{c}" not in (node / "cgroup.subtree_control").read_text().split():
                        _write(node / "cgroup.subtree_control", f"+{c}")
                    node = node / part
                    node.mkdir(exist_ok=True)
            else:
                path.mkdir(parents=True, exist_ok=True)
        return self

    def set_cpu(self, cores: float, period_us: int = CFS_PERIOD_US) -> None:
        """Quota of ``cores`` CPUs (0.25 = a quarter of one core) per ``period_us`` (100 ms).

        A shorter period would spread the throttling more finely (at 100 ms a 0.3-core host runs
        30 ms and stops 70 ms), but quotas of a few milliseconds are of the order of the
        scheduler's tick and its 5 ms bandwidth slice, and then the quota is not what is
        delivered: at 10 ms periods a 0.25-core quota gave between 0.16 and 0.25 of a core from
        run to run; at 100 ms it gives 0.247. Pipeline steps last far longer than a period, so
        they see the average. The kernel needs quota and period of at least 1 ms: for tiny
        quotas the period grows instead."""
        check_cpu(cores)
        if not 1000 <= period_us <= 1_000_000:
            raise ValueError(f"cpu period: expected 1 ms to 1 s, got {period_us} us")
        period_us = min(1_000_000, max(period_us, math.ceil(1000 / cores)))
        quota = max(1000, int(round(cores * period_us)))
        h, path = _hierarchy("cpu", self.hier), self.paths()["cpu"]
        if h.version == 2:
            _write(path / "cpu.max", f"{quota} {period_us}")
        else:
            _write(path / "cpu.cfs_period_us", str(period_us))
            _write(path / "cpu.cfs_quota_us", str(quota))

    def set_weight(self, processes: float) -> None:
        """CPU weight worth ``processes`` ordinary (nice 0) processes under contention."""
        h, path = _hierarchy("cpu", self.hier), self.paths()["cpu"]
        _write_weight(h, path, processes)

    def reserve(self, cores: float) -> None:
        """Weight that lets this group reach a quota of ``cores`` on a busy machine."""
        self.set_weight(max(1.0, RESERVE_WEIGHT * cores))

    def set_memory(self, limit_bytes: int) -> None:
        check_memory(limit_bytes)
        h, path = _hierarchy("memory", self.hier), self.paths()["memory"]
        if h.version == 2:
            _write(path / "memory.max", str(int(limit_bytes)))
            if (path / "memory.swap.max").exists():
                _write(path / "memory.swap.max", "0")  # a limit that swaps is not a limit
        else:
            _write(path / "memory.limit_in_bytes", str(int(limit_bytes)))

    def limits(self) -> dict[str, str]:
        """Current limits as the kernel reports them (for ``status``)."""
        out: dict[str, str] = {}
        for c, path in self.paths().items():
            v = _hierarchy(c, self.hier).version
            names = {("cpu", 1): ["cpu.cfs_quota_us", "cpu.cfs_period_us", "cpu.shares"],
                     ("cpu", 2): ["cpu.max", "cpu.weight"],
                     ("memory", 1): ["memory.limit_in_bytes"], ("memory", 2): ["memory.max"]}[(c, v)]
            for n in names:
                with contextlib.suppress(OSError):
                    out[n] = (path / n).read_text().strip()
        return out

    def oom_kills(self) -> int:
        """How many processes the kernel's OOM killer has killed in this group so far."""
        h, path = _hierarchy("memory", self.hier), self.paths().get("memory")
        name = "memory.events" if h.version == 2 else "memory.oom_control"
        try:
            fields = dict(line.split() for line in (path / name).read_text().splitlines() if line.strip())
        except (OSError, ValueError, TypeError):
            return 0
        return int(fields.get("oom_kill", 0))

    def memory_limit(self) -> int | None:
        """The group's memory limit in bytes; None when it has none."""
        lim = self.limits()
        raw = lim.get("memory.max", lim.get("memory.limit_in_bytes", "max"))
        return int(raw) if raw.isdigit() and int(raw) < 2**60 else None

    def add(self, pid: int) -> None:
        """Move a process (all its threads) into the group; its later children follow it."""
        for path in self.dirs():
            _write(path / "cgroup.procs", str(pid))

    def preexec(self) -> None:
        """For ``subprocess.Popen(preexec_fn=...)``: the child joins before it execs."""
        self.add(os.getpid())

    def pids(self, fill: bool = False) -> list[int]:
        """Processes inside, the idle filler (:meth:`fill_idle`) only with ``fill``."""
        return sorted({pid for path in self.dirs() for pid in _pids_under(path, () if fill else (FILL,))})

    def kill(self, sig: int = signal.SIGKILL, fill: bool = False) -> None:
        for pid in self.pids(fill):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    def fill_idle(self, core: int) -> int:
        """Start a spinner on ``core`` in the child group ``FILL``, at idle priority (the group's
        ``cpu.idle``, the task's SCHED_IDLE): it runs only while nothing else of this group is
        runnable on that core, so the group's quota is used up while its processes wait and they
        cannot run a pass faster than the quota out of what they saved (config.py). Returns its
        pid; :meth:`stop_fill` ends it."""
        h = _hierarchy("cpu", self.hier)
        if h.version == 2:  # v2 lets a group hold processes or child groups, not both
            raise NotPermitted("steady_cpu needs the cgroup v1 cpu controller (on v2 a host's group cannot hold "
                               "both its processes and the idle filler's group); set steady_cpu to false")
        path = self.paths()["cpu"] / FILL
        path.mkdir(exist_ok=True)
        idle = path / "cpu.idle"
        if not (idle.exists() and idle.read_text().strip() == "1"):  # (an idle group's weight cannot be written)
            _write_weight(h, path, 0.002)  # the smallest weight
            if idle.exists():
                _write(idle, "1")

        def setup() -> None:
            os.sched_setaffinity(0, {core})
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
            _write(path / "cgroup.procs", str(os.getpid()))

        # the loop runs in the background of a shell that exits at once: it is nobody's child here
        # (no zombie once killed)
        out = subprocess.run(["sh", "-c", "while :; do :; done </dev/null >/dev/null 2>&1 & echo $!"],
                             preexec_fn=setup, start_new_session=True, stdin=subprocess.DEVNULL,
                             capture_output=True, text=True, check=True, timeout=10)
        return int(out.stdout.strip())

    def stop_fill(self) -> None:
        _kill_under(self.paths()["cpu"] / FILL, tries=100, pause_s=0.02)

    def remove(self, timeout: float = 10.0) -> None:
        """Kill what is left inside (the idle filler too), then remove the directories (deepest first)."""
        deadline = time.monotonic() + timeout
        while self.pids(fill=True) and time.monotonic() < deadline:
            self.kill(signal.SIGKILL, fill=True)
            time.sleep(0.05)
        for path in self.dirs():
            _rmtree_cgroup(path)
            _prune_empty_parents(path)

    def release(self) -> None:
        """Move the processes inside back to the hierarchy's root group, then remove the group
        (for limits put on processes torchpp did not start)."""
        for c, path in self.paths().items():
            mount = _hierarchy(c, self.hier).mount
            for pid in _pids_under(path) if path.exists() else []:
                with contextlib.suppress(ProcessLookupError, OSError):
                    (mount / "cgroup.procs").write_text(str(pid))
        self.remove()

    def exists(self) -> bool:
        return any(p.exists() for p in self.dirs())


_V1_UNIT, _V2_UNIT = 1024, 100  # the default weight of one group (and of one process on v1)


def weigh_inner_groups(hier: dict[str, Hierarchy] | None = None) -> None:
    """Give every torchpp group that holds groups (``torchpp/``, ``cluster-<name>/``) the summed
    weight of its children, deepest first; call after adding or removing groups."""
    hier = detect() if hier is None else hier
    h = hier.get("cpu")
    root = h.mount / PREFIX if h else None
    if root is None or not root.is_dir():
        return
    for d, subdirs, _ in sorted(os.walk(root), key=lambda t: -len(Path(t[0]).parts)):
        subs = [c for c in subdirs if c != FILL]  # a host's filler does not weigh it down
        if subs:
            with contextlib.suppress(OSError, NotPermitted):
                _write_weight(h, Path(d), sum(_read_weight(h, Path(d) / c) for c in subs))


def _write_weight(h: Hierarchy, path: Path, processes: float) -> None:
    if h.version == 2:
        _write(path / "cpu.weight", str(min(10000, max(1, round(_V2_UNIT * processes)))))
    else:
        _write(path / "cpu.shares", str(min(262144, max(2, round(_V1_UNIT * processes)))))


def _read_weight(h: Hierarchy, path: Path) -> float:
    try:
        if h.version == 2:
            return int((path / "cpu.weight").read_text()) / _V2_UNIT
        return int((path / "cpu.shares").read_text()) / _V1_UNIT
    except (OSError, ValueError):
        return 1.0


def _prune_empty_parents(path: Path) -> None:
    """Remove now-empty torchpp ancestors (up to and including ``torchpp/``) so nothing is left."""
    parent = path.parent
    while PREFIX in parent.parts:
        if not parent.exists():
            parent = parent.parent
            continue
        if any(p.is_dir() for p in parent.iterdir()):
            return
        try:
            os.rmdir(parent)
        except OSError:  # another torchpp group appeared meanwhile, or a task is still exiting
            return
        if parent.name == PREFIX:
            return
        parent = parent.parent


def existing(name: str, hier: dict[str, Hierarchy] | None = None) -> Cgroup:
    """Handle on an existing group, over the controllers in which it has a directory."""
    hier = detect() if hier is None else hier
    return Cgroup(name, tuple(c for c in CONTROLLERS if c in hier and (hier[c].mount / PREFIX / name).exists()),
                  hier)


def _rmtree_cgroup(path: Path) -> None:
    """cgroup directories are removed with rmdir (their files are virtual), children first."""
    if not path.exists():
        return
    for d, subdirs, _ in sorted(os.walk(path, topdown=False), key=lambda t: -len(t[0])):
        for _ in range(50):
            try:
                os.rmdir(d)
                break
            except FileNotFoundError:
                break
            except OSError:  # EBUSY while the last task is still exiting
                time.sleep(0.02)
        else:
            raise RuntimeError(f"could not remove cgroup {d}: still busy")


@contextlib.contextmanager
def limited(name: str, cpu: float | None = None, memory: int | None = None) -> Iterator[Cgroup]:
    """A group with the given limits for the duration of the block; always removed afterwards
    (processes still inside are killed), also on exceptions and on KeyboardInterrupt."""
    ctl = tuple(c for c, v in (("cpu", cpu), ("memory", memory)) if v is not None)
    if not ctl:
        raise ValueError("limited(): give cpu and/or memory")
    group = Cgroup(name, ctl)
    try:
        group.create()
        if cpu is not None:
            group.set_cpu(cpu)
            group.reserve(cpu)
        if memory is not None:
            group.set_memory(memory)
        yield group
    finally:
        group.remove()


def list_groups(hier: dict[str, Hierarchy] | None = None) -> list[str]:
    """Names of the torchpp groups that exist (leaves and inner groups), relative to ``torchpp/``."""
    hier = detect() if hier is None else hier
    names: set[str] = set()
    for h in hier.values():
        root = h.mount / PREFIX
        if root.is_dir():
            for d, _, _ in os.walk(root):
                rel = Path(d).relative_to(root).as_posix()
                if rel != ".":
                    names.add(rel)
    return sorted(names)


def clear_all(hier: dict[str, Hierarchy] | None = None) -> list[Path]:
    """Kill every process in a torchpp group and remove all torchpp groups. Returns the removed roots."""
    hier = detect() if hier is None else hier
    removed = []
    for root in sorted({h.mount / PREFIX for h in hier.values()}):
        if root.is_dir():
            _kill_under(root, tries=200, pause_s=0.05)
            _rmtree_cgroup(root)
            removed.append(root)
    return removed


def _kill_under(root: Path, tries: int, pause_s: float) -> None:
    """SIGKILL every process under ``root`` until none is left (or ``tries`` rounds have passed)."""
    for _ in range(tries):
        pids = _pids_under(root) if root.exists() else []
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(pause_s)


def _pids_under(root: Path, skip: tuple[str, ...] = ()) -> list[int]:
    out: set[int] = set()
    for d, sub, _ in os.walk(root):
        sub[:] = [x for x in sub if x not in skip]
        with contextlib.suppress(OSError):
            out.update(int(x) for x in (Path(d) / "cgroup.procs").read_text().split())
    return sorted(out)
