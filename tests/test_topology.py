"""Topologies: formats, templates' routes, max-min sharing and every collective against its closed form."""
import pytest

from torchpp.formats import FormatError
from torchpp.topology import Topology
from torchpp.topology import collectives as C
from torchpp.topology.fairshare import maxmin
from torchpp.topology.graph import read_simai, write_simai
from torchpp.topology.routes import Network
from torchpp.topology.templates import nvl, spectrum_x, star, tree, wifi

GB = 1e9
BW = 8.0  # Gbit/s: 1e9 bytes/s


def hosts(n):
    return list(range(n))


@pytest.mark.parametrize("n", [2, 3, 4, 8, 13])
def test_ring_allreduce_on_a_star(n):
    net = Network(star(n, BW))
    assert C.alone(net, C.allreduce(net, hosts(n), GB)) == pytest.approx(2 * (n - 1) / n)


@pytest.mark.parametrize("n", [2, 5, 16])
def test_allgather_and_reduce_scatter_on_a_star(n):
    net = Network(star(n, BW))
    assert C.alone(net, C.allgather(net, hosts(n), GB)) == pytest.approx((n - 1) / n)
    assert C.alone(net, C.reduce_scatter(net, hosts(n), GB)) == pytest.approx((n - 1) / n)


@pytest.mark.parametrize("n,c", [(2, 1), (3, 2), (4, 2), (5, 3), (16, 3)])
def test_tree_allreduce_on_a_star(n, c):
    net = Network(star(n, BW))
    assert C.alone(net, C.allreduce(net, hosts(n), GB, "tree")) == pytest.approx(c)


def test_latency_terms():
    n, lat = 4, 1e-3
    net = Network(star(n, BW, lat))  # a route crosses two links
    assert C.alone(net, C.allreduce(net, hosts(n), GB)) == pytest.approx(1.5 + 2 * (n - 1) * 2 * lat)
    depth = 2  # hosts 0 <- 1 <- 3, 0 <- 2 (host 1 sends to its parent and one child)
    assert C.alone(net, C.allreduce(net, hosts(n), GB, "tree")) == pytest.approx(2 + 2 * depth * 2 * lat)


@pytest.mark.parametrize("n", [2, 4, 6])
def test_wifi_shares_one_channel(n):
    net = Network(wifi(n, BW))  # every flow crosses the air twice (up to the access point, down again)
    assert C.alone(net, C.allreduce(net, hosts(n), GB)) == pytest.approx(4 * (n - 1))
    assert C.alone(net, C.transfer(net, 0, 1, GB)) == pytest.approx(2.0)
    two = C.simultaneous(net, [C.transfer(net, 0, 1, GB), C.transfer(net, 1, 0, GB)])
    assert two == pytest.approx([4.0, 4.0])


def test_tree_oversubscription():
    k, os_ = 4, 4.0
    net = Network(tree(8, k, BW, os_))  # leaf uplink: 4 hosts · 1e9 / 4 = 1e9 bytes/s
    # four hosts of leaf 0 each to a host of leaf 1: they share leaf 0's uplink
    flows = [C.transfer(net, i, 4 + i, GB) for i in range(4)]
    assert C.simultaneous(net, flows) == pytest.approx([4.0] * 4)
    # within a leaf every host pair has its own links
    assert C.simultaneous(net, [C.transfer(net, 0, 1, GB), C.transfer(net, 2, 3, GB)]) == pytest.approx([1.0, 1.0])
    # ring all-reduce over both leaves: the two flows crossing leaves fit the uplinks; host links bound it
    assert C.alone(net, C.allreduce(net, hosts(8), GB)) == pytest.approx(2 * 7 / 8)


def test_star_full_duplex_and_fair_share():
    net = Network(star(3, BW))
    # 0->1 and 0->2 share host 0's uplink; 1->0 goes the other way
    got = C.simultaneous(net, [C.transfer(net, 0, 1, GB), C.transfer(net, 0, 2, GB), C.transfer(net, 1, 0, GB)])
    assert got == pytest.approx([2.0, 2.0, 1.0])


def test_maxmin_gives_the_spare_capacity_to_the_unbottlenecked():
    # resource 0 (cap 1) carries tasks 0, 1; resource 1 (cap 3) carries tasks 1, 2
    rates = maxmin([0, 1, 2], [[(0, 1.0)], [(0, 1.0), (1, 1.0)], [(1, 1.0)]], [1.0, 3.0])
    assert rates == pytest.approx({0: 0.5, 1: 0.5, 2: 2.5})


def test_spectrum_x_rails_and_nvlink():
    t = spectrum_x(128, gbps=100, nvlink_gbps=2400, psw=64)
    assert (t.num_nodes, len(t.links), t.nvswitches) == (216, 128 + 128 + 8 * 64, 16)  # seed 001: 216 nodes
    net = Network(t)
    assert net.rate(0, 1) == pytest.approx(2400e9 / 8)  # same server: NVSwitch
    assert net.rate(0, 8) == pytest.approx(100e9 / 8)  # same rail, other server: one ASW
    assert len(net.route(0, 8).resources) == 2


def test_nvl_domains():
    net = Network(nvl(144, 72, gbps=400, nvlink_gbps=7200))
    assert net.rate(0, 71) == pytest.approx(7200e9 / 8)
    assert net.rate(0, 72) == pytest.approx(400e9 / 8)
    assert len(net.route(0, 72).resources) == 4


@pytest.mark.parametrize("make", [lambda: star(5, 1.0, 1e-4), lambda: tree(10, 4, 10.0, 2.0), lambda: wifi(3),
                                  lambda: spectrum_x(32, psw=4), lambda: nvl(16, 8)])
def test_json_round_trip(tmp_path, make):
    t = make()
    t.save(tmp_path / "t.json")
    back = Topology.load(tmp_path / "t.json")
    assert back.to_json() == t.to_json()


def test_simai_text_round_trip(tmp_path):
    t = spectrum_x(16, gpus_per_server=8, psw=2)
    p = write_simai(t, tmp_path / "Spectrum-X_16g")
    first = p.read_text().splitlines()[0].split()
    assert first == [str(t.num_nodes), "8", "2", str(len(t.switches) - 2), str(len(t.links)), "A100"]
    back = read_simai(p)
    assert (back.hosts, back.switches, back.nvswitches) == (t.hosts, t.switches, t.nvswitches)
    for a, b in zip(back.links, t.links):
        assert (a.src, a.dst) == (b.src, b.dst)
        assert a.gbps == pytest.approx(b.gbps) and a.latency_s == pytest.approx(b.latency_s)


def test_simai_seed_lines(tmp_path):
    p = tmp_path / "topo"
    p.write_text("3 1 0 1 2 A100\n2\n0 2 100Gbps 0.0005ms 0\n1 2 100Gbps 0.0005ms 0\n")
    t = read_simai(p)
    assert t.hosts == 2 and t.links[0].gbps == 100 and t.links[0].latency_s == pytest.approx(5e-7)


def test_bad_files_name_the_field(tmp_path):
    with pytest.raises(FormatError, match="medium"):
        Topology.parse({"format": "torchpp.topology/1", "hosts": 2, "switches": [2],
                        "links": [{"src": 0, "dst": 2, "gbps": 1, "medium": "air"},
                                  {"src": 1, "dst": 2, "gbps": 1}]}, "t.json")
    with pytest.raises(FormatError, match="path from host 0"):
        Topology.parse({"format": "torchpp.topology/1", "hosts": 2, "switches": [], "links": []}, "t.json")
    p = tmp_path / "bad"
    p.write_text("3 1 0 1 5 A100\n2\n0 2 100Gbps 0.0005ms 0\n1 2 100Gbps 0.0005ms 0\n")
    with pytest.raises(FormatError, match="link count"):
        read_simai(p)
