"""The emulated cluster against its star: measured goodput, and per-namespace TCP settings.

Needs root (network namespaces, tc, cgroups); skipped with the reason otherwise. The cluster
is taken down in a `finally`, and the test then checks that nothing it made is left.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from torchpp.cluster import cgroups, cluster, netns
from torchpp.cluster.config import ClusterConfig
from torchpp.cluster.system import CAP_NET_ADMIN, CAP_SYS_ADMIN, STATE_DIR, has_cap, tool
from torchpp.cluster.topology import star_of
from torchpp.formats import Bandwidth
from torchpp.topology import Network

ROOT = Path(__file__).resolve().parents[1]
NAME = "tpt4star"


def _why_not() -> str | None:
    if os.geteuid() != 0 or not (has_cap(CAP_SYS_ADMIN) and has_cap(CAP_NET_ADMIN)):
        return "needs root with CAP_SYS_ADMIN and CAP_NET_ADMIN (network namespaces, tc, cgroups)"
    try:
        tool("ip"), tool("tc"), tool("sysctl")
    except Exception as e:  # noqa: BLE001
        return str(e)
    return None


pytestmark = [pytest.mark.root, pytest.mark.skipif(_why_not() is not None, reason=str(_why_not()))]


def leftovers(name: str = NAME) -> dict:
    state = STATE_DIR / f"cluster-{name}.json"
    return {**cluster.leftovers(name), "state": [str(state)] if state.exists() else []}


def _star(tmp_path, monkeypatch, name: str, subnet: str, port: int, hosts: tuple[str, ...]):
    """A star of ``hosts``, each 0.5 core and shaped to 40 Mbit/s both ways; taken down afterwards
    and checked to leave nothing behind."""
    if any(leftovers(name).values()):
        pytest.skip(f"cluster {name} already exists ({leftovers(name)}); `torchpp cluster down -n {name}` removes it")
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    p = tmp_path / f"{name}.json"
    p.write_text(json.dumps({"name": name, "subnet": subnet, "master_port": port, "cpu_period_ms": 10,
                             "hosts": [{"name": n, "cpu": 0.5, "memory": "2G", "rate": "40mbit", "down_rate": "40mbit"}
                                       for n in hosts]}))
    cfg = ClusterConfig.load(p)
    try:
        cluster.up(cfg, log=lambda *_: None)
        yield cfg
    finally:
        cluster.down(cfg.name, log=lambda *_: None)
        assert not any(leftovers(name).values()), f"left behind: {leftovers(name)}"


@pytest.fixture
def star_cluster(tmp_path, monkeypatch):
    yield from _star(tmp_path, monkeypatch, NAME, "10.77.43.0/24", 29543, ("a", "b"))


def test_host_namespaces_take_their_own_tcp_congestion_control(star_cluster):
    machine = Path("/proc/sys/net/ipv4/tcp_congestion_control").read_text().strip()
    allowed = Path("/proc/sys/net/ipv4/tcp_allowed_congestion_control").read_text().split()
    if "reno" not in allowed:
        pytest.skip(f"reno is not in tcp_allowed_congestion_control ({allowed})")
    ns = star_cluster.host_ns(0)
    assert netns.sysctl(ns, "net.ipv4.tcp_congestion_control", "reno") == "reno"
    assert netns.sysctl(ns, "net.ipv4.tcp_congestion_control") == "reno"
    assert Path("/proc/sys/net/ipv4/tcp_congestion_control").read_text().strip() == machine  # ours only
    with pytest.raises(ValueError, match="nosuchcc"):
        netns.sysctl(ns, "net.ipv4.tcp_congestion_control", "nosuchcc")


def test_config_sets_hosts_tcp_and_cpu_period(star_cluster):
    """``tcp: auto`` gives every host a loss-based TCP; ``cpu_period_ms`` reaches each host's group."""
    allowed = Path("/proc/sys/net/ipv4/tcp_allowed_congestion_control").read_text().split()
    want = "cubic" if "cubic" in allowed else "reno"
    for i in range(len(star_cluster.hosts)):
        assert netns.sysctl(star_cluster.host_ns(i), "net.ipv4.tcp_congestion_control") == want
        lim = cgroups.existing(star_cluster.cgroup_name(i)).limits()
        period = lim.get("cpu.cfs_period_us") or lim.get("cpu.max", "").split()[-1]
        assert int(period) == 10_000, lim


@pytest.mark.parametrize("sizes,repeats", [("512K,2M", "3"), ("64K,512K", "2")])
def test_gloo_goodput_is_the_stars_link_rate(star_cluster, tmp_path, sizes, repeats):
    """The star's links offer TCP goodput (1448/1514 of the tc rate): gloo p2p within 3% of it, also
    from two small sizes timed twice (a first message that found its link's bucket refilled read a
    10 Mbit/s link 5% slow)."""
    out = tmp_path / "probe"
    rc, res = cluster.run(NAME, [sys.executable, "-m", "torchpp", "bandwidth", "probe", "--out-dir", str(out),
                                 "--sizes", sizes, "--repeats", repeats, "--timeout", "120"],
                          tmp_path / "logs", timeout=240, log=lambda *_: None)
    assert rc == 0, cluster.tail(res[0].log) + cluster.tail(res[1].log)
    want = Network(star_of(star_cluster)).rate(0, 1)
    raw = Network(star_of(star_cluster, wire=False)).rate(0, 1)
    for key, got in Bandwidth.load(out / "bandwidth.json").bytes_per_sec.items():
        assert abs(got / want - 1) <= 0.03, f"{key}: {got:.0f} B/s, star link {want:.0f} B/s (tc rate {raw:.0f})"


@pytest.fixture
def star3(tmp_path, monkeypatch):
    """Three hosts on one switch, each interface shaped to 40 Mbit/s both ways."""
    yield from _star(tmp_path, monkeypatch, "tpt3fan", "10.77.44.0/24", 29544, ("a", "b", "c"))


def test_the_probe_finds_each_hosts_one_interface(star3, tmp_path):
    """Each host's veth is shaped as a whole, so its sends to two peers at once share one link's rate:
    the probe's fan-out and fan-in read about one link (measured 1.00-1.07), not two."""
    out = tmp_path / "probe"
    rc, res = cluster.run(star3.name, [sys.executable, "-m", "torchpp", "bandwidth", "probe", "--out-dir", str(out),
                                       "--sizes", "512K,2M", "--repeats", "2", "--timeout", "120"],
                          tmp_path / "logs", timeout=300, log=lambda *_: None)
    assert rc == 0, "".join(cluster.tail(r.log) for r in res)
    bw = Bandwidth.load(out / "bandwidth.json")
    assert set(bw.egress_bytes_per_sec) == set(bw.ingress_bytes_per_sec) == {"a", "b", "c"}
    for h in "abc":
        link = max(bw.rate(h, o) for o in "abc" if o != h)
        for what, got in (("egress", bw.egress(h)), ("ingress", bw.ingress(h))):
            assert 0.85 <= got / link <= 1.25, f"{h} {what}: {got:.0f} B/s against one link's {link:.0f} B/s"


_PAUSED_MESSAGES = r"""
import datetime, os, statistics, time
import torch, torch.distributed as dist
from torchpp.runtime.rendezvous import env_store
rank = int(os.environ["RANK"])
dist.init_process_group("gloo", store=env_store(rank, 2, datetime.timedelta(seconds=60)), rank=rank, world_size=2)
pg = dist.distributed_c10d._get_default_group()
buf = torch.empty(33280 // 4)  # an int8 activation of 2 x 64 tokens of 256: 33,280 bytes
stamps = []
for _ in range(6):
    dist.barrier()
    if rank == 1:
        work = pg.recv([buf], 0, 5)  # posted ahead, as the runtime posts its receives
        work.wait()
        stamps.append(time.perf_counter())  # arrived
    else:
        time.sleep(0.05)
        stamps.append(time.perf_counter())  # posted (the namespaces share the machine's clock)
        pg.send([buf], 1, 5).wait()
    dist.barrier()
got = [None, None]
dist.all_gather_object(got, stamps)
if rank == 0:
    print("transit_ms", statistics.median(1e3 * (b - a) for a, b in zip(got[0][2:], got[1][2:])), flush=True)
dist.barrier()
os._exit(0)  # gloo's threads can abort a normal exit once the peer has gone
"""


def test_a_message_after_a_pause_crosses_at_the_links_rate(star_cluster, tmp_path):
    """33 kB sent after 50 ms of quiet into a receive posted ahead (a pipeline's int8 activation):
    with segmentation offload a veth handed htb the whole message as one packet, which passed at
    once (0.37 ms here, 0.3 ms on a 10 Mbit/s link, once TCP's window had grown); one segment per
    packet, it takes its bytes over the rate less the shaper's burst (5.3 ms)."""
    script = tmp_path / "paused.py"
    script.write_text(_PAUSED_MESSAGES)
    rc, res = cluster.run(NAME, [sys.executable, str(script)], tmp_path / "logs", timeout=120, log=lambda *_: None)
    assert rc == 0, "\n".join(Path(r.log).read_text()[-3000:] for r in res)
    line = next(l for l in Path(res[0].log).read_text().splitlines() if l.startswith("transit_ms"))
    transit = float(line.split()[1]) / 1e3
    rate = Network(star_of(star_cluster)).rate(0, 1)
    burst = 4 * 1514  # at least what tc.py gives htb (2 ms of 40 Mbit/s is 10 kB)
    floor = (33280 - max(burst, rate * 0.002)) / rate
    assert transit >= 0.7 * floor, f"33 kB crossed in {transit * 1e3:.2f} ms, the link needs {floor * 1e3:.1f} ms"
