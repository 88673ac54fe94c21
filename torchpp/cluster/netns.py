"""Network namespaces, veth pairs and bridges through `ip` (iproute2).

Links are created directly inside their target namespaces (``ip -n NS link add ... peer ...
netns OTHER``), so nothing torchpp makes ever appears in the caller's namespace, and deleting
a namespace deletes every interface, address and qdisc inside it.
"""
from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

from .system import CommandFailed, run

NETNS_DIR = Path("/run/netns")


def list_all() -> list[str]:
    """Names of the named network namespaces (``ip netns list``)."""
    out = run(["ip", "netns", "list"]).stdout
    return sorted(line.split()[0] for line in out.splitlines() if line.strip())


def exists(name: str) -> bool:
    return (NETNS_DIR / name).exists()


def add(name: str) -> None:
    run(["ip", "netns", "add", name])
    run(["ip", "-n", name, "link", "set", "lo", "up"])


def pids(name: str) -> list[int]:
    proc = run(["ip", "netns", "pids", name], check=False)
    return sorted(int(x) for x in proc.stdout.split() if x.isdigit())


def delete(name: str) -> None:
    """Kill what still runs inside, then delete the namespace (and with it its links)."""
    if not exists(name):
        return
    for pid in pids(name):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    run(["ip", "netns", "del", name])


def add_bridge(ns: str, name: str) -> None:
    run(["ip", "-n", ns, "link", "add", name, "type", "bridge"])
    run(["ip", "-n", ns, "link", "set", name, "up"])


def add_veth(ns_a: str, name_a: str, ns_b: str, name_b: str) -> None:
    run(["ip", "-n", ns_a, "link", "add", name_a, "type", "veth", "peer", "name", name_b, "netns", ns_b])


def one_segment_per_packet(ns: str, dev: str) -> bool:
    """Make ``dev`` hand the qdisc one TCP segment per packet (``gso_max_segs 1``); False where this
    ``ip`` or kernel refuses.

    A veth offers segmentation offload, so TCP hands it packets of up to 64 kB, and htb lets a
    whole one through whenever its bucket is not in debt (it charges after sending). A 33 kB
    pipeline message after a pause of a few tens of ms then crossed a 10 Mbit/s "link" in 0.3 ms
    instead of 23.5 ms; a real 10 Mbit/s interface sends it at its rate."""
    try:
        run(["ip", "-n", ns, "link", "set", dev, "gso_max_segs", "1"])
    except CommandFailed:  # an old ip or kernel: the caller says what that means
        return False
    return True


def set_master(ns: str, dev: str, bridge: str) -> None:
    run(["ip", "-n", ns, "link", "set", dev, "master", bridge])


def up(ns: str, dev: str) -> None:
    run(["ip", "-n", ns, "link", "set", dev, "up"])


def add_address(ns: str, dev: str, cidr: str) -> None:
    run(["ip", "-n", ns, "addr", "add", cidr, "dev", dev])


def exec_argv(ns: str, argv: list[str]) -> list[str]:
    from .system import tool
    return [tool("ip"), "netns", "exec", ns, *argv]


def sysctl(ns: str, key: str, value: str | None = None) -> str:
    """A per-namespace sysctl (``net.ipv4.tcp_congestion_control``): set it when ``value`` is
    given, and return what the namespace now has. A host namespace starts with the machine's
    TCP settings, which need not be those of the devices it stands for (a machine on BBR
    emulating Raspberry Pis on CUBIC); a namespace may only pick congestion controls listed in
    ``/proc/sys/net/ipv4/tcp_allowed_congestion_control``."""
    if value is not None:
        proc = run(["ip", "netns", "exec", ns, "sysctl", "-qw", f"{key}={value}"], check=False)
        if proc.returncode != 0:
            raise ValueError(f"sysctl {key}={value} in namespace {ns}: {proc.stderr.strip() or proc.stdout.strip()}")
    return run(["ip", "netns", "exec", ns, "sysctl", "-n", key]).stdout.strip()
