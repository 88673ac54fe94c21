"""Emulated-cluster pieces that need no privileges: parsing, validation, cgroup detection."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from torchpp.cluster import cgroups
from torchpp.cluster.cluster import host_env, worst
from torchpp.cluster.config import ClusterConfig
from torchpp.cluster.probe import fit_rate
from torchpp.cluster.units import parse_duration, parse_fraction, parse_rate, parse_size
from torchpp.formats import FormatError

ROOT = Path(__file__).resolve().parents[1]


def test_units():
    assert parse_rate("50mbit") == 50e6 and parse_rate("1gbit") == 1e9 and parse_rate("500kbit") == 5e5
    assert parse_size("2G") == 2 * 2**30 and parse_size("512M") == 512 * 2**20 and parse_size("1.5G") == 3 * 2**29
    assert parse_duration("2ms") == pytest.approx(0.002) and parse_duration("500us") == pytest.approx(5e-4)
    assert parse_fraction("1%") == pytest.approx(0.01)
    with pytest.raises(ValueError, match="ambiguous"):
        parse_rate("10mbps")  # tc reads mbps as megabytes/s
    for bad in ("fast", "-3mbit", "0mbit"):
        with pytest.raises(ValueError):
            parse_rate(bad)
    with pytest.raises(ValueError):
        parse_size("2 potatoes")


@pytest.mark.parametrize("name", ["pi3", "hetero4"])
def test_shipped_configs_parse(name):
    cfg = ClusterConfig.load(ROOT / "configs" / "cluster" / f"{name}.json")
    assert cfg.name == name and len(cfg.hosts) == {"pi3": 3, "hetero4": 4}[name]
    for i, h in enumerate(cfg.hosts):
        assert 0.3 <= h.cpu <= 0.8 and 2**30 <= h.memory <= 3 * 2**30
        assert 10e6 <= h.up.rate <= 200e6
        assert cfg.address(i).startswith("10.77.")


def test_hetero4_asymmetric_and_pair_override():
    cfg = ClusterConfig.load(ROOT / "configs" / "cluster" / "hetero4.json")
    pi3 = cfg.index("pi3")
    assert cfg.uplink(pi3).default.rate == 10e6 and cfg.downlink(pi3).default.rate == 20e6
    laptop_up = cfg.uplink(cfg.index("laptop"))
    assert laptop_up.per_dst == {cfg.address(cfg.index("desktop")): laptop_up.per_dst[cfg.address(1)]}
    assert laptop_up.per_dst[cfg.address(1)].rate == 150e6
    stripped = cfg.without_netem()
    assert not stripped.needs_netem and stripped.hosts[0].up.rate == cfg.hosts[0].up.rate


@pytest.mark.parametrize("patch, field, expected", [
    ({"name": "Bad-Name"}, "name", "lowercase"),
    ({"hosts": []}, "hosts", "at least 1"),
    ({"hosts": [{"name": "a", "rate": "10mbps"}]}, "hosts[0].rate", "ambiguous"),
    ({"hosts": [{"name": "a", "memory": "lots"}]}, "hosts[0].memory", "size"),
    ({"hosts": [{"name": "a", "cpu": -1}]}, "hosts[0].cpu", "> 0"),
    ({"hosts": [{"name": "a"}, {"name": "a"}]}, "hosts[1].name", "not used"),
    ({"subnet": "8.8.8.0/24"}, "subnet", "private"),
    ({"links": [{"src": "a", "dst": "zz", "rate": "1mbit"}]}, "links[0].dst", "one of"),
    ({"master_port": 80}, "master_port", ">= 1024"),
    ({"links": [{"src": "a", "dst": "b"}, {"src": "a", "dst": "b"}]}, "links[1].dst", "twice"),
    ({"hosts": [{"name": "a", "delay": "soon"}]}, "hosts[0].delay", "duration"),
    ({"tcp": "BBR!"}, "tcp", "congestion control"),
    ({"cpu_period_ms": 0.5}, "cpu_period_ms", "1 to 1000 ms"),
    ({"cpu_period_cost_ms": -1}, "cpu_period_cost_ms", "from 0 to under"),
    ({"cpu_period_ms": 10, "cpu_period_cost_ms": 5, "hosts": [{"name": "a", "cpu": 0.25}, {"name": "b", "cpu": 0.25}]},
     "cpu_period_cost_ms", "from 0 to under 2.5 ms"),
])
def test_config_errors_name_file_and_field(tmp_path, patch, field, expected):
    data = {"name": "x", "hosts": [{"name": "a"}, {"name": "b"}], **patch}
    p = tmp_path / "bad.json"
    p.write_text(json.dumps(data))
    with pytest.raises(FormatError) as e:
        ClusterConfig.load(p)
    assert e.value.source == str(p) and e.value.field_path == field
    assert expected in str(e.value)


MOUNTINFO_V1 = """\
25 24 0:22 / /sys/fs/cgroup ro,nosuid - tmpfs tmpfs ro,mode=755
26 25 0:23 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw
30 25 0:27 / /sys/fs/cgroup/cpu,cpuacct rw - cgroup cgroup rw,cpu,cpuacct
31 25 0:28 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory
"""
MOUNTINFO_V2 = "25 24 0:22 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"


def test_detect_v1_hybrid_and_v2(tmp_path, monkeypatch):
    h = cgroups.detect(MOUNTINFO_V1)  # unified exists but is unreadable here: v1 controllers win anyway
    assert h["cpu"] == cgroups.Hierarchy("cpu", 1, Path("/sys/fs/cgroup/cpu,cpuacct"))
    assert h["memory"].version == 1
    root = tmp_path / "cg2"
    root.mkdir()
    (root / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    h2 = cgroups.detect(f"25 24 0:22 / {root} rw - cgroup2 cgroup2 rw\n")
    assert h2["cpu"] == cgroups.Hierarchy("cpu", 2, root) and h2["memory"].version == 2
    # hybrid: cpu bound to v1, memory only in v2
    mixed = cgroups.detect(f"30 25 0:27 / /v1cpu rw - cgroup cgroup rw,cpu\n25 24 0:22 / {root} rw - cgroup2 cgroup2 rw\n")
    assert mixed["cpu"].version == 1 and mixed["memory"].version == 2


def test_v2_files_written(tmp_path):
    """On v2 the limits go to cpu.max / memory.max and controllers are delegated down the tree."""
    root = tmp_path / "cg2"
    root.mkdir()
    (root / "cgroup.controllers").write_text("cpu memory\n")
    (root / "cgroup.subtree_control").write_text("")
    hier = {c: cgroups.Hierarchy(c, 2, root) for c in ("cpu", "memory")}
    g = cgroups.Cgroup("cluster-t/h0", ("cpu", "memory"), hier)
    # a plain directory does not populate cgroup files itself: pre-create what the kernel would
    for d in (root / "torchpp", root / "torchpp" / "cluster-t"):
        d.mkdir(parents=True)
        (d / "cgroup.subtree_control").write_text("")
    g.create()
    g.set_cpu(0.25)
    g.set_memory(2**30)
    leaf = root / "torchpp" / "cluster-t" / "h0"
    assert (leaf / "cpu.max").read_text() == "25000 100000"  # the kernel's 100 ms periods
    g.set_cpu(0.005)  # below the kernel's 1 ms smallest quota at 100 ms: the period grows instead
    assert (leaf / "cpu.max").read_text() == "1000 200000"
    g.set_cpu(0.25)
    assert (leaf / "memory.max").read_text() == str(2**30)
    assert "+cpu" in (root / "cgroup.subtree_control").read_text() or \
        "+memory" in (root / "cgroup.subtree_control").read_text()


def test_worst_exit_code():
    assert worst([0, 0]) == 0 and worst([0, 3, 1]) == 3 and worst([0, -9]) == 137 and worst([]) == 0


def test_host_env():
    state = {"name": "t", "master_addr": "10.77.0.1", "master_port": 29511,
             "hosts": [{"name": "a", "cpu": 0.5}, {"name": "b", "cpu": 1.5}]}
    env = host_env(state, 1, base={})
    assert env["HOST"] == "b" and env["RANK"] == env["NODE_RANK"] == "1" and env["WORLD_SIZE"] == "2"
    assert env["MASTER_ADDR"] == "10.77.0.1" and env["MASTER_PORT"] == "29511"
    assert env["PET_NODE_RANK"] == "1" and env["OMP_NUM_THREADS"] == "2"


def test_fit_rate_recovers_linear_model():
    """A message plus its acknowledgement takes one round trip plus bytes / rate."""
    lat, rate = 0.002, 6.25e6
    pts = [(b, 2 * lat + b / rate) for b in (65536, 2**20, 8 * 2**20)]
    assert fit_rate(pts, 2 * lat) == pytest.approx(rate, rel=1e-9)
    assert fit_rate(pts[:1], 2 * lat) == pytest.approx(rate, rel=1e-9)


def test_follower_emits_whole_lines_per_host(tmp_path):
    from torchpp.cluster.cluster import _Follower
    paths = {"a": tmp_path / "a.log", "b": tmp_path / "b.log"}
    got = []
    f = _Follower(paths, lambda h, line: got.append((h, line)))
    f.poll()  # files do not exist yet
    paths["a"].write_bytes(b"one\ntw")
    f.poll()
    assert got == [("a", "one")]
    with open(paths["a"], "ab") as fh:
        fh.write(b"o\n")
    paths["b"].write_bytes(b"last, no newline")
    f.poll()
    f.poll(final=True)
    assert got == [("a", "one"), ("a", "two"), ("b", "last, no newline")]


def test_probe_needs_a_distributed_environment(monkeypatch, capsys):
    from torchpp.cli import main
    for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(v, raising=False)
    assert main(["bandwidth", "probe"]) == 2
    assert "RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT" in capsys.readouterr().err


@pytest.mark.slow
def test_probe_on_loopback_writes_both_files(tmp_path):
    """Two processes on 127.0.0.1 (no privileges needed): every ordered pair, CSV and JSON agree."""
    import os
    import subprocess
    import sys

    from torchpp.runtime.launch import popen_ranks, wait_ranks
    procs = popen_ranks([sys.executable, "-m", "torchpp", "bandwidth", "probe", "--out-dir", str(tmp_path), "--sizes",
                         "64K,256K", "--repeats", "2", "--timeout", "60"], 2,
                        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
                        per_rank=lambda rank: {"HOST": ("left", "right")[rank]},
                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    outs = [out for _, out, _ in wait_ranks(procs, timeout_s=120)]
    assert [p.returncode for p in procs] == [0, 0], outs
    from torchpp.formats import Bandwidth
    bw = Bandwidth.load(tmp_path / "bandwidth.json")
    assert set(bw.bytes_per_sec) == {"left|right", "right|left"} and all(v > 0 for v in bw.bytes_per_sec.values())
    rows = {(s, d): float(g) for s, d, g in (l.split(",") for l in (tmp_path / "bandwidth.csv").read_text().split())}
    for (s, d), gbps in rows.items():
        assert gbps == pytest.approx(bw.rate(s, d) * 8 / 1e9, rel=1e-5)


@pytest.mark.slow
def test_probe_of_three_hosts_measures_each_hosts_fans(tmp_path):
    """Three processes on 127.0.0.1: every pair, then each host's fan-out and fan-in (printed per host);
    whatever the file keeps of them names known hosts with positive rates."""
    import os
    import subprocess
    import sys

    from torchpp.runtime.launch import popen_ranks, wait_ranks
    procs = popen_ranks([sys.executable, "-m", "torchpp", "bandwidth", "probe", "--out-dir", str(tmp_path), "--sizes",
                         "64K,256K", "--repeats", "2", "--fan-seconds", "0.02", "--timeout", "60"], 3,
                        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
                        per_rank=lambda rank: {"HOST": ("a", "b", "c")[rank]},
                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    outs = [out for _, out, _ in wait_ranks(procs, timeout_s=180)]
    assert [p.returncode for p in procs] == [0, 0, 0], outs
    assert "3 host(s)' interfaces" in outs[0]
    for rank, host in enumerate("abc"):
        assert f"  {host}: to all peers at once" in outs[rank]
    from torchpp.formats import Bandwidth
    bw = Bandwidth.load(tmp_path / "bandwidth.json")
    assert len(bw.bytes_per_sec) == 6
    for rates in (bw.egress_bytes_per_sec, bw.ingress_bytes_per_sec):
        assert set(rates) <= {"a", "b", "c"} and all(v > 0 for v in rates.values())


def _plan(hosts: list[str], groups: list[int]):
    from torchpp.models.presets import load_config, model_info
    from torchpp.planner.simple import make_plan
    n = len(groups)
    return make_plan(model_info(load_config("qwen3-tiny"), "qwen3-tiny"), seq_len=8, global_batch=4 * n,
                     num_microbatches=2, layer_ranges=[(i * 4 // n, (i + 1) * 4 // n) for i in range(n)],
                     group_sizes=groups, hosts=hosts)


STATE3 = {"name": "t", "master_port": 29511, "master_addr": "10.77.0.1",
          "hosts": [{"name": "a", "cpu": 1.0, "address": "10.77.0.1"}, {"name": "b", "cpu": 0.5, "address": "10.77.0.2"},
                    {"name": "c", "cpu": 1.0, "address": "10.77.0.3"}]}


def test_plan_placements_subset_shared_host_and_master():
    """Ranks go to their plan hosts (b gets nothing); rank 0's host is node 0 and the master;
    two ranks on one host get local ranks 0 and 1 and split its quota's threads."""
    from torchpp.cluster.cluster import placement_env, plan_placements
    places = plan_placements(STATE3, _plan(["c", "a", "a"], [1, 2]), "p.json")
    assert [(p.rank, p.host, p.node_rank, p.local_rank, p.local_world_size) for p in places] == [
        (0, "c", 0, 0, 1), (1, "a", 1, 0, 2), (2, "a", 1, 1, 2)]
    assert all(p.nnodes == 2 and p.world_size == 3 for p in places)
    master = next(p.host_index for p in places if p.rank == 0)
    envs = [placement_env(STATE3, p, master, base={"PET_NNODES": "9", "TORCHELASTIC_RESTART_COUNT": "1"})
            for p in places]
    for p, env in zip(places, envs):
        assert env["RANK"] == str(p.rank) and env["WORLD_SIZE"] == "3" and env["HOST"] == p.host
        assert env["MASTER_ADDR"] == "10.77.0.3" and env["MASTER_PORT"] == "29511"
        assert env["NNODES"] == "2" and "PET_NNODES" not in env and "TORCHELASTIC_RESTART_COUNT" not in env
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "0", "1"] and [e["OMP_NUM_THREADS"] for e in envs] == ["1"] * 3
    assert [p.label for p in places] == ["c.rank0", "a.rank1", "a.rank2"]


def test_plan_placements_one_process_per_rank_of_a_chunked_plan():
    """A V plan puts two chunks on each rank: still one process per rank, on that rank's host."""
    from torchpp.cluster.cluster import plan_placements
    from torchpp.models.presets import load_config, model_info
    from torchpp.plans import make_chunked_plan
    plan = make_chunked_plan(model_info(load_config("qwen3-tiny"), "qwen3-tiny"), seq_len=8, global_batch=8,
                             num_microbatches=4, layer_ranges=[(0, 1), (1, 2), (2, 3), (3, 4)], schedule="zbv",
                             hosts=["c", "a"])
    assert plan.num_stages == 4 and plan.world_size == 2
    places = plan_placements(STATE3, plan, "p.json")
    assert [(p.rank, p.host, p.local_rank, p.local_world_size) for p in places] == [(0, "c", 0, 1), (1, "a", 0, 1)]


def test_plan_host_outside_the_cluster_names_file_field_and_host():
    from torchpp.cluster.cluster import plan_placements
    with pytest.raises(FormatError) as e:
        plan_placements(STATE3, _plan(["a", "zz"], [1, 1]), "plan.json")
    assert e.value.source == "plan.json" and e.value.field_path == "stages[1].devices[0].host"
    assert "zz" in str(e.value) and "a, b, c" in str(e.value)


def test_expand_host_and_rank_words():
    from torchpp.cluster.cluster import Placement, expand
    argv = ["profile", "--host", "{host}", "--out", "d/layers_{host}.json", "--seed={rank}"]
    assert expand(argv, Placement(host_index=1, host="b", node_rank=1)) == [
        "profile", "--host", "b", "--out", "d/layers_b.json", "--seed=1"]
    assert expand(argv, Placement(host_index=0, host="a", rank=2))[-1] == "--seed=2"


def test_cpu_period_bounds_checked_before_any_write():
    g = cgroups.Cgroup("never-created", ("cpu",), hier={})
    for bad in (500, 2_000_000):
        with pytest.raises(ValueError, match="cpu period"):
            g.set_cpu(0.5, period_us=bad)
    with pytest.raises(ValueError, match="positive"):
        g.set_cpu(0.0)


def test_oom_message_names_rank_host_and_limit():
    from torchpp.cluster.cluster import oom_message

    assert oom_message("laptop", 0, 2**30) == ("rank 0 on host laptop was killed by the kernel for exceeding its "
                                               "memory limit (1.00 GiB)")
    assert oom_message("pi3", None, None) == "the process on host pi3 was killed by the kernel for exceeding its memory limit"


def test_host_tcp_is_loss_based_by_default(monkeypatch, tmp_path):
    """``auto`` gives CUBIC where a namespace may pick it, else Reno; a name not allowed is refused."""
    from torchpp.cluster import cluster
    from torchpp.cluster.cluster import ClusterError, host_tcp

    real = Path.read_text
    allowed = {"text": "reno bbr"}
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: allowed["text"] + "\n"
                        if self.name == "tcp_allowed_congestion_control" else real(self, *a, **k))
    assert host_tcp("auto") == "reno"
    assert host_tcp("machine") == "machine" and host_tcp("bbr") == "bbr"
    with pytest.raises(ClusterError, match="may only use reno bbr"):
        host_tcp("cubic")
    allowed["text"] = "reno cubic"
    assert host_tcp("auto") == "cubic"
    cfg = ClusterConfig.parse({"name": "x", "hosts": [{"name": "a"}]}, "c.json")
    assert cfg.tcp == "auto" and cfg.cpu_period_ms == 100.0


def test_period_cost_keeps_the_work_ratios_and_the_sum():
    """With a per-period cost c, each quota is s * cpu + c / period: quota minus cost (the work a host
    does per period) keeps the configured ratios, and the quotas keep their sum; without it, as given."""
    hosts = [{"name": "laptop", "cpu": 0.7}, {"name": "pi4", "cpu": 0.45}, {"name": "pi3", "cpu": 0.25},
             {"name": "free"}]
    plain = ClusterConfig.parse({"name": "x", "cpu_period_ms": 10, "hosts": hosts}, "c.json")
    assert plain.cpu_period_cost_ms == 0.0 and plain.quotas() == [0.7, 0.45, 0.25, None]
    cfg = ClusterConfig.parse({"name": "x", "cpu_period_ms": 10, "cpu_period_cost_ms": 0.4, "hosts": hosts}, "c.json")
    q = cfg.quotas()
    assert q[3] is None and sum(q[:3]) == pytest.approx(1.4)
    work = [x - 0.04 for x in q[:3]]  # 0.4 ms of every 10 ms period
    assert work[1] / work[0] == pytest.approx(0.45 / 0.7) and work[2] / work[0] == pytest.approx(0.25 / 0.7)
    assert q[2] / q[0] > 0.25 / 0.7 and q[1] / q[0] > 0.45 / 0.7  # the small hosts gain the most


def test_steady_cpu_packs_every_host_onto_one_core():
    """steady_cpu pins each host to a core: the quotas are packed largest first onto the core with
    the most room, and a config whose quotas do not fit (or a host without a quota) is refused
    naming the file and the field."""
    hosts = [{"name": "laptop", "cpu": 0.7}, {"name": "pi4a", "cpu": 0.45}, {"name": "pi4b", "cpu": 0.45},
             {"name": "pi3", "cpu": 0.25}]
    cfg = ClusterConfig.parse({"name": "x", "cpu_period_ms": 10, "steady_cpu": True, "hosts": hosts}, "c.json")
    assert cfg.steady_cpu and not ClusterConfig.parse({"name": "x", "hosts": hosts}, "c.json").steady_cpu
    cores = cfg.cores(2)
    assert cores == [0, 1, 1, 0]  # laptop + pi3 = 0.95, the two Pi 4s 0.9
    for c in (0, 1):
        assert sum(q for q, k in zip(cfg.quotas(), cores) if k == c) <= 1.0
    assert sorted(cfg.cores(4)) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match=r"c.json: steady_cpu .* do not pack onto this machine's 1 core"):
        cfg.cores(1)
    free = ClusterConfig.parse({"name": "x", "steady_cpu": True, "hosts": [*hosts, {"name": "free"}]}, "c.json")
    with pytest.raises(ValueError, match=r"steady_cpu needs a cpu quota on every host \(none on free\)"):
        free.cores(8)
    with pytest.raises(FormatError, match="steady_cpu"):
        ClusterConfig.parse({"name": "x", "steady_cpu": "yes", "hosts": hosts}, "c.json")
