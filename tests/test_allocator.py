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
import json
from torchpp.runtime.allocator import retain_freed_memory
applied = retain_freed_memory()
import torch
def rss_mib():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
# a 64 MiB activation, above the largest block glibc ever serves from the heap by default
x = torch.ones(2**24)
held = rss_mib()
del x
print(json.dumps({"applied": applied, "again": retain_freed_memory(), "returned_mib": held - rss_mib()}))
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
def test_freed_memory_stays_in_the_process_unless_turned_off():
    kept = _probe(None)
    default = _probe("default")
    assert kept["applied"] and kept["again"], kept
    assert not default["applied"], default
    # by default the block is mmap'ed and unmapped on free (to be faulted in again next time);
    # under the policy it comes from the heap and stays for the next micro-batch
    assert default["returned_mib"] > 60, default
    assert kept["returned_mib"] < 4, kept
