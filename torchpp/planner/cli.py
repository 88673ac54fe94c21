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

from ..argtypes import boolean as _bool, ints as _ints


def configure(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("optimising planner")
    g.add_argument("--layers", nargs="+", default=None,
                   help="layers_<host>.json files (one per measured host); with --strategy, an integer keeps only "
                        "the first N decoder layers")
    g.add_argument("--capacities", type=Path, default=None, help="capacities.json (hosts without a layers file)")
    g.add_argument("--bandwidth", type=Path, default=None, help="bandwidth.json")
    g.add_argument("--memory-model", type=Path, default=None,
                   help="memory_model.json from calibrate-memory (default: analytic)")
    g.add_argument("--activation-factor", type=float, default=None,
                   help="analytic memory: bytes kept per byte of block output (default 16)")
    g.add_argument("--devices", default=None,
                   help="devices.json ({host: memory_gb} or {host: {memory_gb, address, rank}}); with --strategy dp, "
                        "a device count")
    g.add_argument("--tied-embed", type=_bool, default=None, help="true/false: override the model's tied embeddings")
    g.add_argument("--max-stages", type=int, default=None)
    g.add_argument("--micro-batch-sizes", type=_ints, default=None, help="only these micro-batch sizes, e.g. 1,2,4")
    g.add_argument("--no-recompute", action="store_true", help="never recompute activations")
    g.add_argument("--exact-devices", type=int, default=5,
                   help="search every device order up to this many devices (default 5)")
    g.add_argument("--max-group", type=int, default=8, help="largest group beyond --exact-devices (default 8)")
    g.add_argument("--optimizer-s-per-gb", type=float, default=0.0,
                   help="optimizer step seconds per GB of parameters (not measured by profile; default 0)")
    g.add_argument("--out-dir", type=Path, default=None, help="write plan.json, stages.csv, steps.csv, "
                   "plan_meta.json, summary.txt and gantt.png here")
    g.add_argument("--compare", default=None, help="e.g. even,dp,pp,other_plan.json: price these too")
    e = p.add_argument_group("estimate-only")
    e.add_argument("--estimate", action="store_true", help="no measurements: costs from --model and --device-spec")
    e.add_argument("--device-spec", type=Path, default=None)
    e.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    s = p.add_argument_group("fixed strategies")
    s.add_argument("--strategy", choices=["even", "dp", "pp"], default=None,
                   help="even: S stages of equal layer counts (optionally groups); dp: one stage over N devices; "
                        "pp: one device per stage")
    s.add_argument("--model", default="qwen3-tiny", help="preset name or local HF checkpoint directory")
    s.add_argument("--stages", type=int, default=2)
    s.add_argument("--group-sizes", type=_ints, default=None, help="devices per stage, e.g. 2,1,1")
    s.add_argument("--hosts", default=None, help="comma-separated host names, one per device (rank order)")
    s.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=None, help="default: the layers files' (or 128)")
    p.add_argument("--schedule", choices=["1f1b", "gpipe"], default="1f1b")
    p.add_argument("--recompute", action="store_true", help="fixed strategies: recompute every layer")
    p.add_argument("--out", type=Path, default=Path("plan.json"), help="fixed strategies: output file")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.strategy is None and (args.layers or args.estimate):
        return run_search(args)
    if args.strategy is None:
        args.strategy = "even"
    return run_fixed(args)


def run_fixed(args: argparse.Namespace) -> int:
    from ..errors import UsageError
    from ..models.presets import ModelSpecError, load_config, model_info
    from ..schedules import build
    from .simple import dp_plan, even_plan, pp_plan

    num_layers = None
    if args.layers:
        if len(args.layers) != 1 or not args.layers[0].isdigit():
            raise UsageError("--layers: with --strategy, expected one integer (keep the first N layers)")
        num_layers = int(args.layers[0])
    try:
        info = model_info(load_config(args.model, num_layers), args.model)
    except ModelSpecError as e:
        raise UsageError(str(e)) from None
    kw = dict(seq_len=args.seq_len or 128, global_batch=args.global_batch, num_microbatches=args.microbatches,
              schedule=args.schedule, recompute=args.recompute,
              hosts=args.hosts.split(",") if args.hosts else None)
    if args.strategy == "dp":
        if not args.devices or not str(args.devices).isdigit() or int(args.devices) < 1:
            raise UsageError("--devices: expected a positive device count with --strategy dp")
        plan = dp_plan(info, devices=int(args.devices), **kw)
    elif args.strategy == "pp":
        plan = pp_plan(info, stages=args.stages, **kw)
    else:
        plan = even_plan(info, stages=args.stages, group_sizes=args.group_sizes, **kw)
    build(plan)  # proves the schedule is consistent before anyone runs it
    plan.save(args.out)
    print(f"wrote {args.out}: {plan.num_stages} stage(s), {plan.world_size} rank(s), "
          f"{plan.num_microbatches} x {plan.micro_batch_size} samples, {plan.schedule}")
    return 0


def run_search(args: argparse.Namespace) -> int:
    from ..errors import UsageError
    from ..formats import Bandwidth, Capacities, Devices, FormatError, LayersFile, MemoryModel
    from .cost import Links, Profiles
    from .memory import ANALYTIC_KP, MemoryEstimator

    if args.out_dir is None:
        raise UsageError("--out-dir: expected a directory for plan.json and the reports")
    inputs: dict = {}
    if args.estimate:
        from .estimate import estimate_profiles

        if args.device_spec is None:
            raise UsageError("--device-spec: expected a device spec JSON with --estimate")
        prof, bw, budget = estimate_profiles(args.model, str(args.device_spec), args.seq_len or 128, args.dtype)
        hosts = list(budget)
        bw_source = str(args.device_spec)
        inputs["device_spec"] = args.device_spec
        if args.devices:
            dv = Devices.load(args.devices)
            unknown = [h for h in dv.hosts if h not in budget]
            if unknown:
                raise FormatError(str(args.devices), unknown[0], f"a device of {args.device_spec}")
            hosts = dv.hosts
            budget = {h: dv.memory_bytes(h) for h in hosts}
    else:
        if not args.devices or str(args.devices).isdigit():
            raise UsageError("--devices: expected devices.json")
        if args.bandwidth is None:
            raise UsageError("--bandwidth: expected bandwidth.json (torchpp bandwidth parse)")
        paths = [Path(x) for x in args.layers]
        files = [LayersFile.load(x) for x in paths]
        cap = Capacities.load(args.capacities) if args.capacities else None
        prof = Profiles.from_layers(files, cap, [str(x) for x in paths], str(args.capacities or "capacities.json"))
        if args.seq_len and args.seq_len != prof.seq_len:
            raise UsageError(f"--seq-len: the layers files were measured at {prof.seq_len}; re-profile to plan "
                             f"for {args.seq_len}")
        dv = Devices.load(args.devices)
        hosts = dv.hosts
        budget = {h: dv.memory_bytes(h) for h in hosts}
        for h in hosts:  # every device must be priceable: its own layers file or a capacity
            if h not in prof.fwd and (cap is None or h not in cap.capacity):
                raise FormatError(str(args.devices), h, "a host with a layers file or an entry in capacities.json "
                                  f"(measured: {', '.join(sorted(prof.fwd))})")
        bw = Bandwidth.load(args.bandwidth)
        bw_source = str(args.bandwidth)
        inputs.update(layers=paths, capacities=args.capacities, bandwidth=args.bandwidth, devices=Path(args.devices))
    if args.tied_embed is not None:
        prof.model.tied_embeddings = args.tied_embed
    if args.memory_model:
        memory = MemoryEstimator.fitted(MemoryModel.load(args.memory_model), str(args.memory_model))
        inputs["memory_model"] = args.memory_model
    else:
        memory = MemoryEstimator.analytic(args.activation_factor or ANALYTIC_KP)
    links = Links(bw, bw_source)
    opt = args.optimizer_s_per_gb / 1e9 if args.optimizer_s_per_gb else None
    budget = memory.budgets(budget)
    search_and_write(args, prof, links, hosts, budget, memory, inputs,
                     dv if (not args.estimate or args.devices) else None, opt)
    return 0


def search_and_write(args, prof, links, hosts, budget, memory, inputs, devices, opt, extra_meta=None):
    """Search on loaded inputs and write plan.json and the reports into ``args.out_dir``.

    ``args`` carries the search options of ``torchpp plan`` (global_batch, schedule, max_stages,
    micro_batch_sizes, no_recompute, exact_devices, max_group, compare); ``torchpp replan``
    calls this with corrected costs so both commands search and report the same way.
    """
    from .report import input_hashes, predict, write_outputs
    from .search import Problem, search

    pb = Problem(profiles=prof, links=links, hosts=hosts, budget=budget, memory=memory,
                 global_batch=args.global_batch, schedule=args.schedule, max_stages=args.max_stages,
                 micro_batch_sizes=args.micro_batch_sizes, allow_recompute=not args.no_recompute,
                 exact_devices=args.exact_devices, max_group=args.max_group, optimizer_s_per_byte=opt)
    print(f"planning {prof.model.name} ({prof.model.num_layers} layers) on {len(hosts)} device(s), "
          f"global batch {args.global_batch}; memory: {memory.source}")
    res = search(pb, progress=print)
    plan = res.plan
    if devices is not None:
        apply_fixed_ranks(plan, devices)
    pred, tl = predict(plan, prof, links, memory, budget, opt)
    plan.predicted = pred
    plan.inputs = input_hashes(inputs)
    compare = compare_plans(args, plan, pb, budget) if args.compare else []
    meta = {
        "format": "torchpp.plan_meta/1",
        "model": prof.model.name, "hosts": hosts, "global_batch": args.global_batch, "schedule": args.schedule,
        "host_tables": dict(prof.origin),
        "search": {"mode": res.mode, "dp_candidates": res.dp_candidates, "priced": res.candidates_priced,
                   "planning_time_s": res.planning_time_s, "refined": res.refined, "max_stages": args.max_stages,
                   "micro_batch_sizes": args.micro_batch_sizes, "recompute": not args.no_recompute,
                   "candidates": [{"step_time_s": s, "stages": p.num_stages, "micro_batch_size": p.micro_batch_size,
                                   "devices": p.world_size} for s, p in res.priced]},
        "chosen": {"stages": plan.num_stages, "micro_batch_size": plan.micro_batch_size,
                   "num_microbatches": plan.num_microbatches, "devices": plan.world_size,
                   "idle": [h for h in hosts if h not in {d.host for s in plan.stages for d in s.devices}]},
        "predicted": {k: pred[k] for k in ("step_time_s", "throughput_samples_per_s", "lower_bound_s",
                                           "ratio_to_lower_bound", "bubble")},
        "compare": compare, "inputs": plan.inputs, **(extra_meta or {}),
    }
    write_outputs(args.out_dir, plan, tl, meta, compare)
    print((args.out_dir / "summary.txt").read_text(), end="")
    print(f"wrote {args.out_dir}/plan.json, stages.csv, steps.csv, plan_meta.json, summary.txt, gantt.png")
    return plan, pb


def apply_fixed_ranks(plan, devices) -> bool:
    """Use devices.json's ranks when every planned host has one and they number 0..W−1."""
    want = {d.host: devices.devices[d.host].rank for s in plan.stages for d in s.devices}
    if any(r is None for r in want.values()) or sorted(want.values()) != list(range(plan.world_size)):
        return False
    for s in plan.stages:
        for d in s.devices:
            d.rank = want[d.host]
    return True


def compare_plans(args, plan, pb, budget) -> list[dict]:
    """Price fixed strategies (and plan files) on the same devices, micro-batching and costs."""
    from ..errors import UsageError
    from ..formats import Plan
    from .report import predict
    from .search import fmt_bytes
    from .simple import dp_plan, even_plan, pp_plan

    out = []
    hosts = pb.hosts
    L = plan.model.num_layers
    kw = dict(seq_len=plan.seq_len, global_batch=plan.global_batch, schedule=plan.schedule)
    chosen = plan.predicted["step_time_s"]
    entries = [("chosen (optimal)", plan)]
    for name in [x.strip() for x in args.compare.split(",") if x.strip()]:
        try:
            if name in ("even", "pp"):
                S = min(len(hosts), L)
                m = plan.num_microbatches
                other = (even_plan if name == "even" else pp_plan)(plan.model, stages=S, num_microbatches=m,
                                                                   hosts=hosts[:S], **kw)
            elif name == "dp":
                m = next(x for x in range(plan.num_microbatches, 0, -1)
                         if plan.global_batch % x == 0 and plan.global_batch // x >= len(hosts))
                other = dp_plan(plan.model, devices=len(hosts), num_microbatches=m, hosts=hosts, **kw)
            else:
                other = Plan.load(name)
        except StopIteration:
            print(f"  compare {name}: global batch {plan.global_batch} too small for {len(hosts)} devices")
            continue
        except ValueError as e:
            raise UsageError(f"--compare {name}: {e}") from None
        entries.append((name, other))
    for name, p in entries:
        pred, _ = predict(p, pb.profiles, pb.links, pb.memory, budget, pb.optimizer_s_per_byte)
        worst = max(((d["memory_bytes"], d["budget_bytes"] or 0, d["host"]) for s in pred["stages"]
                     for d in s["devices"]), key=lambda x: x[0] / max(x[1], 1))
        oom = any(d["budget_bytes"] is not None and d["memory_bytes"] > d["budget_bytes"]
                  for s in pred["stages"] for d in s["devices"])
        out.append({"name": name, "step_time_s": pred["step_time_s"], "ratio": pred["step_time_s"] / chosen,
                    "memory": f"{fmt_bytes(worst[0])}/{fmt_bytes(worst[1])} ({worst[2]})", "oom": oom})
    return out
