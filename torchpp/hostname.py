"""The one rule that names this host in every file torchpp writes (a leaf: imports only ``validate``).

Profiles (``layers_<host>.json``), speed checks, ``bandwidth probe``'s links, traces and plans
name hosts, and a session's files join only when they agree. With several hosts played on one
machine (``torchpp cluster run``, the elastic driver, a hand-made test) every process shares the
machine's hostname, so the name is, first to last:

1. the command's ``--host`` flag,
2. ``TORCHPP_HOST`` in the environment,
3. ``HOST`` in the environment (what ``torchpp cluster run`` and the elastic driver set per rank),
4. the machine's hostname.

A name from the flag or the environment must be a safe host name (``validate.host_name``); the
hostname is taken as the system reports it.
"""
from __future__ import annotations

import os
import socket
from typing import Mapping

from . import validate as V

ENV_VARS = ("TORCHPP_HOST", "HOST")
"""Environment variables that name the host, in the order they are read."""


def machine_name() -> str:
    """The machine's own hostname: what processes sharing one file system have in common (who of
    several ranks on one machine writes a shared file), not the host name files carry."""
    return socket.gethostname()


def host_name(explicit: str | None = None, env: Mapping[str, str] | None = None, default: str | None = None) -> str:
    """This process's host name by the rule above; ``default`` replaces the hostname as the last
    resort (a speed check keeps its reference profile's host). ValueError names the flag or variable."""
    if explicit:
        return V.host_name(explicit, "--host")
    env = os.environ if env is None else env
    for var in ENV_VARS:
        value = env.get(var, "")
        if value:
            return V.host_name(value, var)
    return default or machine_name()


def host_source(explicit: str | None = None, env: Mapping[str, str] | None = None) -> str:
    """Where :func:`host_name` took the name from: ``--host``, a variable's name, or ``hostname``."""
    if explicit:
        return "--host"
    env = os.environ if env is None else env
    return next((var for var in ENV_VARS if env.get(var)), "hostname")
