"""The homelab scenario: qwen3-homelab fits no single host of homelab with AdamW, fits the cluster.

The planner's side runs anywhere (a memory model with this machine's calibrated coefficients);
the real run on the biggest host, stopped by its cgroup memory limit, needs root."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from torchpp.cluster.config import ClusterConfig
from torchpp.formats import GB, MemoryModel

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "cluster" / "homelab.json"
# what `torchpp calibrate-memory` fitted for qwen3-homelab on this machine (float32, AdamW)
CALIBRATED = dict(base=20.7e6, alpha=4.16, Kp=20.2, Kt=2.83, process_bytes=372 * 2**20)


@pytest.fixture
def homelab_inputs(tmp_path):
    from torchpp.planner import api

    cfg = ClusterConfig.load(CONFIG)
    assert sum(h.cpu for h in cfg.hosts) <= 2.0 and all(h.memory for h in cfg.hosts)
    rates = [h.up.rate for h in cfg.hosts]
    assert min(rates) >= 100e6 and max(rates) <= 1e9  # 100 Mbit/s to 1 Gbit/s
    spec = {"devices": {h.name: {"flops": 30e9 * h.cpu, "memory_gb": h.memory / GB} for h in cfg.hosts},
            "link_gbps": 0.1}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    MemoryModel(**CALIBRATED).save(tmp_path / "memory_model.json")
    return api.PlanInputs(estimate=api.Estimate(model="qwen3-homelab", device_spec=tmp_path / "spec.json"),
                          memory_model=tmp_path / "memory_model.json", seq_len=32)


def test_no_single_host_fits_but_the_cluster_does(homelab_inputs):
    from torchpp.planner import api

    res = api.plan(homelab_inputs, api.PlanOptions(global_batch=32, compare=["single", "even", "dp"]))
    rows = {c["name"]: c for c in res.compare}
    assert rows["single"]["oom"] and rows["single"]["hosts"] == ["laptop"]  # the nearest to fitting is the laptop
    assert rows["dp"]["oom"]  # every device would hold the whole model
    assert not rows["even"]["oom"] and res.plan.world_size >= 2
    assert all(d["memory_bytes"] <= d["budget_bytes"] for s in res.plan.predicted["stages"] for d in s["devices"])


def _cluster_why_not() -> str | None:
    from torchpp.demo import cluster_available

    return "needs root" if os.geteuid() != 0 else cluster_available()


@pytest.mark.slow
@pytest.mark.root
@pytest.mark.skipif(_cluster_why_not() is not None, reason=f"emulated cluster unavailable: {_cluster_why_not()}")
def test_the_biggest_host_is_stopped_by_its_memory_limit_with_one_clear_line(tmp_path):
    from torchpp.cluster import cluster

    cfg = ClusterConfig.load(CONFIG)
    if cluster.load_state(cfg.name) is not None:
        pytest.skip(f"cluster {cfg.name} is up on this machine; not touching it")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    tp = [sys.executable, "-m", "torchpp"]
    plan = tmp_path / "single.json"
    subprocess.run([*tp, "plan", "--strategy", "dp", "--devices", "1", "--hosts", "laptop", "--model", "qwen3-homelab",
                    "--global-batch", "32", "--microbatches", "1", "--seq-len", "32", "--out", str(plan)],
                   check=True, env=env, cwd=ROOT, capture_output=True)
    subprocess.run([*tp, "cluster", "up", "-c", str(CONFIG), "--skip-netem"], check=True, env=env, cwd=ROOT,
                   capture_output=True)
    try:
        res = subprocess.run([*tp, "cluster", "run", "-c", str(CONFIG), "-q", "--logs", str(tmp_path / "logs"),
                              "--plan", str(plan), "--", sys.executable, "-m", "torchpp.train", "--plan", str(plan),
                              "--model", "qwen3-homelab", "--data", "synthetic", "--steps", "1", "--threads", "1",
                              "--timeout-s", "120"], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    finally:
        subprocess.run([*tp, "cluster", "down", "-c", str(CONFIG)], env=env, cwd=ROOT, capture_output=True)
    assert res.returncode != 0
    line = "rank 0 on host laptop was killed by the kernel for exceeding its memory limit (0.88 GiB)"
    assert res.stdout.count(line) == 1, res.stdout[-2000:]
    ran = json.loads((tmp_path / "logs" / "run.json").read_text())
    assert ran["hosts"][0]["why"] == line
