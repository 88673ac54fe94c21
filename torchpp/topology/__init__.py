"""Network topologies: a file format, templates, routes and the fair share of shared links.

- :mod:`.graph`: :class:`Topology` (``torchpp.topology/1`` JSON) and seed 001's text format.
- :mod:`.templates`: star, two-tier tree, shared medium (Wi-Fi), Spectrum-X rails, NVLink domains.
- :mod:`.routes`: :class:`Network`: directed link resources and routes between hosts.
- :mod:`.fairshare`: max-min fair rates of transfers that share resources.
- :mod:`.collectives`: ring and tree all-reduce, all-gather, reduce-scatter as flow bundles.
- :mod:`.wire`: the TCP goodput a link's wire (or shaper) rate leaves for transfers.

Below the simulator and the planner: it imports only :mod:`torchpp.formats`.
"""
from .graph import Link, Topology
from .routes import Network

__all__ = ["Link", "Network", "Topology"]
