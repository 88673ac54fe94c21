"""The elastic driver on an emulated cluster: three namespace hosts, h2's rank killed after
checkpoint 3; the run goes on without h2 and equals the new plan's uninterrupted run.

Needs root (network namespaces, cgroups); skipped with the reason otherwise."""
from __future__ import annotations

import pytest

from test_cluster_root import _why_not, clean, write_config  # noqa: F401 (clean is a fixture)
from test_elastic import HOSTS, ROOT, kill_and_compare

pytestmark = [pytest.mark.root, pytest.mark.skipif(_why_not() is not None, reason=str(_why_not()))]


def test_killed_host_is_planned_out_on_the_emulated_cluster(tmp_path, clean, monkeypatch):  # noqa: F811
    from torchpp.cluster import cluster
    from torchpp.cluster.config import ClusterConfig
    from torchpp.elastic.driver import ClusterLauncher

    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    cfg = ClusterConfig.load(write_config(tmp_path, "tpte", [{"name": h, "cpu": 1.0, "memory": "2G", "rate": "100mbit"}
                                                            for h in HOSTS]))
    try:
        cluster.up(cfg, log=lambda *_: None)
        kill_and_compare(tmp_path, ClusterLauncher(cfg.name))
    finally:
        cluster.down(cfg.name, log=lambda *_: None)
