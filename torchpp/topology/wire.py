"""What a link's rate leaves for the bytes a transfer moves: TCP/IPv4 over Ethernet framing.

A shaper or a NIC is rated in bits on the wire; gloo's messages travel as TCP segments of at
most ``mtu − 52`` payload bytes (IPv4 20 + TCP 20 + timestamps 12), each carried in a frame of
``mtu + framing`` bytes. The goodput a transfer sees is the rate times their ratio. ``framing``
is what the rate counts beyond the IP packet: tc's htb counts the 14-byte Ethernet header
(:data:`TC_FRAMING`, the emulated cluster); a physical Ethernet link also spends the preamble,
frame check sequence and inter-frame gap (:data:`ETHERNET_FRAMING`, 38 bytes).

On the emulated cluster this is measured: ``torchpp bandwidth probe`` between two hosts shaped
to 40 Mbit/s got 0.9569 and 0.9565 of the rate, and 1448 / 1514 = 0.9564.
"""
from __future__ import annotations

IP_TCP_HEADERS = 52
"""IPv4 (20) + TCP (20) + the timestamp option Linux sends by default (12)."""
TC_FRAMING = 14
"""Bytes per frame a tc shaper counts beyond the IP packet: the Ethernet header."""
ETHERNET_FRAMING = 38
"""Ethernet header 14 + FCS 4 + preamble 8 + inter-frame gap 12: what a physical link spends."""


def goodput_fraction(mtu: int = 1500, framing: int = TC_FRAMING, headers: int = IP_TCP_HEADERS) -> float:
    """Payload bytes per byte of rate for a bulk TCP transfer in full-size segments."""
    if mtu <= headers or framing < 0:
        raise ValueError(f"goodput: expected an MTU above the {headers} header bytes and framing >= 0, got mtu {mtu}, "
                         f"framing {framing}")
    return (mtu - headers) / (mtu + framing)


def goodput_gbps(line_gbps: float, mtu: int = 1500, framing: int = TC_FRAMING) -> float:
    """The rate a topology link offers transfers when its wire (or shaper) runs at ``line_gbps``."""
    return line_gbps * goodput_fraction(mtu, framing)


__all__ = ["ETHERNET_FRAMING", "IP_TCP_HEADERS", "TC_FRAMING", "goodput_fraction", "goodput_gbps"]
