"""Privilege checks and external commands (`ip`, `tc`) with errors that say what is missing.

Emulated clusters change kernel state (cgroups, qdiscs, network namespaces). Every entry point
checks the exact capability or path it needs first and refuses with one line naming it, rather
than failing half-way with an opaque ``EPERM``. Nothing here asks for or accepts a password.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

PREFIX = "torchpp"
"""Every namespace, cgroup and state file torchpp creates starts with this, so clean-up can
remove exactly what torchpp made and nothing else."""

STATE_DIR = Path(os.environ.get("TORCHPP_STATE_DIR", "/run/torchpp"))

# Capability bit numbers from linux/capability.h.
CAP_NET_ADMIN = 12
CAP_SYS_ADMIN = 21
_CAP_NAMES = {CAP_NET_ADMIN: "CAP_NET_ADMIN", CAP_SYS_ADMIN: "CAP_SYS_ADMIN"}


class NotPermitted(RuntimeError):
    """This process lacks a capability, a writable path or a tool the operation needs."""


class CommandFailed(RuntimeError):
    """An external command (ip, tc) exited non-zero; the message has the command and its stderr."""

    def __init__(self, cmd: list[str], rc: int, stderr: str):
        self.cmd, self.rc, self.stderr = cmd, rc, stderr.strip()
        super().__init__(f"`{' '.join(cmd)}` failed (exit {rc}): {self.stderr or 'no message'}")


def effective_caps() -> int:
    """The CapEff mask of this process (0 where /proc is unreadable)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("CapEff:"):
                return int(line.split()[1], 16)
    except OSError:
        pass
    return 0


def has_cap(cap: int) -> bool:
    return bool(effective_caps() >> cap & 1)


def require_caps(what: str, *caps: int) -> None:
    """Raise NotPermitted naming every capability in ``caps`` this process lacks."""
    missing = [_CAP_NAMES.get(c, f"capability {c}") for c in caps if not has_cap(c)]
    if missing:
        raise NotPermitted(f"{what} needs {' and '.join(missing)} (run as root); "
                           f"this process (uid {os.geteuid()}) does not have {', '.join(missing)}")


def require_writable(what: str, path: Path) -> None:
    if not path.exists():
        raise NotPermitted(f"{what} needs {path}, which does not exist on this machine")
    if not os.access(path, os.W_OK):
        raise NotPermitted(f"{what} needs write access to {path} (run as root); uid {os.geteuid()} has none")


def tool(name: str) -> str:
    """Path of an administration binary; /usr/sbin and /sbin are searched even when not on PATH."""
    found = shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin:/usr/bin:/bin")
    if not found:
        raise NotPermitted(f"the `{name}` command (package iproute2) is not installed")
    return found


def run(cmd: list[str], check: bool = True, timeout: float = 30.0) -> subprocess.CompletedProcess:
    """Run an administration command; its first word is resolved with tool()."""
    full = [tool(cmd[0]), *cmd[1:]]
    proc = subprocess.run(full, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise CommandFailed([cmd[0], *cmd[1:]], proc.returncode, proc.stderr)
    return proc
