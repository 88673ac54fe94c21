"""The runtime's allocator policy: freed activations stay in the process for the next micro-batch."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

PROBE = r"""
import json, resource
from torchpp.runtime.allocator import retain_freed_memory
applied = retain_freed_memory()
import torch
def rss_mib():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
# one "micro-batch": 64 MiB of activations in blocks of 1 and 4 MiB, filled, then all freed
sizes = [2**18, 2**20] * 13
def microbatch():
    kept = [torch.ones(n) for n in sizes]
    del kept
microbatch()
before = rss_mib()
f0 = faults()
for _ in range(3):
    microbatch()
print(json.dumps({"applied": applied, "again": retain_freed_memory(), "rss_after_free_mib": before,
                  "faults_per_microbatch": (faults() - f0) / 3}))
"""


def _probe(policy: str | None) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("TORCHPP_MALLOC", None)
    if policy is not None:
        env["TORCHPP_MALLOC"] = policy
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux") or not os.confstr("CS_GNU_LIBC_VERSION"),
                    reason="the policy is glibc's mallopt")
def test_retained_memory_is_reused_without_page_faults():
    kept = _probe(None)
    default = _probe("default")
    assert kept["applied"] and kept["again"], kept
    assert not default["applied"], default
    # 64 MiB per micro-batch is 16384 pages: with the C library's default policy the large blocks
    # go back to the kernel and are faulted in again; retained, they are reused as they are
    assert default["faults_per_microbatch"] > 4000, default
    assert kept["faults_per_microbatch"] < 0.1 * default["faults_per_microbatch"], (kept, default)
