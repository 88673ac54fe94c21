"""Install torchpp and build its C++ span timer (torchpp._timer) against the pinned torch.

Build without isolation so the extension links against the installed torch==2.13.0:
    pip install --no-build-isolation -e .
Set TORCHPP_NO_EXT=1 to skip the extension (torchpp then uses its Python timer and says so).
"""
import os
from pathlib import Path

from setuptools import find_packages, setup

ext_modules, cmdclass = [], {}
if os.environ.get("TORCHPP_NO_EXT") != "1" and Path("csrc/timer.cpp").is_file():
    from torch.utils.cpp_extension import BuildExtension, CppExtension

    ext_modules = [CppExtension("torchpp._timer", ["csrc/timer.cpp"], extra_compile_args=["-O2", "-std=c++17"])]
    cmdclass = {"build_ext": BuildExtension.with_options(use_ninja=False)}

setup(
    name="torchpp",
    version="0.1.0",
    description="Measure, plan, run and simulate pipeline-parallel training of HF models on small, uneven clusters",
    packages=find_packages(include=["torchpp", "torchpp.*"]),
    python_requires=">=3.10",
    install_requires=[line.split("#")[0].strip() for line in Path("requirements.txt").read_text().splitlines()
                      if line.split("#")[0].strip() and not line.startswith(("pytest",))],
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    entry_points={"console_scripts": ["torchpp=torchpp.cli:main"]},
)
