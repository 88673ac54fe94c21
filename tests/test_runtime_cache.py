"""The runtime files `cluster run` reads before its hosts start (torchpp/cluster/runtime_cache.py)."""
import subprocess
import sys
from pathlib import Path

import torch

from torchpp.cluster import runtime_cache


def test_runtime_files_hold_what_a_host_maps_and_are_found_without_importing():
    """libtorch and torch's compiled modules, the interpreter: found by path, nothing imported
    (a launcher that imported torch would pay a second's start-up on every `cluster run`)."""
    files = set(runtime_cache.runtime_files())
    lib = Path(torch.__file__).parent / "lib"
    assert {p for p in lib.iterdir() if p.name.startswith("libtorch_cpu.so")} <= files
    assert Path(sys.executable).resolve() in files
    assert any(p.suffix == ".pyc" and "torch" in p.parts for p in files)
    code = ("import sys; from torchpp.cluster import runtime_cache as r; w = r.warm(('torch',)); "
            "print(w.files > 0 and w.bytes > 100e6, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["True", "False"]


def test_a_missing_package_is_skipped():
    files = runtime_cache.runtime_files(("no_such_package_here",))
    assert Path(sys.executable).resolve() in files and not any("no_such_package_here" in str(p) for p in files)
