"""`python -m torchpp.runtime.local_cli --nproc-per-node N [--host-prefix P] -- COMMAND`: COMMAND once per rank.

On this machine, with the variables ``torchrun --standalone --nproc-per-node N`` gives each rank
(env:// on a free loopback port), without torchrun's agent: an interpreter that imports torch,
seconds of CPU per run on a small host, and the demo's local hosts start a process per run. A rank
that fails stops the others and its exit code is this command's; no rank outlives this command.
"""
from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m torchpp.runtime.local_cli", description=__doc__.splitlines()[0])
    p.add_argument("--nproc-per-node", type=int, required=True, help="ranks to start (1..64)")
    p.add_argument("--host-prefix", default=None, help="each rank's HOST is this prefix and its rank (local0, ...)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command every rank runs")
    a = p.parse_args(argv)
    cmd = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not cmd:
        p.error("expected -- COMMAND after the options")
    if not 1 <= a.nproc_per_node <= 64:
        p.error(f"--nproc-per-node: expected 1..64, got {a.nproc_per_node}")
    from .launch import launch_local

    prefix = a.host_prefix
    code, rank = launch_local(cmd, a.nproc_per_node, per_rank=(lambda r: {"HOST": f"{prefix}{r}"}) if prefix else None)
    if rank is not None:
        sys.stderr.write(f"{p.prog}: rank {rank} exited with code {code}; the other ranks were stopped\n")
    return code


if __name__ == "__main__":
    raise SystemExit(main())
