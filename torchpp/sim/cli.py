"""`torchpp simulate run|sweep|heatmap|all|plan|check-reference`."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from .. import argtypes as T, validate as V
from ..formats import FULL_BACKWARD_ONE_CHUNK


def _pairs(text: str) -> dict[str, str]:
    out = {}
    for part in text.split(","):
        if not part.strip():
            continue
        k, sep, v = part.partition("=")
        if not sep:
            raise argparse.ArgumentTypeError(f"expected TYPE=VALUE pairs separated by commas, got {part!r}")
        out[k.strip()] = v.strip()
    return out


def _add_priorities(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("comm priorities (default: equal shares, no exclusive tier)")
    g.add_argument("--priorities", type=_pairs, default=None, metavar="fwd_prop=X,grad_prop=Y,grad_sync=Z",
                   help="shared priorities in [0, 1]; a type left out or at 0 runs only when nothing else is ready")
    g.add_argument("--exclusive", type=_pairs, default=None, metavar="TYPE=LETTER",
                   help="exclusive tiers, e.g. fwd_prop=a,grad_sync=b ('a' pre-empts 'b' pre-empts shared)")


def _priorities(args: argparse.Namespace):
    from ..errors import UsageError
    from .model import COMM_TYPES, Priorities, SimError

    shared = None
    if args.priorities is not None:
        shared = {}
        for k, v in args.priorities.items():
            if k not in COMM_TYPES:
                raise UsageError(f"--priorities: unknown type {k!r}; expected {', '.join(COMM_TYPES)}")
            try:
                shared[k] = float(v)
            except ValueError:
                raise UsageError(f"--priorities: {k}: expected a number in [0, 1], got {v!r}") from None
    try:
        return Priorities.of(shared, args.exclusive)
    except SimError as e:
        raise UsageError(f"--priorities/--exclusive: {e}") from None


def _add_settings(p: argparse.ArgumentParser, defaults: bool = True) -> None:
    d = (lambda v: v) if defaults else (lambda v: None)
    p.add_argument("--policy", choices=["schedule", "seed002"], default=d("schedule"),
                   help="schedule: torchpp's own action lists (default); seed002: the original's greedy rules")
    p.add_argument("--schedule", choices=list(FULL_BACKWARD_ONE_CHUNK), default=d("1f1b"))
    p.add_argument("--congestion", action=argparse.BooleanOptionalAction, default=d(False),
                   help="receiver congestion: inbound transfers throttled to --recv-capacity")
    p.add_argument("--recv-capacity", type=T.float_in(0.0, 1e6, lo_open=True), default=d(1.0))
    p.add_argument("--ideal-sync", action=argparse.BooleanOptionalAction, default=d(False),
                   help="grad_sync on its own channel, never slowing compute")


def _settings(args: argparse.Namespace, base=None):
    from ..formats import SimSettings

    base = base or SimSettings()
    pick = lambda name: getattr(args, name) if getattr(args, name, None) is not None else getattr(base, name)
    return SimSettings(policy=pick("policy"), schedule=pick("schedule"), congestion=pick("congestion"),
                       recv_capacity=pick("recv_capacity"), ideal_sync=pick("ideal_sync"))


def configure(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="simverb", metavar="COMMAND", required=True)
    _configure_run(sub)
    _configure_sweeps(sub)
    _configure_plans(sub)


def _configure_run(sub) -> None:
    r = sub.add_parser("run", help="simulate one configuration: completion time, utilisation, Gantt chart")
    from ..formats import SimParams

    d = SimParams()
    r.add_argument("-n", "--num-microbatches", dest="n", type=T.int_in(1, V.MAX_MICROBATCHES), default=d.n)
    r.add_argument("--stages", type=T.int_in(1, V.MAX_STAGES), default=d.stages)
    r.add_argument("--fwd-len", type=T.float_in(0.0, 1e9), default=d.fwd_len)
    r.add_argument("--bwd-len", type=T.float_in(0.0, 1e9), default=d.bwd_len)
    r.add_argument("--prop-len", type=T.float_in(0.0, 1e9), default=d.prop_len)
    r.add_argument("--sync-base-len", type=T.float_in(0.0, 1e9), default=d.sync_base_len)
    r.add_argument("--fwd-impact", type=T.float_in(0.0, 1.0), default=d.fwd_impact)
    r.add_argument("--bwd-impact", type=T.float_in(0.0, 1.0), default=d.bwd_impact)
    r.add_argument("--sync-freq", type=T.int_in(1, V.MAX_MICROBATCHES), default=d.sync_freq)
    _add_settings(r)
    _add_priorities(r)
    r.add_argument("--gantt", type=T.out_file, default=Path("outputs/gantt.png"), help="Gantt chart PNG to write")
    r.add_argument("--no-gantt", action="store_true")
    r.add_argument("--style", choices=["single", "dual"], default="dual")
    r.add_argument("--show-throttling", action="store_true", help="red edge on transfers slowed by congestion")
    r.add_argument("--show-completion-time", action="store_true")
    r.add_argument("--trace", type=T.out_file, default=None, help="also write a predicted Chrome trace (schedule policy)")
    r.set_defaults(func=cmd_run)


def _configure_sweeps(sub) -> None:
    s = sub.add_parser("sweep", help="every configuration of an experiment file × every priority scenario -> CSV")
    s.add_argument("-c", "--config", type=T.existing_path, required=True)
    s.add_argument("--priority-step", type=T.float_in(0.0, 1.0, lo_open=True), default=None, help="grid step of shared priorities (default 0.1)")
    s.add_argument("--workers", type=T.int_in(1, V.MAX_WORKERS), default=None, help="processes (default: all cores)")
    s.add_argument("--output", type=T.out_file, default=None, help="CSV (default outputs/data/<config>_<time>.csv); "
                   "an existing CSV is resumed: rows it holds are skipped")
    s.add_argument("--no-progress", action="store_true")
    _add_settings(s, defaults=False)
    s.set_defaults(func=cmd_sweep)

    h = sub.add_parser("heatmap", help="one heatmap per environment of a sweep CSV")
    h.add_argument("csv", type=T.existing_path)
    h.add_argument("-o", "--output-dir", type=T.out_dir, default=Path("outputs/heatmaps"))
    h.set_defaults(func=cmd_heatmap)

    a = sub.add_parser("all", help="config -> CSV -> heatmaps in one command")
    a.add_argument("-c", "--config", type=T.existing_path, required=True)
    a.add_argument("--priority-step", type=T.float_in(0.0, 1.0, lo_open=True), default=None)
    a.add_argument("--workers", type=T.int_in(1, V.MAX_WORKERS), default=None)
    a.add_argument("--out-dir", type=T.out_dir, default=Path("outputs"), help="writes <out>/data/*.csv and <out>/heatmaps/")
    a.add_argument("--no-progress", action="store_true")
    _add_settings(a, defaults=False)
    a.set_defaults(func=cmd_all)


def _configure_plans(sub) -> None:
    pl = sub.add_parser("plan", help="price a plan's action lists with measured costs; write a predicted trace")
    pl.add_argument("plan", type=T.existing_path)
    pl.add_argument("--bandwidth", type=T.existing_path, required=True)
    pl.add_argument("--layers", type=T.existing_path, nargs="+", required=True, help="layers_<host>.json files")
    pl.add_argument("--capacities", type=T.existing_path, default=None, help="capacities.json for hosts without a layers file")
    pl.add_argument("--speed-check", type=T.existing_path, nargs="+", default=None, metavar="SPEED_CHECK_JSON",
                    help="speed_check_<host>.json files (`torchpp speed-check`): price each checked host at the "
                    "speed it has now, its profiled times times its measured / profiled ratio")
    pl.add_argument("--comm", choices=["shared", "links"], default="shared",
                    help="shared: one prioritised channel per rank; links: contention-free (the planner's pricing)")
    pl.add_argument("--congestion", action="store_true")
    pl.add_argument("--recv-capacity", type=T.float_in(0.0, 1e6, lo_open=True), default=1.0)
    pl.add_argument("--fwd-impact", type=T.float_in(0.0, 1.0), default=0.0)
    pl.add_argument("--bwd-impact", type=T.float_in(0.0, 1.0), default=0.0)
    _add_priorities(pl)
    pl.add_argument("--trace", type=T.out_file, default=None,
                    help="predicted trace (default: predicted_trace.json beside the plan)")
    pl.add_argument("--gantt", type=T.out_file, default=None)
    pl.set_defaults(func=cmd_plan)

    tp = sub.add_parser("topology", help="price a plan of a mocked model on a topology; write a predicted trace")
    tp.add_argument("plan", type=Path)
    tp.add_argument("--topology", type=Path, required=True, help="topology.json or seed 001 text")
    tp.add_argument("--model", required=True, help="megatron-gpt-7b|13b|175b, a preset or a local HF config")
    tp.add_argument("--flops", type=T.float_in(0.0, V.MAX_NUMBER, lo_open=True), required=True,
                    help="FLOP/s of one device")
    tp.add_argument("--tp", type=T.int_in(1, V.MAX_STAGES), default=1, help="devices per plan rank (tensor parallelism)")
    tp.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    tp.add_argument("--full", action="store_true", help="simulate every rank (default: one replica if uniform)")
    tp.add_argument("--trace", type=T.out_file, default=None,
                    help="predicted trace (default: predicted_trace.json beside the plan)")
    tp.set_defaults(func=cmd_topology)

    c = sub.add_parser("check-reference", help="replay seed 002 reference cases (CSV) in seed002 mode")
    c.add_argument("csv", type=T.existing_path)
    c.add_argument("--tolerance", type=T.float_in(0.0, 1e9), default=1e-6)
    c.set_defaults(func=cmd_check_reference)


# ------------------------------------------------------------------ commands
def _print_utilisation(result) -> None:
    from .gantt import bars_of

    bars = bars_of(result)
    span = max((b.end for b in bars), default=0.0) or 1.0
    for dev in sorted({b.device for b in bars}):
        comp = sum(b.end - b.start for b in bars if b.device == dev and b.channel == "compute")
        busy, until = 0.0, 0.0  # time the comm channel carries anything (union of transfers)
        for b in sorted((b for b in bars if b.device == dev and b.channel == "comm"), key=lambda b: b.start):
            if b.end > until:
                busy += b.end - max(b.start, until)
                until = b.end
        print(f"  device {dev}: compute {100 * comp / span:5.1f}%  comm {100 * busy / span:5.1f}%")


def cmd_run(args: argparse.Namespace) -> int:
    from ..errors import UsageError
    from ..formats import FormatError, SimParams
    from .model import SimError
    from .parametric import parametric_plan, run_params
    from .seed002 import Seed002Result

    try:
        p = SimParams(n=args.n, stages=args.stages, sync_freq=args.sync_freq, fwd_len=args.fwd_len,
                      bwd_len=args.bwd_len, prop_len=args.prop_len, sync_base_len=args.sync_base_len,
                      fwd_impact=args.fwd_impact, bwd_impact=args.bwd_impact)
        settings = _settings(args)
    except FormatError as e:
        raise UsageError(f"--{e.field_path.replace('_', '-')}: expected {e.expected}") from None
    pr = _priorities(args)
    try:
        res = run_params(p, settings, pr)
    except SimError as e:
        print(f"torchpp simulate run: error: {e}", file=sys.stderr)
        return 1
    t = res.completion_time if isinstance(res, Seed002Result) else res.makespan
    print(f"completion time: {t:.9g}  ({settings.policy} policy, {p.stages} stages × {p.n} micro-batches)")
    _print_utilisation(res)
    if not args.no_gantt:
        from .gantt import plot_gantt

        out = plot_gantt(res, args.gantt, style=args.style, show_throttling=args.show_throttling,
                         show_completion_time=args.show_completion_time,
                         title=f"{settings.policy} · {p.stages}×{p.n} · completion {t:.6g}")
        print(f"gantt: {out}")
    if args.trace is not None:
        if isinstance(res, Seed002Result):
            raise UsageError("--trace: the seed002 policy has no action lists; use --policy schedule")
        from ..formats import write_json
        from .trace import predicted_trace

        plan = parametric_plan(p.stages, p.n, settings.schedule)
        print(f"trace: {write_json(args.trace, predicted_trace(plan, res.timeline))}")
    return 0


def _experiment(args: argparse.Namespace):
    from ..formats import ExperimentConfig

    cfg = ExperimentConfig.load(args.config)
    return cfg, _settings(args, cfg.settings)


def cmd_sweep(args: argparse.Namespace, output: Path | None = None) -> int:
    from .sweep import run_sweep

    cfg, settings = _experiment(args)
    out = output or args.output or Path("outputs/data") / f"{args.config.stem}_{time.strftime('%Y%m%d_%H%M%S')}.csv"
    t0 = time.perf_counter()
    stats = run_sweep(cfg, out, workers=args.workers, step=args.priority_step, settings=settings,
                      progress=not args.no_progress)
    dt = time.perf_counter() - t0
    rate = stats["computed"] / dt if dt > 0 else 0.0
    print(f"{out}: {stats['rows']} rows ({stats['computed']} simulated in {dt:.1f}s, {rate:.0f}/s; "
          f"{stats['skipped']} already there)")
    args._csv = out
    return 0


def cmd_heatmap(args: argparse.Namespace) -> int:
    from .heatmap import plot_heatmaps

    paths = plot_heatmaps(args.csv, args.output_dir)
    print(f"{len(paths)} heatmap(s) in {args.output_dir}")
    return 0


def cmd_all(args: argparse.Namespace) -> int:
    from .heatmap import plot_heatmaps

    out = args.out_dir / "data" / f"{args.config.stem}_{time.strftime('%Y%m%d_%H%M%S')}.csv"
    cmd_sweep(args, output=out)
    paths = plot_heatmaps(out, args.out_dir / "heatmaps")
    print(f"{len(paths)} heatmap(s) in {args.out_dir / 'heatmaps'}")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from ..formats import Plan, file_hash, speed_ratios, write_json
    from ..schedules import build
    from .engine import SimOptions, simulate
    from .measured import measured_cost
    from .trace import predicted_trace, recompute_of

    plan = Plan.load(args.plan)
    speed = speed_ratios(args.speed_check) if args.speed_check else None
    cost, bytes_of = measured_cost(plan, args.layers, args.bandwidth, args.capacities, speed)
    if speed:
        print("speed check (measured / profiled): " + ", ".join(f"{h} x{r:.3f}" for h, r in speed.items()))
    opts = SimOptions(comm=args.comm, priorities=_priorities(args), congestion=args.congestion,
                      recv_capacity=args.recv_capacity, fwd_impact=args.fwd_impact, bwd_impact=args.bwd_impact)
    res = simulate(build(plan), cost, opts)
    print(f"predicted step time: {res.makespan:.6f} s ({args.comm} comm, {plan.schedule}, "
          f"{plan.num_stages} stages, {plan.world_size} ranks)")
    _print_utilisation(res)
    trace = predicted_trace(plan, res.timeline, bytes_of=bytes_of, recompute_of=recompute_of(plan, cost.p),
                            metadata={"plan": str(args.plan), "plan_hash": file_hash(args.plan), "comm": args.comm, "step_time_s": res.makespan})
    print(f"trace: {write_json(args.trace or args.plan.parent / 'predicted_trace.json', trace)}")
    if args.gantt is not None:
        from .gantt import plot_gantt

        print(f"gantt: {plot_gantt(res, args.gantt, show_completion_time=True)}")
    return 0


def cmd_topology(args: argparse.Namespace) -> int:
    from .scale import load_workload
    from ..formats import Plan, write_json
    from ..topology import Network, Topology
    from .fast import replica_plan, replicas
    from .scale import Cluster, price_on_topology
    from .trace import predicted_trace

    plan = Plan.load(args.plan)
    wl = load_workload(args.model, plan.seq_len, args.dtype)
    fast = not args.full and replicas(plan) > 0
    res = price_on_topology(plan, wl, Cluster(Network(Topology.load(args.topology)), args.flops, args.tp), fast=fast)
    shown = replica_plan(plan) if fast else plan
    print(f"predicted step time: {res.makespan:.6f} s on {args.topology} ({plan.num_stages} stages, "
          f"{plan.world_size} ranks × tp {args.tp}; {'one replica shown' if fast else 'every rank'})")
    trace = predicted_trace(shown, res.timeline, metadata={"plan": str(args.plan), "topology": str(args.topology),
                                                           "step_time_s": res.makespan, "replica_only": fast})
    print(f"trace: {write_json(args.trace or args.plan.parent / 'predicted_trace.json', trace)}")
    return 0


def cmd_check_reference(args: argparse.Namespace) -> int:
    from .seed002.reference import check_cases, load_cases

    cases = load_cases(args.csv)
    bad = 0
    for case, got, err in check_cases(cases):
        ok = err is None and abs(got - case.completion_time) <= args.tolerance
        bad += not ok
        shown = err or f"{got!r}"
        print(f"case {case.case:>4}: expected {case.completion_time!r:<22} got {shown:<22} {'ok' if ok else 'MISMATCH'}")
    print(f"{len(cases) - bad}/{len(cases)} cases within {args.tolerance:g}")
    return 0 if bad == 0 else 1
