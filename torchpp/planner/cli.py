"""`torchpp plan`: write plan.json from a strategy (even, dp, pp) or, later, the optimiser."""
from __future__ import annotations

import argparse
from pathlib import Path


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--strategy", choices=["even", "dp", "pp"], default="even",
                   help="even: S stages of equal layer counts (optionally groups); dp: one stage over N devices; "
                        "pp: one device per stage")
    p.add_argument("--model", default="qwen3-tiny", help="preset name or local HF checkpoint directory")
    p.add_argument("--layers", type=int, default=None, help="keep only the first N decoder layers")
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--group-sizes", type=_ints, default=None, help="devices per stage, e.g. 2,1,1")
    p.add_argument("--devices", type=int, default=None, help="devices for --strategy dp")
    p.add_argument("--hosts", default=None, help="comma-separated host names, one per device (rank order)")
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--schedule", choices=["1f1b", "gpipe"], default="1f1b")
    p.add_argument("--recompute", action="store_true", help="recompute every layer's activations in backward")
    p.add_argument("--out", type=Path, default=Path("plan.json"))
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..cli import UsageError
    from ..models.presets import ModelSpecError, load_config, model_info
    from ..schedules import build
    from .simple import dp_plan, even_plan, pp_plan

    try:
        info = model_info(load_config(args.model, args.layers), args.model)
    except ModelSpecError as e:
        raise UsageError(str(e)) from None
    kw = dict(seq_len=args.seq_len, global_batch=args.global_batch, num_microbatches=args.microbatches,
              schedule=args.schedule, recompute=args.recompute,
              hosts=args.hosts.split(",") if args.hosts else None)
    if args.strategy == "dp":
        if not args.devices or args.devices < 1:
            raise UsageError("--devices: expected a positive device count with --strategy dp")
        plan = dp_plan(info, devices=args.devices, **kw)
    elif args.strategy == "pp":
        plan = pp_plan(info, stages=args.stages, **kw)
    else:
        plan = even_plan(info, stages=args.stages, group_sizes=args.group_sizes, **kw)
    build(plan)  # proves the schedule is consistent before anyone runs it
    plan.save(args.out)
    print(f"wrote {args.out}: {plan.num_stages} stage(s), {plan.world_size} rank(s), "
          f"{plan.num_microbatches} x {plan.micro_batch_size} samples, {plan.schedule}")
    return 0
