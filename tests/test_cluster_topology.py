"""The emulated cluster as a star topology (no root needed: configs only) and the per-host star."""
import pytest

from torchpp.cluster.config import ClusterConfig
from torchpp.cluster.topology import star_of
from torchpp.topology import Network
from torchpp.topology import collectives as C
from torchpp.topology.templates import star


def cfg(hosts, links=()):
    return ClusterConfig.parse({"name": "t", "hosts": hosts, "links": list(links)}, "t.json")


def test_star_with_per_host_rates_and_latencies():
    net = Network(star(3, [8.0, 8.0, 0.8], [1e-3, 1e-3, 2e-3]))  # 1e9, 1e9, 1e8 bytes/s
    assert net.rate(0, 1) == pytest.approx(1e9)
    assert net.rate(0, 2) == pytest.approx(1e8)  # the slow host's link bounds both directions
    assert net.rate(2, 1) == pytest.approx(1e8)
    assert net.route(0, 2).latency_s == pytest.approx(3e-3)
    # two senders into host 0 share its link max-min: host 2's flow is held to 1e8 by its own link
    # (done at 1 s + 3 ms of latency, its share held meanwhile), host 1's gets the other 9e8, then all
    both = C.simultaneous(net, [C.transfer(net, 1, 0, 1e9), C.transfer(net, 2, 0, 1e8)])
    left = 1e9 - 9e8 * 1.003
    assert both == pytest.approx([1.003 + left / 1e9 + 2e-3, 1.003])
    with pytest.raises(ValueError, match="one gbps per host"):
        star(3, [1.0, 2.0])


def test_uniform_star_keeps_its_name():
    assert star(4, 1.0).name == "star_4h_1Gbps"
    assert star(2, [1.0, 0.1]).name == "star_2h_mixed"


def test_star_of_a_cluster_config():
    c = cfg([{"name": "a", "rate": "40mbit", "down_rate": "40mbit"},
             {"name": "b", "rate": "100mbit", "down_rate": "100mbit", "delay": "1ms", "down_delay": "1ms"}])
    t = star_of(c, wire=False)
    assert t.hosts == 2 and t.name == "t_star"
    assert [ln.gbps for ln in t.links] == pytest.approx([0.04, 0.1])
    assert Network(t).rate(1, 0) == pytest.approx(40e6 / 8)
    assert Network(t).route(0, 1).latency_s == pytest.approx(1e-3)
    # by default the links offer TCP goodput: 1448 payload bytes per 1514-byte frame htb counts
    assert [ln.gbps for ln in star_of(c).links] == pytest.approx([0.04 * 1448 / 1514, 0.1 * 1448 / 1514])
    assert [ln.gbps for ln in star_of(c, mtu=9000).links] == pytest.approx([0.04 * 8948 / 9014, 0.1 * 8948 / 9014])


def test_goodput_fraction():
    from torchpp.topology.wire import ETHERNET_FRAMING, goodput_fraction, goodput_gbps

    assert goodput_fraction() == pytest.approx(0.95641, abs=1e-5)  # measured on the cluster: 0.9565-0.9569
    assert goodput_fraction(1500, ETHERNET_FRAMING) == pytest.approx(1448 / 1538)  # a physical 1 Gbit/s port
    assert goodput_gbps(1.0) == pytest.approx(1448 / 1514)
    with pytest.raises(ValueError, match="MTU above"):
        goodput_fraction(40)


@pytest.mark.parametrize("hosts,links,match", [
    ([{"name": "a", "rate": "40mbit"}, {"name": "b", "rate": "40mbit", "down_rate": "40mbit"}], (),
     "host a: expected one rate both ways"),  # an unset down_rate is an unshaped switch port
    ([{"name": "a", "rate": "40mbit", "down_rate": "20mbit"}], (), "host a: expected one rate"),
    ([{"name": "a"}], (), "host a: expected one rate"),
    ([{"name": "a", "rate": "1mbit", "down_rate": "1mbit", "delay": "2ms"}], (), "one delay both ways"),
    ([{"name": "a", "rate": "1mbit", "down_rate": "1mbit"}, {"name": "b", "rate": "1mbit", "down_rate": "1mbit"}],
     [{"src": "a", "dst": "b", "rate": "2mbit"}], "per-pair links"),
])
def test_star_of_refuses_what_is_not_a_star(hosts, links, match):
    with pytest.raises(ValueError, match=match):
        star_of(cfg(hosts, links))
