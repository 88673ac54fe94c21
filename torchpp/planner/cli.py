"""`torchpp plan`: plan.json from measurements (the optimiser), from a device spec, or a fixed strategy.

Measured (seed 000 step 5)::

    torchpp plan --layers layers_*.json --capacities capacities.json --bandwidth bandwidth.json \\
        [--memory-model memory_model.json] --devices devices.json --global-batch 32 --out-dir out/

Estimate-only: ``--estimate --model PRESET --device-spec spec.json``. Fixed strategies (no
search): ``--strategy even|dp|pp``.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from .. import argtypes as T, validate as V
from ..argtypes import boolean as _bool
from ..errors import UsageError
from ..formats import FULL_BACKWARD_ONE_CHUNK, KIND_NAMES, OPTIMIZERS, LayersFile, Predicted, parse_kinds
from . import api, bandwidth, capacities
from .api import Estimate, PlanInputs, PlanOptions, Strategy


def configure(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("optimising planner")
    g.add_argument("--layers", nargs="+", default=None,
                   help="layers_<host>.json files (one per measured host); with --strategy, an integer keeps only "
                        "the first N decoder layers")
    g.add_argument("--capacities", type=T.existing_path, default=None, help="capacities.json (hosts without a layers file)")
    g.add_argument("--bandwidth", type=T.existing_path, default=None, help="bandwidth.json")
    g.add_argument("--memory-model", type=T.existing_path, default=None,
                   help="memory_model.json from calibrate-memory (default: analytic)")
    g.add_argument("--activation-factor", type=T.float_in(0.0, 1e6, lo_open=True), default=None,
                   help="analytic memory: bytes kept per byte of block output (default 16)")
    g.add_argument("--devices", default=None,
                   help="devices.json ({host: memory_gb} or {host: {memory_gb, address, rank}}); with --strategy dp, "
                        "a device count")
    g.add_argument("--tied-embed", type=_bool, default=None, help="true/false: override the model's tied embeddings")
    g.add_argument("--max-stages", type=T.int_in(1, V.MAX_STAGES), default=None)
    g.add_argument("--micro-batch-sizes", type=T.int_list(1, V.MAX_GLOBAL_BATCH), default=None, help="only these micro-batch sizes, e.g. 1,2,4")
    g.add_argument("--no-recompute", action="store_true", help="never recompute activations")
    g.add_argument("--exact-devices", type=T.int_in(1, 8), default=5,
                   help="search every device order up to this many devices (default 5)")
    g.add_argument("--max-group", type=T.int_in(1, V.MAX_STAGES), default=8, help="largest group beyond --exact-devices (default 8)")
    g.add_argument("--optimizer-s-per-gb", type=T.float_in(0.0, 1e6), default=None,
                   help="optimizer step seconds per GB of parameters on every host (default: each host's rate "
                        "measured by profile, from its layers file or capacities.json; 0 where none was)")
    g.add_argument("--out-dir", type=T.out_dir, default=None, help="write plan.json, stages.csv, steps.csv, "
                   "plan_meta.json, summary.txt and gantt.png here")
    g.add_argument("--compare", default=None, help="e.g. even,pp,dp,single,other_plan.json: price these too, each fixed "
                   "strategy at its own best micro-batching (single: the best one device, or 'does not fit')")
    g.add_argument("--certify", action="store_true",
                   help="prove how close the plan is to the best plan of the space searched (at most 8 devices): "
                        "prints 'within X%% of optimal in this space', plan_meta.json keeps the certificate")
    g.add_argument("--allow-lossy", default=None, metavar="bf16,int8,diloco",
                   help="let the planner choose lossy wire formats per link (bf16, fp16, int8) and group syncs "
                        "(bf16, int8, powersgd at the rank --optimizer allows, diloco with its period H) where they "
                        "shorten the predicted step; the split "
                        "is searched again with the links priced in each allowed format (docs/planner.md); the "
                        "plan names each choice (stages[i].wire, stages[i].sync). Default: fp32 everywhere")
    g.add_argument("--optimizer", choices=list(OPTIMIZERS), default="adamw",
                   help="with --allow-lossy: the optimizer torchpp.train will run (default adamw, as its); PowerSGD "
                        "is offered at rank 4 under sgd; under adamw at rank hidden*(members-1)/16 and to groups of "
                        "at most 4 (docs/links.md); the plan records it")
    g.add_argument("--tied-rows", type=T.int_in(0, 2**31 - 1), default=0,
                   metavar="N", help="with --allow-lossy: distinct token ids a step touches, to price the exact "
                   "tied-weight sync that sends only those rows (default 0: every token of the step)")
    e = p.add_argument_group("estimate-only")
    e.add_argument("--estimate", action="store_true", help="no measurements: costs from --model and --device-spec")
    e.add_argument("--device-spec", type=T.existing_path, default=None)
    e.add_argument("--topology", type=Path, default=None,
                   help="topology.json or seed 001 text: choose pp/dp/tp for --devices N devices of --device-spec's "
                        "kind ({\"flops\": F} or its first device) on it, each layout priced by the fast path")
    s = p.add_argument_group("fixed strategies")
    s.add_argument("--strategy", choices=["even", "dp", "pp"], default=None,
                   help="even: S stages of equal layer counts (optionally groups); dp: one stage over N devices; "
                        "pp: one device per stage")
    s.add_argument("--model", default="qwen3-tiny", help="preset name or local HF checkpoint directory")
    s.add_argument("--stages", type=T.int_in(1, V.MAX_STAGES), default=2)
    s.add_argument("--group-sizes", type=T.int_list(1, V.MAX_STAGES), default=None, help="devices per stage, e.g. 2,1,1")
    s.add_argument("--hosts", type=T.hosts, default=None, help="comma-separated host names, one per device (rank order)")
    s.add_argument("--microbatches", type=T.int_in(1, V.MAX_MICROBATCHES), default=4)
    p.add_argument("--global-batch", type=T.int_in(1, V.MAX_GLOBAL_BATCH), default=8,
                   help=f"samples per step, 1..{V.MAX_GLOBAL_BATCH} (default 8)")
    p.add_argument("--seq-len", type=T.int_in(1, V.MAX_SEQ_LEN), default=None, help="default: the layers files' (or 128)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="precision of the plan; bfloat16: fp32 master weights and optimizer state with bf16 "
                        "autocast. Measured plans must match the layers files' (default: theirs; with --topology bfloat16, as "
                        "`simulate topology`; else float32)")
    p.add_argument("--schedule", type=schedule_arg, default=None,
                   help=f"search: auto (default: the best over {', '.join(KIND_NAMES)}), one kind or a "
                        f"comma-separated list; fixed strategies: {' or '.join(FULL_BACKWARD_ONE_CHUNK)} (default 1f1b)")
    p.add_argument("--recompute", action="store_true", help="fixed strategies: recompute every layer")
    p.add_argument("--out", type=T.out_file, default=Path("plan.json"), help="fixed strategies: output file")
    p.set_defaults(func=run)


def schedule_arg(text: str) -> str:
    """argparse type of ``--schedule`` (plan and replan): auto, one kind or a comma-separated list."""
    try:
        parse_kinds(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def run(args: argparse.Namespace) -> int:
    if args.topology is not None:
        return run_topology(args)
    if args.strategy is None and (args.layers or args.estimate):
        return run_search(args)
    if args.strategy is None:
        args.strategy = "even"
    return run_fixed(args)


def options_of(args: argparse.Namespace) -> PlanOptions:
    """The search options of `torchpp plan`'s flags."""
    return PlanOptions(global_batch=args.global_batch, schedule=args.schedule or "auto", max_stages=args.max_stages,
                       micro_batch_sizes=args.micro_batch_sizes, recompute=not args.no_recompute,
                       exact_devices=args.exact_devices, max_group=args.max_group,
                       compare=api.compare_names(args.compare), allow_lossy=_allow_lossy(args.allow_lossy),
                       tied_rows=getattr(args, "tied_rows", 0), optimizer=getattr(args, "optimizer", "adamw"),
                       certify=getattr(args, "certify", False))


def _allow_lossy(text: str | None) -> frozenset[str]:
    from .wire import parse_allow

    try:
        return parse_allow(text)
    except ValueError as e:
        raise UsageError(str(e)) from None


def inputs_of(args: argparse.Namespace) -> PlanInputs:
    """The input files of `torchpp plan`'s flags, each required flag named when it is missing."""
    common = dict(capacities=args.capacities, memory_model=args.memory_model, activation_factor=args.activation_factor,
                  tied_embed=args.tied_embed, seq_len=args.seq_len, optimizer_s_per_gb=args.optimizer_s_per_gb)
    if not args.estimate:
        common["dtype"] = args.dtype
    if args.estimate:
        if args.device_spec is None:
            raise UsageError("--device-spec: expected a device spec JSON with --estimate")
        return PlanInputs(estimate=Estimate(model=args.model, device_spec=args.device_spec,
                                            dtype=args.dtype or "float32"),
                          devices=Path(args.devices) if args.devices else None, **common)
    if not args.devices or str(args.devices).isdigit():
        raise UsageError("--devices: expected devices.json")
    if args.bandwidth is None:
        raise UsageError("--bandwidth: expected bandwidth.json (torchpp bandwidth parse)")
    return PlanInputs(layers=[Path(x) for x in args.layers], bandwidth=args.bandwidth, devices=Path(args.devices),
                      **common)


def run_search(args: argparse.Namespace) -> int:
    if args.out_dir is None:
        raise UsageError("--out-dir: expected a directory for plan.json and the reports")
    result = api.plan(inputs_of(args), options_of(args), progress=print)
    api.write(result, args.out_dir)
    print(api.written_text(result, args.out_dir), end="")
    return 0


def run_fixed(args: argparse.Namespace) -> int:
    num_layers = None
    if args.layers:
        if len(args.layers) != 1 or not args.layers[0].isdigit():
            raise UsageError("--layers: with --strategy, expected one integer (keep the first N layers)")
        num_layers = int(args.layers[0])
    devices = int(args.devices) if args.devices and str(args.devices).isdigit() else None
    strategy = Strategy(name=args.strategy, model=args.model, num_layers=num_layers, stages=args.stages,
                        group_sizes=args.group_sizes, devices=devices,
                        hosts=args.hosts, microbatches=args.microbatches,
                        seq_len=args.seq_len or 128, recompute=args.recompute, dtype=args.dtype or "float32")
    schedule = args.schedule or "1f1b"
    if schedule not in FULL_BACKWARD_ONE_CHUNK:
        raise UsageError(f"--schedule: fixed strategies run {' or '.join(FULL_BACKWARD_ONE_CHUNK)}, got {schedule!r}")
    plan = api.fixed_plan(strategy, PlanOptions(global_batch=args.global_batch, schedule=schedule))
    plan.save(args.out)
    print(f"wrote {args.out}: {plan.num_stages} stage(s), {plan.world_size} rank(s), "
          f"{plan.num_microbatches} x {plan.micro_batch_size} samples, {plan.schedule}")
    return 0


def run_topology(args: argparse.Namespace) -> int:
    """`plan --estimate --topology T --devices N`: the fastest pp × dp × tp layout, written as plan.json."""
    from ..sim.scale import load_workload
    from ..formats import write_json
    from ..topology import Network, Topology
    from .scale import layouts

    if args.device_spec is None or not (args.devices and str(args.devices).isdigit()):
        raise UsageError("--topology: expected --device-spec (FLOP/s of one device) and --devices N (a count)")
    flops = _spec_flops(args.device_spec)
    net = Network(Topology.load(args.topology))
    wl = load_workload(args.model, args.seq_len or 128, args.dtype or "bfloat16")  # as `simulate topology`
    found = layouts(wl, net, int(args.devices), float(flops), args.global_batch, max_pp=args.max_stages)
    print(f"{len(found)} layouts of {args.devices} devices on {net.topology.name}; fastest first:")
    for x in found[:10]:
        print(f"  pp {x.pp:>3} dp {x.dp:>5} tp {x.tp} mb {x.microbatches:>4}: {x.step_time_s:.4f} s/step, "
              f"{x.throughput:.1f} samples/s")
    best = found[0]
    best.plan.predicted = Predicted(step_time_s=best.step_time_s, throughput_samples_per_s=best.throughput,
                                    extra={"layout": {"pp": best.pp, "dp": best.dp, "tp": best.tp},
                                           "topology": str(args.topology)})
    out = (args.out_dir or Path(".")) / "plan.json"
    best.plan.save(out)
    write_json(out.with_name("layouts.json"), [{"pp": x.pp, "dp": x.dp, "tp": x.tp, "microbatches": x.microbatches,
                                                "step_time_s": x.step_time_s} for x in found])
    print(f"wrote {out} (pp {best.pp} × dp {best.dp} × tp {best.tp}) and {out.with_name('layouts.json')}")
    return 0


def _spec_flops(path: Path) -> float:
    """FLOP/s of one device of a device spec: its ``flops``, or its first device's."""
    from ..formats import FormatError, Reader, read_json

    r = Reader(read_json(path), str(path))
    if "flops" in r.data:
        return r.float("flops", positive=True, max_value=V.MAX_NUMBER)
    devs = r.obj("devices", {})
    if not devs.data:
        raise FormatError(str(path), "flops", "FLOP/s of one device (or 'devices' with one that has 'flops')")
    return devs.obj(next(iter(devs.data))).float("flops", positive=True, max_value=V.MAX_NUMBER)


def configure_capacities(p: argparse.ArgumentParser) -> None:
    """`torchpp capacities`'s arguments."""
    p.add_argument("--inputs", nargs="+", required=True, action="append", type=T.existing_path,
                   help="layers_<host>.json files taken together; repeat --inputs for further rounds (each with "
                        "the reference host): a host's capacity is the median of its rounds")
    p.add_argument("--ref-host", required=True, type=T.host, help="host whose speed is 1.0")
    p.add_argument("--out", type=T.out_file, default=Path("capacities.json"))
    p.set_defaults(func=run_capacities)


def run_capacities(args: argparse.Namespace) -> int:
    """`torchpp capacities`: capacities.json from layers files, one line per host."""
    first, *more = [[(LayersFile.load(p), str(p)) for p in group] for group in args.inputs]
    cap = capacities.compute_capacities([f for f, _ in first], args.ref_host, [s for _, s in first],
                             again=[([f for f, _ in g], [s for _, s in g]) for g in more])
    cap.save(args.out)
    print(f"wrote {args.out} (reference {cap.ref_host})")
    for h, c in sorted(cap.capacity.items(), key=lambda kv: -kv[1]):
        opt = cap.optimizer_s_per_byte.get(h)
        split = cap.backward_split_factor.get(h)
        print(f"  {h:<16} capacity {c:.3f}  runtime {1e3 * cap.call_overhead_s.get(h, 0.0):.3f} ms/call"
              + (f", optimizer step {opt * 1e9:.3g} s/GB" if opt else "")
              + (f", split backward {split:.2f} x" if split else "")
              + (f" + {cap.backward_split_layer_s[h] * 1e3:.2f} ms per layer and call"
                 if cap.backward_split_layer_s.get(h) else "")
              + (" (rounds " + "/".join(f"{r[h]:.3f}" if h in r else "-" for r in cap.rounds)
                 + f": within {100 * cap.agreement[h]:.1f}% of the median, round {cap.consensus_round[h] + 1})"
                 if cap.rounds and h in cap.agreement else ""))
    for o in cap.outliers:
        print(f"  outlier: {o.line()}")
    return 0


def configure_bandwidth(p: argparse.ArgumentParser) -> None:
    """`torchpp bandwidth parse`'s arguments."""
    p.add_argument("--csv", required=True, type=T.existing_path, help="rows src_host,dst_host,gbps[,latency_ms], no header")
    p.add_argument("--out", type=T.out_file, default=Path("bandwidth.json"))
    p.add_argument("--assume-symmetric", action="store_true", help="fill a missing direction from the other one")
    p.set_defaults(func=run_bandwidth)


def run_bandwidth(args: argparse.Namespace) -> int:
    """`torchpp bandwidth parse`: bandwidth.json from an iperf3-style CSV."""
    bw = bandwidth.parse_links_csv(args.csv, args.assume_symmetric)
    bw.save(args.out)
    slow = min(bw.bytes_per_sec.items(), key=lambda kv: kv[1])
    print(f"wrote {args.out}: {len(bw.hosts())} hosts, {len(bw.bytes_per_sec)} links, slowest {slow[0]} "
          f"{slow[1] * 8 / 1e9:.3g} Gbit/s")
    return 0
