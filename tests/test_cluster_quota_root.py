"""An emulated host gets its CPU quota while it trains: torch forward/backward under the homelab's
smallest host (pi3: 0.25 core in 10 ms periods, 750 MB) receives its quota within 10%, alone and
beside two busy processes, like a plain busy loop in the same host, and never reaches its memory
limit (the runtime's file pages are charged to the launcher, see torchpp/cluster/runtime_cache.py).

The share is CPU time over wall time of the process (``time.process_time``, every thread), not
speed: other work on this machine changes how much a CPU-second does, not how many a quota grants.
Needs root, like test_cluster_root.py; skipped with the reason otherwise.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from torchpp.cluster import cgroups, cluster
from torchpp.cluster.config import ClusterConfig
from test_cluster_root import _why_not, clean, write_config  # noqa: F401  (clean is a fixture)

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
pytestmark = [pytest.mark.root, pytest.mark.slow, pytest.mark.skipif(_why_not() is not None, reason=str(_why_not()))]

SECONDS = 8.0
TORCH = """
import json, time, torch
torch.manual_seed(0)
m = torch.nn.Sequential(*[torch.nn.Linear(384, 384) for _ in range(6)])
opt = torch.optim.AdamW(m.parameters())
x = torch.randn(32, 384)
def step():
    m(x).square().mean().backward(); opt.step(); opt.zero_grad()
for _ in range(3):
    step()
t0, c0, n = time.perf_counter(), time.process_time(), 0
while time.perf_counter() - t0 < {T}:
    step(); n += 1
print(json.dumps({{"share": (time.process_time() - c0) / (time.perf_counter() - t0), "threads": torch.get_num_threads(),
                   "steps": n}}))
"""
LOOP = """
import json, time
t0, c0 = time.perf_counter(), time.process_time()
while time.perf_counter() - t0 < {T}:
    pass
print(json.dumps({{"share": (time.process_time() - c0) / (time.perf_counter() - t0)}}))
"""


def _failcnt(group: cgroups.Cgroup) -> int:
    """Times the group's usage hit its memory limit (v1 memory.failcnt; v2 memory.events max)."""
    path = group.paths()["memory"]
    if (path / "memory.failcnt").exists():
        return int((path / "memory.failcnt").read_text())
    events = dict(l.split() for l in (path / "memory.events").read_text().splitlines())
    return int(events.get("max", 0))


def _share(name: str, code: str, logs: Path) -> dict:
    rc, res = cluster.run(name, [PY, "-c", code.format(T=SECONDS)], logs, timeout=300, log=lambda *_: None)
    text = res[0].log.read_text()
    assert rc == 0, text[-2000:]
    return json.loads(text.strip().splitlines()[-1])


@pytest.mark.parametrize("busy", [0, 2], ids=["alone", "beside-two-busy-processes"])
def test_a_quarter_core_host_gets_its_quota_running_torch(tmp_path, clean, monkeypatch, busy):  # noqa: F811
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cfg = ClusterConfig.load(write_config(tmp_path, "tptq", [{"name": "pi3", "cpu": 0.25, "memory": "750M"}],
                                          subnet="10.77.98.0/24", master_port=29556, cpu_period_ms=10))
    hogs = [subprocess.Popen([PY, "-c", "while True: pass"]) for _ in range(busy)]
    try:
        cluster.up(cfg, log=lambda *_: None)
        group = cgroups.existing(cluster.load_state("tptq")["hosts"][0]["cgroup"])
        loop = _share("tptq", LOOP, tmp_path / "loop")
        torch_ = _share("tptq", TORCH, tmp_path / "torch")
        failcnt = _failcnt(group)
    finally:
        for h in hogs:
            h.kill()
            h.wait()
        cluster.down(cfg.name, log=lambda *_: None)
    got = f"torch {torch_['share']:.3f} ({torch_['steps']} steps), busy loop {loop['share']:.3f} of a core"
    print(f"{busy} busy processes beside: {got}; memory limit reached {failcnt} times")
    assert torch_["threads"] == 1, f"{torch_['threads']} intra-op threads under a 0.25-core quota"
    assert abs(loop["share"] / 0.25 - 1) <= 0.10, got
    assert abs(torch_["share"] / 0.25 - 1) <= 0.10, got
    assert abs(torch_["share"] / loop["share"] - 1) <= 0.10, got
    assert failcnt == 0, f"the host reached its 750 MB limit {failcnt} times ({got})"


def test_the_period_cost_is_granted_on_top_of_each_scaled_quota(tmp_path, clean):  # noqa: F811
    """``cpu_period_cost_ms`` reaches the cgroups: each host's quota per period is its scaled share plus
    the cost (ClusterConfig.quotas), so quota minus cost keeps the configured ratio."""
    cfg = ClusterConfig.load(write_config(tmp_path, "tptc", [{"name": "big", "cpu": 0.6}, {"name": "small", "cpu": 0.2}],
                                          subnet="10.77.97.0/24", master_port=29557, cpu_period_ms=10,
                                          cpu_period_cost_ms=0.4))
    try:
        cluster.up(cfg, log=lambda *_: None)
        limits = [cgroups.existing(h["cgroup"]).limits() for h in cluster.load_state("tptc")["hosts"]]
    finally:
        cluster.down(cfg.name, log=lambda *_: None)
    per_period = []
    for lim in limits:
        quota, period = (lim["cpu.cfs_quota_us"], lim["cpu.cfs_period_us"]) if "cpu.cfs_quota_us" in lim \
            else lim["cpu.max"].split()
        assert int(period) == 10_000
        per_period.append(int(quota))
    assert per_period == [round(q * 10_000) for q in cfg.quotas()]
    assert (per_period[1] - 400) / (per_period[0] - 400) == pytest.approx(0.2 / 0.6, rel=1e-3)


AFFINITY = "import os; print(sorted(os.sched_getaffinity(0)), flush=True)"


def test_steady_cpu_fills_each_hosts_idle_time_on_its_core_while_it_runs(tmp_path, clean):  # noqa: F811
    """With ``steady_cpu`` every host of a run has an idle-priority filler in its own child group on
    the core the host is pinned to, for as long as the run lasts (not outside it: the launcher's own
    steps keep the cores); the host's processes run on that core."""
    if cgroups.detect()["cpu"].version == 2:
        pytest.skip("steady_cpu needs the cgroup v1 cpu controller (the filler's group sits beside the host's processes)")
    cfg = ClusterConfig.load(write_config(tmp_path, "tpts", [{"name": "a", "cpu": 0.3}, {"name": "b", "cpu": 0.2}],
                                          subnet="10.77.96.0/24", master_port=29558, cpu_period_ms=10,
                                          steady_cpu=True))
    try:
        cluster.up(cfg, log=lambda *_: None)
        state = cluster.load_state("tpts")
        hosts = state["hosts"]
        assert sorted(h["core"] for h in hosts) == [0, 1] or len(os.sched_getaffinity(0)) == 1
        groups = [cgroups.existing(h["cgroup"]) for h in hosts]
        assert all(g.pids(fill=True) == [] for g in groups)  # no filler outside a run
        with cluster.idle_filled(state, [0, 1]) as pids:
            for h, g, i in zip(hosts, groups, (0, 1)):
                assert g.pids() == [] and g.pids(fill=True) == [pids[i]]
                assert os.sched_getscheduler(pids[i]) == os.SCHED_IDLE
                assert os.sched_getaffinity(pids[i]) == {h["core"]}
        assert all(g.pids(fill=True) == [] for g in groups)
        rc, res = cluster.run("tpts", [PY, "-c", AFFINITY], tmp_path / "logs", timeout=60, log=lambda *_: None)
        assert rc == 0
        for h, r in zip(hosts, res):
            assert r.log.read_text().strip() == str([h["core"]])
        assert all(g.pids(fill=True) == [] for g in groups)  # the run's fillers ended with it
    finally:
        cluster.down(cfg.name, log=lambda *_: None)


PASSES = """
import json, random, time, torch
torch.manual_seed(0); random.seed(0)
m = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(2)])
x = torch.randn(16, 256)
def one():
    m(x).square().mean().backward()
t0, n = time.process_time(), 0
while time.process_time() - t0 < 0.05:   # passes of 2 ms of CPU
    one(); n += 1
k = max(1, n // 25)
cpu = wall = 0.0
for _ in range(40):
    time.sleep(0.03 + 0.05 * random.random())   # waiting on a link
    w, c = time.perf_counter(), time.process_time()
    for _ in range(k):
        one()
    cpu += time.process_time() - c; wall += time.perf_counter() - w
print(json.dumps({{"share": cpu / wall}}))
"""


def test_a_pass_after_waiting_runs_at_the_quotas_pace_with_steady_cpu(tmp_path, clean, monkeypatch):  # noqa: F811
    """A 0.25-core host that waited on its links runs its next short pass (2 ms of CPU) at its quota's
    pace with ``steady_cpu``, as a small device would; under a plain quota it may run it out of the
    quota it did not use (0.30-0.56 of a core measured here, depending on where in the period it
    woke). The share is CPU time over wall time of the passes."""
    if cgroups.detect()["cpu"].version == 2:
        pytest.skip("steady_cpu needs the cgroup v1 cpu controller (the filler's group sits beside the host's processes)")
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    cfg = ClusterConfig.load(write_config(tmp_path, "tptp", [{"name": "pi3", "cpu": 0.25}], subnet="10.77.95.0/24",
                                          master_port=29559, cpu_period_ms=10, steady_cpu=True))
    try:
        cluster.up(cfg, log=lambda *_: None)
        share = _share("tptp", PASSES, tmp_path / "passes")["share"]
    finally:
        cluster.down(cfg.name, log=lambda *_: None)
    print(f"steady_cpu: short passes after waiting got {share:.3f} of a core")
    assert share <= 0.25 * 1.4, f"{share:.3f} of a core: the host ran faster than its 0.25-core quota"
