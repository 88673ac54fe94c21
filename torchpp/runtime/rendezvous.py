"""The rendezvous store, listening only on the address the user gave (``MASTER_ADDR``).

torch's ``env://`` rendezvous starts rank 0's ``TCPStore`` server on every interface
(``::``, dual-stack) whatever ``MASTER_ADDR`` says, so anyone who can reach the host can
write keys into a training run. ``TCPStore`` takes ``master_listen_fd``, a socket already
bound and listening; here rank 0 binds that socket to ``MASTER_ADDR:MASTER_PORT`` itself.
Under a torchelastic agent (torchrun) the agent owns the server and the ranks are clients;
then nothing here changes where it listens.
"""
from __future__ import annotations

import datetime
import os
import socket

import torch.distributed as dist


class RendezvousError(RuntimeError):
    """MASTER_ADDR/MASTER_PORT are missing or malformed, or the address cannot be bound."""


def master_endpoint() -> tuple[str, int]:
    """``MASTER_ADDR`` and ``MASTER_PORT`` from the environment, checked."""
    addr, port = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
    if not addr:
        raise RendezvousError("MASTER_ADDR: expected the address of rank 0's host, got nothing")
    try:
        p = int(port)
    except ValueError:
        raise RendezvousError(f"MASTER_PORT: expected a port number, got {port!r}") from None
    if not 0 < p < 65536:
        raise RendezvousError(f"MASTER_PORT: expected 1..65535, got {p}")
    return addr, p


def listening_socket(addr: str, port: int) -> socket.socket:
    """A TCP socket bound to ``addr:port`` only (IPv4 or IPv6, as ``addr`` resolves) and listening."""
    try:
        family, kind, proto, _, sockaddr = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        raise RendezvousError(f"MASTER_ADDR: cannot resolve {addr!r}: {e}") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.listen(512)
    except OSError as e:
        sock.close()
        raise RendezvousError(f"MASTER_ADDR/MASTER_PORT: cannot listen on {addr}:{port}: {e.strerror or e}") from None
    return sock


def uses_agent_store() -> bool:
    """True under a torchelastic agent, which hosts the store itself."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def env_store(rank: int, world_size: int, timeout: datetime.timedelta) -> dist.Store:
    """The store of ``env://``, but rank 0's server bound to ``MASTER_ADDR`` only."""
    addr, port = master_endpoint()
    if rank != 0 or uses_agent_store():
        return dist.TCPStore(addr, port, world_size, False, timeout)
    sock = listening_socket(addr, port)
    fd = sock.detach()  # the store's server owns the descriptor from here on
    try:
        return dist.TCPStore(addr, port, world_size, True, timeout, master_listen_fd=fd)
    except BaseException:
        try:
            os.close(fd)
        except OSError:  # the server had taken it (it closes it itself when waiting for clients fails)
            pass
        raise
