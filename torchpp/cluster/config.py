"""Cluster description (configs/cluster/<name>.json), validated with file + field errors.

```
{"format": "torchpp.cluster/1", "name": "pi3", "subnet": "10.77.0.0/24", "master_port": 29500, "tcp": "auto",
 "cpu_period_ms": 100,
 "hosts": [{"name": "pi0", "cpu": 0.5, "memory": "2G", "rate": "50mbit", "delay": "2ms",
            "down_rate": "100mbit", "down_delay": "0ms", "loss": "0%"}, ...],
 "links": [{"src": "pi0", "dst": "pi1", "rate": "10mbit", "delay": "5ms"}]}
```

``rate``/``delay``/``loss`` shape what a host sends (its uplink); ``down_*`` what it receives
(the switch port towards it), so links may be asymmetric. ``links`` override the uplink for one
ordered pair. ``tcp`` is the hosts' TCP congestion control: ``auto`` (the default) picks a
loss-based one, ``cubic`` where a namespace may use it, else ``reno``, as the small devices
emulated here run CUBIC; ``machine`` keeps the machine's (often BBR, under which a pipeline's
short messages in both directions ran 12% slower than the link allows); any other name is
used as given. ``cpu_period_ms`` is the period of every host's CPU quota (1 to 1000; default
the kernel's 100 ms): a short one makes a host a slower CPU at every instant, so a rank that
mostly waits on its links cannot run its next pass at a whole core's speed out of the quota it
saved (the 4-host topology check measured +13.5% at 100 ms, +0.4% at 10 ms), but small quotas
are delivered less exactly on a busy machine. ``cpu_period_cost_ms`` (default 0) is the CPU time a
throttled host loses in every period (refilling its caches, waking up) before it does useful work:
at a 10 ms period a 0.25-core host's torch steps did ~15% less work per CPU-second than a 0.7-core
one's, so the small hosts ran below their speed ratio. With it each host's quota becomes
``s * cpu + cost / period`` cores, ``s`` keeping the quotas' sum: the work each host does per
period stays in the ratio of its ``cpu``. ``steady_cpu`` (default false) pins every host to one core
of the machine and fills its idle time with an idle-priority spinner in its own group: a quota
refills every period whether or not the host used it, so a host that waited on its links ran its next
short pass at a whole core's speed out of the saved quota (a 0.25-core host's 5 ms passes at 3x its
quota's pace, measured), and a pipeline stage with little work looked faster than its profile —
the re-plan then gave it more work and the step got slower. With the spinner the idle time uses the
quota up, so a pass runs at the quota's pace whatever came before, as on a small device; the hosts'
quotas must pack onto the machine's cores. Off in the shipped configs: with two hosts on each of
this machine's two cores a pass also waits for the quota's refill and the other host, and the demo's
predictions got worse (docs/cluster.md). Every field but ``name`` and ``hosts[].name`` is optional.
"""
from __future__ import annotations

import dataclasses
import ipaddress
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any

from ..formats import FormatError, Reader, read_json
from .system import PREFIX
from .tc import Egress, Shape
from .cgroups import check_cpu, check_memory
from .units import parse_duration, parse_fraction, parse_rate, parse_size


def memory_limit(text: str | int) -> int:
    """A memory limit as written in a config or on the command line (``"2G"``), within the machine.

    A bare number is bytes, so ``"memory": 1`` is one byte and refused; ``1e30G`` is refused
    rather than passed to the kernel, where it wrapped to 0 and SIGKILLed every process."""
    n = parse_size(text)
    try:
        return check_memory(n)
    except ValueError:
        from .cgroups import machine_memory
        raise ValueError(f"expected a memory limit between 16M and this machine's "
                         f"{machine_memory() / 2**30:.1f}G, got {text!r}") from None

CLUSTER_KIND, CLUSTER_VERSION = "cluster", 1
_NAME = re.compile(r"[a-z0-9]{1,12}")
_HOST = re.compile(r"[a-z0-9][a-z0-9-]{0,15}")
_TCP = re.compile(r"[a-z][a-z0-9_]{0,15}")
HOST_DEV = "eth0"


@dataclass(kw_only=True)
class HostSpec:
    name: str
    cpu: float | None = None
    """CPU quota in cores (0.5 = half of one core); None = unlimited."""
    memory: int | None = None
    """Memory limit in bytes; None = unlimited."""
    up: Shape = field(default_factory=Shape)
    down: Shape = field(default_factory=Shape)


@dataclass(kw_only=True)
class LinkSpec:
    src: str
    dst: str
    shape: Shape


@dataclass(kw_only=True)
class ClusterConfig:
    name: str
    hosts: list[HostSpec]
    links: list[LinkSpec] = field(default_factory=list)
    subnet: str = "10.77.0.0/24"
    """Private subnet used only inside the cluster's own namespaces."""
    master_port: int = 29500
    tcp: str = "auto"
    cpu_period_ms: float = 100.0
    """The hosts' TCP congestion control (module docstring); resolved by ``cluster.host_tcp``."""
    cpu_period_cost_ms: float = 0.0
    """CPU a throttled host loses per quota period before useful work (module docstring)."""
    steady_cpu: bool = False
    """Pin every host to a core and fill its idle time (module docstring; :meth:`cores`)."""
    source: str = "<config>"

    def cores(self, ncpu: int) -> list[int]:
        """With ``steady_cpu``: the machine core each host is pinned to, packing the quotas onto
        ``ncpu`` cores (largest first, each onto the core with the most room)."""
        quotas = self.quotas()
        if any(q is None for q in quotas):
            raise ValueError(f"{self.source}: steady_cpu needs a cpu quota on every host "
                             f"(none on {', '.join(h.name for h, q in zip(self.hosts, quotas) if q is None)})")
        room, out = [1.0] * ncpu, [0] * len(quotas)
        for i in sorted(range(len(quotas)), key=lambda i: -quotas[i]):
            core = max(range(ncpu), key=lambda c: room[c])
            if quotas[i] > room[core] + 1e-9:
                raise ValueError(f"{self.source}: steady_cpu pins every host to one core, but the quotas "
                                 f"({', '.join(f'{h.name} {q:.3g}' for h, q in zip(self.hosts, quotas))}) do not "
                                 f"pack onto this machine's {ncpu} core(s); set steady_cpu to false")
            room[core] -= quotas[i]
            out[i] = core
        return out

    def quotas(self) -> list[float | None]:
        """Cores each host's cgroup is given: ``cpu`` itself, or with ``cpu_period_cost_ms`` the
        scaled share plus the per-period cost, so that quota minus cost keeps ``cpu``'s ratios and
        the quotas keep their sum (module docstring)."""
        limited = [h.cpu for h in self.hosts if h.cpu is not None]
        if not self.cpu_period_cost_ms or not limited:
            return [h.cpu for h in self.hosts]
        cost = self.cpu_period_cost_ms / self.cpu_period_ms
        scale = (sum(limited) - cost * len(limited)) / sum(limited)
        return [None if h.cpu is None else scale * h.cpu + cost for h in self.hosts]

    # ------------------------------------------------------------------ naming
    @property
    def switch_ns(self) -> str:
        return f"{PREFIX}-{self.name}-sw"

    def host_ns(self, i: int) -> str:
        return f"{PREFIX}-{self.name}-{self.hosts[i].name}"

    def cgroup_name(self, i: int) -> str:
        return f"cluster-{self.name}/{self.hosts[i].name}"

    def switch_port(self, i: int) -> str:
        return f"h{i}"

    def address(self, i: int) -> str:
        return str(ipaddress.ip_network(self.subnet)[i + 1])

    def cidr(self, i: int) -> str:
        return f"{self.address(i)}/{ipaddress.ip_network(self.subnet).prefixlen}"

    def index(self, host: str) -> int:
        return [h.name for h in self.hosts].index(host)

    # ------------------------------------------------------------------ shaping
    def uplink(self, i: int) -> Egress:
        per = {self.address(self.index(l.dst)): l.shape for l in self.links if l.src == self.hosts[i].name}
        return Egress(dev=HOST_DEV, netns=self.host_ns(i), default=self.hosts[i].up, per_dst=per)

    def downlink(self, i: int) -> Egress:
        return Egress(dev=self.switch_port(i), netns=self.switch_ns, default=self.hosts[i].down)

    @property
    def needs_netem(self) -> bool:
        return any(self.uplink(i).needs_netem or self.downlink(i).needs_netem for i in range(len(self.hosts)))

    def without_netem(self) -> "ClusterConfig":
        """The same cluster with delays and losses dropped (for kernels without netem)."""
        strip = lambda s: Shape(rate=s.rate)  # noqa: E731
        return dataclasses.replace(
            self, hosts=[dataclasses.replace(h, up=strip(h.up), down=strip(h.down)) for h in self.hosts],
            links=[dataclasses.replace(l, shape=strip(l.shape)) for l in self.links])

    def with_rate(self, rate: float) -> "ClusterConfig":
        """Every uplink and downlink at ``rate`` bit/s (pair overrides dropped): one switch speed."""
        re_rate = lambda s: dataclasses.replace(s, rate=rate)  # noqa: E731
        return dataclasses.replace(
            self, hosts=[dataclasses.replace(h, up=re_rate(h.up), down=re_rate(h.down)) for h in self.hosts],
            links=[])

    # ------------------------------------------------------------------ parsing
    @staticmethod
    def parse(data: Any, source: str) -> "ClusterConfig":
        r = Reader(data, source)
        if r.has("format") and r.raw("format") != f"torchpp.{CLUSTER_KIND}/{CLUSTER_VERSION}":
            raise r.fail("format", f"'torchpp.{CLUSTER_KIND}/{CLUSTER_VERSION}'", r.raw("format"))
        name = r.str("name")
        if not _NAME.fullmatch(name):
            raise r.fail("name", "1-12 lowercase letters or digits (it prefixes namespace names)", name)
        subnet = r.str("subnet", "10.77.0.0/24")
        try:
            net = ipaddress.ip_network(subnet)
        except ValueError:
            raise r.fail("subnet", "an IPv4 network like '10.77.0.0/24'", subnet) from None
        if net.version != 4 or not net.is_private:
            raise r.fail("subnet", "a private IPv4 network (traffic stays inside the cluster's namespaces)", subnet)
        hosts = []
        for h in r.objs("hosts", min_len=1):
            hname = h.str("name")
            if not _HOST.fullmatch(hname):
                raise h.fail("name", "1-16 lowercase letters, digits or '-' (starting with a letter or digit)", hname)
            if hname in [x.name for x in hosts]:
                raise h.fail("name", "a name not used by another host", hname)
            cpu = _parsed(h, "cpu", check_cpu) if h.has("cpu") else None
            hosts.append(HostSpec(name=hname, cpu=cpu, memory=_parsed(h, "memory", memory_limit),
                                  up=_shape(h, ""), down=_shape(h, "down_")))
        if len(hosts) > net.num_addresses - 2:
            raise r.fail("hosts", f"at most {net.num_addresses - 2} hosts for subnet {subnet}", len(hosts))
        names = [h.name for h in hosts]
        links = []
        for l in r.objs("links", []):
            src, dst = l.str("src", choices=names), l.str("dst", choices=names)
            if src == dst:
                raise l.fail("dst", "a host other than src", dst)
            if any(x.src == src and x.dst == dst for x in links):
                raise l.fail("dst", f"one entry per (src, dst) pair; {src} -> {dst} is given twice", dst)
            links.append(LinkSpec(src=src, dst=dst, shape=_shape(l, "")))
        port = r.int("master_port", 29500, min_value=1024)
        if port > 65535:
            raise r.fail("master_port", "a port number 1024..65535", port)
        tcp = r.str("tcp", "auto")
        if not _TCP.fullmatch(tcp):
            raise r.fail("tcp", "'auto', 'machine' or a congestion control name like 'cubic' or 'reno'", tcp)
        period = r.float("cpu_period_ms", 100.0)
        if not 1.0 <= period <= 1000.0:
            raise r.fail("cpu_period_ms", "a CPU quota period of 1 to 1000 ms", period)
        cost = r.float("cpu_period_cost_ms", 0.0)
        limited = [h.cpu for h in hosts if h.cpu is not None]
        # the compensation comes out of the quotas' sum: it must leave every host a positive share
        most = period * sum(limited) / len(limited) if limited else math.inf
        if not 0.0 <= cost < most:
            raise r.fail("cpu_period_cost_ms", f"CPU lost per quota period, from 0 to under {most:.3g} ms "
                         "(the hosts' mean quota per period)", cost)
        steady = r.bool("steady_cpu", False)
        return ClusterConfig(name=name, hosts=hosts, links=links, subnet=subnet, master_port=port, tcp=tcp,
                             cpu_period_ms=period, cpu_period_cost_ms=cost, steady_cpu=steady, source=source)

    @staticmethod
    def load(path: str | os.PathLike) -> "ClusterConfig":
        return ClusterConfig.parse(read_json(path), str(path))


def _parsed(r: Reader, key: str, parse, default=None):
    if not r.has(key):
        return default
    try:
        return parse(r.raw(key))
    except ValueError as e:
        raise FormatError(r.source, r._p(key), str(e).removeprefix("expected ")) from None


MAX_RATE_BITS = 1e12
"""Fastest link a config may ask for (1 Tbit/s): tc takes 32-bit byte rates beyond which it wraps."""
MAX_DELAY_S = 60.0


def _rate(text: str | int | float) -> float:
    v = parse_rate(text)
    if not v <= MAX_RATE_BITS:
        raise ValueError(f"expected a rate up to 1000gbit, got {text!r}")
    return v


def _duration(text: str | int | float) -> float:
    v = parse_duration(text)
    if not v <= MAX_DELAY_S:
        raise ValueError(f"expected a delay up to {MAX_DELAY_S:g}s, got {text!r}")
    return v


def _shape(r: Reader, prefix: str) -> Shape:
    return Shape(rate=_parsed(r, f"{prefix}rate", _rate), delay=_parsed(r, f"{prefix}delay", _duration, 0.0),
                 jitter=_parsed(r, f"{prefix}jitter", _duration, 0.0),
                 loss=_parsed(r, f"{prefix}loss", parse_fraction, 0.0))
