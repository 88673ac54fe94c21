"""Egress rate, delay and loss on one interface (optionally inside a network namespace).

Layout: an ``htb`` root qdisc with handle ``7470:`` (ASCII "tp", marking it as torchpp's), one
htb class per shaped destination plus a default class, a ``u32`` filter per destination
address, and a ``netem`` leaf on every class that needs delay or loss. htb is used even for a
single rate because it is the one qdisc that gives per-destination classes, so one code path
serves both; tbf cannot classify.

Why the ``tc`` binary and not pyroute2: iproute2 is installed wherever ``ip netns`` works (we
need ``ip`` anyway for namespaces), its command lines are what users copy into bug reports and
run by hand to inspect what we did (``tc -n NS qdisc show``), and its error strings are stable
enough to turn into clear messages. pyroute2 would be a new pinned dependency whose netlink
encodings of htb/netem options change between releases, for no gain at this call rate (a few
commands per ``cluster up``).

Delay and loss need the kernel's ``sch_netem``. Some kernels (minimal VM images) ship htb but
not netem; then applying a delay raises ``Unsupported`` saying so, instead of silently running
without it. ``netem_available()`` lets callers check first.
"""
from __future__ import annotations

import contextlib
import ipaddress
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from .system import CAP_NET_ADMIN, CAP_SYS_ADMIN, PREFIX, CommandFailed, require_caps, run
from .units import format_rate

ROOT_HANDLE = "7470"
"""Major handle of every root qdisc torchpp installs; ``clear`` removes only roots with it."""
DEFAULT_MINOR = 1
UNLIMITED_BPS = 10e9


class Unsupported(RuntimeError):
    """The kernel lacks a qdisc the requested shaping needs (e.g. netem for delay)."""


@dataclass(frozen=True, kw_only=True)
class Shape:
    """What happens to packets leaving through one class."""

    rate: float | None = None
    """Bits per second; None = not rate-limited."""
    delay: float = 0.0
    """One-way added delay in seconds (netem)."""
    jitter: float = 0.0
    loss: float = 0.0
    """Drop probability 0..1 (netem)."""

    def __post_init__(self) -> None:
        if self.rate is not None and not self.rate > 0:
            raise ValueError(f"rate: expected > 0 bit/s, got {self.rate!r}")
        if self.delay < 0 or self.jitter < 0 or not 0 <= self.loss < 1:
            raise ValueError(f"delay/jitter must be >= 0 and loss in [0, 1), got {self}")

    @property
    def needs_netem(self) -> bool:
        return self.delay > 0 or self.jitter > 0 or self.loss > 0

    @property
    def is_noop(self) -> bool:
        return self.rate is None and not self.needs_netem

    def describe(self) -> str:
        parts = [f"rate {self.rate / 1e6:g}mbit" if self.rate else "no rate limit"]
        if self.delay or self.jitter:
            parts.append(f"delay {self.delay * 1e3:g}ms" + (f"±{self.jitter * 1e3:g}ms" if self.jitter else ""))
        if self.loss:
            parts.append(f"loss {self.loss * 100:g}%")
        return ", ".join(parts)


@dataclass(kw_only=True)
class Egress:
    """Shaping of everything leaving ``dev`` (in namespace ``netns``, or the current one)."""

    dev: str
    netns: str | None = None
    default: Shape = field(default_factory=Shape)
    per_dst: dict[str, Shape] = field(default_factory=dict)
    """Destination address (or CIDR) -> shape; overrides ``default`` for that traffic."""

    def __post_init__(self) -> None:
        for dst in self.per_dst:
            try:
                ipaddress.ip_network(dst, strict=False)
            except ValueError:
                raise ValueError(f"per-destination shaping: expected an IP address or CIDR, got {dst!r}") from None

    @property
    def needs_netem(self) -> bool:
        return self.default.needs_netem or any(s.needs_netem for s in self.per_dst.values())


class NoSuchDevice(ValueError):
    """The interface or network namespace named does not exist (a user input error: one line)."""


def check_device(dev: str, netns: str | None = None) -> None:
    """Refuse a missing ``netns`` or ``dev`` before any qdisc is touched, naming which is missing."""
    if netns is not None and not Path(f"/run/netns/{netns}").exists():
        raise NoSuchDevice(f"--netns: no network namespace {netns!r} (see `ip netns list`)")
    if run(["ip", *(["-n", netns] if netns else []), "link", "show", "dev", dev], check=False).returncode != 0:
        raise NoSuchDevice(f"--dev: no interface {dev!r}{' in namespace ' + netns if netns else ''} "
                           f"(see `ip{' -n ' + netns if netns else ''} link`)")


def _tc(netns: str | None, *args: str, check: bool = True):
    return run(["tc", *(["-n", netns] if netns else []), *args], check=check)


def _htb_args(shape: Shape) -> list[str]:
    bps = shape.rate or UNLIMITED_BPS
    byte_rate = bps / 8
    # quantum: share of a round; htb warns outside [1000, 200000] bytes.
    quantum = int(min(200_000, max(1_600, byte_rate / 10)))
    # burst: ~2 ms of traffic but at least a few full frames, so a 1 Gbit/s class can keep up
    # with the timer granularity and a 10 Mbit/s class does not release large bursts.
    burst = int(max(4 * 1514, byte_rate * 0.002))
    r = format_rate(bps)
    return ["htb", "rate", r, "ceil", r, "burst", str(burst), "cburst", str(burst), "quantum", str(quantum)]


def _netem_args(shape: Shape) -> list[str]:
    args = ["netem", "limit", "100000"]
    if shape.delay or shape.jitter:
        args += ["delay", f"{int(round(shape.delay * 1e6))}us"]
        if shape.jitter:
            args += [f"{int(round(shape.jitter * 1e6))}us"]
    if shape.loss:
        args += ["loss", f"{shape.loss * 100:.6g}%"]
    return args


def apply(eg: Egress) -> None:
    """Install the shaping (replacing an earlier torchpp root on ``dev``). On any failure the
    half-built tree is removed before the error is raised."""
    require_caps(f"shaping traffic on {eg.dev}", CAP_NET_ADMIN)
    check_device(eg.dev, eg.netns)
    if root_handle(eg.dev, eg.netns) not in (None, ROOT_HANDLE):
        raise RuntimeError(f"{eg.dev}{' in ' + eg.netns if eg.netns else ''} already has a root qdisc that "
                           f"torchpp did not install ({root_handle(eg.dev, eg.netns)}:); remove it first")
    clear(eg.dev, eg.netns)
    try:
        _tc(eg.netns, "qdisc", "add", "dev", eg.dev, "root", "handle", f"{ROOT_HANDLE}:", "htb",
            "default", f"{DEFAULT_MINOR:x}")
        classes = [(DEFAULT_MINOR, eg.default, None)]
        classes += [(0x10 + i, s, dst) for i, (dst, s) in enumerate(sorted(eg.per_dst.items()))]
        for minor, shape, dst in classes:
            cid = f"{ROOT_HANDLE}:{minor:x}"
            _tc(eg.netns, "class", "add", "dev", eg.dev, "parent", f"{ROOT_HANDLE}:", "classid", cid,
                *_htb_args(shape))
            if shape.needs_netem:
                try:
                    _tc(eg.netns, "qdisc", "add", "dev", eg.dev, "parent", cid, "handle", f"{minor + 0x100:x}:",
                        *_netem_args(shape))
                except CommandFailed as e:
                    if "unknown" in e.stderr.lower() or "not found" in e.stderr.lower():
                        raise Unsupported(_NO_NETEM + f" (tc said: {e.stderr})") from None
                    raise
            if dst is not None:
                net = ipaddress.ip_network(dst, strict=False)
                _tc(eg.netns, "filter", "add", "dev", eg.dev, "parent", f"{ROOT_HANDLE}:", "protocol",
                    "ip" if net.version == 4 else "ipv6", "prio", "1", "u32", "match",
                    "ip" if net.version == 4 else "ip6", "dst", str(net), "flowid", cid)
    except BaseException:
        with contextlib.suppress(Exception):
            clear(eg.dev, eg.netns)
        raise


_NO_NETEM = ("delay and loss need the kernel's netem qdisc (sch_netem, CONFIG_NET_SCH_NETEM), which this "
             "kernel does not provide; rate limits still work — leave out delay/loss or use a kernel with netem")


def root_handle(dev: str, netns: str | None = None) -> str | None:
    """Major handle (hex string) of the root qdisc on ``dev``, None for the kernel default."""
    out = _tc(netns, "qdisc", "show", "dev", dev, "root").stdout
    for line in out.splitlines():
        parts = line.split()
        if len(parts) >= 3 and parts[0] == "qdisc" and "root" in parts:
            if parts[2] in ("0:", "0"):  # the kernel's default qdisc
                return None
            return parts[2].rstrip(":")
    return None


def clear(dev: str, netns: str | None = None) -> bool:
    """Remove the root qdisc on ``dev`` if (and only if) torchpp installed it."""
    if root_handle(dev, netns) != ROOT_HANDLE:
        return False
    _tc(netns, "qdisc", "del", "dev", dev, "root")
    return True


def shaped_devices(netns: str | None = None) -> list[str]:
    """Devices (in ``netns`` or the current namespace) whose root qdisc is torchpp's."""
    out = _tc(netns, "qdisc", "show").stdout
    devs = []
    for line in out.splitlines():
        parts = line.split()
        if len(parts) >= 5 and parts[0] == "qdisc" and parts[2] == f"{ROOT_HANDLE}:" and "root" in parts:
            devs.append(parts[parts.index("dev") + 1])
    return sorted(set(devs))


def show(dev: str, netns: str | None = None) -> str:
    check_device(dev, netns)
    q = _tc(netns, "qdisc", "show", "dev", dev).stdout
    c = _tc(netns, "class", "show", "dev", dev).stdout
    return (q + c).rstrip()


@contextlib.contextmanager
def shaped(eg: Egress) -> Iterator[Egress]:
    """Shaping for the duration of the block; removed afterwards, also on exceptions."""
    apply(eg)
    try:
        yield eg
    finally:
        clear(eg.dev, eg.netns)


_netem_cache: bool | None = None


def netem_available() -> bool:
    """Whether this kernel has netem, tried on a veth pair inside a throwaway namespace."""
    global _netem_cache
    if _netem_cache is None:
        require_caps("probing for the netem qdisc", CAP_NET_ADMIN, CAP_SYS_ADMIN)
        ns = f"{PREFIX}-probe-{os.getpid()}"
        run(["ip", "netns", "add", ns])
        try:
            run(["ip", "-n", ns, "link", "add", "p0", "type", "veth", "peer", "name", "p1"])
            _netem_cache = _tc(ns, "qdisc", "add", "dev", "p0", "root", "netem", "delay", "1ms",
                               check=False).returncode == 0
        finally:
            run(["ip", "netns", "del", ns], check=False)
    return _netem_cache
