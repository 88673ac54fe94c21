"""`torchpp run --plan plan.json [--elastic …] -- TRAIN ARGS`: start the ranks of a plan and watch them.

With ``--elastic``, a rank that fails or stalls past ``--timeout-s`` costs its host: the other
ranks are stopped, the planner plans again over the hosts left (the same measurement files),
and training resumes from the newest complete checkpoint under the new split. A host listed
anew in ``--hosts-file`` is planned in at the next checkpoint. Arguments after ``--`` go to
`torchpp.train` (steps, lr, seed, --checkpoint-every, --checkpoint-background, --log-dir, …).
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--plan", type=Path, required=True, help="the first plan")
    p.add_argument("--elastic", action="store_true", help="re-plan over the hosts left when one fails")
    p.add_argument("--checkpoint-dir", type=Path, required=True)
    p.add_argument("--work-dir", type=Path, default=Path("elastic_run"),
                   help="plans of each attempt, decisions.jsonl, heartbeats, rank logs")
    p.add_argument("--layers", type=Path, nargs="+", default=[], help="layers_<host>.json the plan was made from")
    p.add_argument("--devices", type=Path, default=None)
    p.add_argument("--bandwidth", type=Path, default=None)
    p.add_argument("--capacities", type=Path, default=None)
    p.add_argument("--memory-model", type=Path, default=None)
    p.add_argument("--hosts-file", type=Path, default=None,
                   help="hosts allowed (JSON list or one a line), re-read while running")
    p.add_argument("--timeout-s", type=float, default=60.0, help="a rank without a step this long is stalled")
    p.add_argument("--startup-s", type=float, default=300.0, help="time an attempt may take to its first step")
    p.add_argument("--max-restarts", type=int, default=3)
    p.add_argument("--schedule", default=None,
                   help="schedule kinds a re-plan searches, as `torchpp plan --schedule` (default: those the first "
                        "plan's search allowed, from plan_meta.json beside it, else auto)")
    p.add_argument("--cluster", default=None, help="run in the hosts of this emulated cluster (root)")
    p.add_argument("train_args", nargs=argparse.REMAINDER, help="-- then torchpp.train's arguments")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..errors import UsageError

    if args.cluster:  # before torch is imported: a cluster that is not up is a usage error, at once
        from ..cluster import cluster

        state = cluster.load_state(args.cluster)
        if state is None or state.get("phase") != "up":
            raise UsageError(f"--cluster {args.cluster}: cluster '{args.cluster}' is not up (torchpp cluster up -c CONFIG)")
    from .driver import ClusterLauncher, ConfigurationError, Driver, ElasticConfig, ElasticError, LocalLauncher

    rest = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    try:
        cfg = ElasticConfig(plan=args.plan, train_args=rest, checkpoint_dir=args.checkpoint_dir,
                            work_dir=args.work_dir, layers=args.layers, devices=args.devices, bandwidth=args.bandwidth,
                            capacities=args.capacities, memory_model=args.memory_model, hosts_file=args.hosts_file,
                            timeout_s=args.timeout_s, startup_s=args.startup_s, max_restarts=args.max_restarts,
                            elastic=args.elastic, schedule=args.schedule)
    except ValueError as e:
        raise UsageError(str(e)) from None
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    try:
        launcher = ClusterLauncher(args.cluster) if args.cluster else LocalLauncher(env)
    except ElasticError as e:  # the cluster is not up: a usage error, not a failed run
        raise UsageError(f"--cluster {args.cluster}: {e}") from None
    try:
        result = Driver(cfg, launcher, progress=lambda s: print(s, flush=True)).run()
    except ConfigurationError as e:  # the rank's own line: torchpp.train refused its arguments or files
        print(f"torchpp run: error: {e}", flush=True)
        return 2
    except ElasticError as e:
        print(f"torchpp run: error: {e}", flush=True)
        return 1
    for a in result.attempts:
        print(f"attempt {a.index}: {a.world_size} rank(s) on {', '.join(a.hosts)}, from step {a.resume_step}: "
              f"{a.outcome}" + (f" ({', '.join(a.failed)})" if a.failed else ""))
    print(f"decisions: {result.decisions}")
    return result.exit_code
