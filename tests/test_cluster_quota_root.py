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
