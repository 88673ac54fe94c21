"""`torchrun -m torchpp.train --plan plan.json`: train a HF causal LM as the plan says.

Every rank runs this module. A bad plan or argument gives one error line on every rank
(exit 2) before any collective; ranks started with different plans, models, data or options,
or an unusable --checkpoint-dir, give one error line on every rank (exit 2) before any step;
a failed or stalled peer gives one line naming the action and the peer (exit 1) within
--timeout-s.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _steps(text: str) -> tuple[int, ...]:
    try:
        out = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated step numbers, got {text!r}") from None
    if any(s < 1 for s in out):
        raise argparse.ArgumentTypeError(f"expected 1-based step numbers, got {text!r}")
    return out


def _betas(text: str) -> tuple[float, float]:
    try:
        b1, b2 = (float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected two comma-separated numbers such as 0.9,0.95, got {text!r}") from None
    return b1, b2


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="torchpp.train", description=__doc__,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--plan", type=Path, required=True, help="plan.json (torchpp plan)")
    p.add_argument("--model", default=None, help="preset name or local HF checkpoint directory (default: the plan's "
                   "model: its preset or the directory it remembers); a different model than the plan's is refused")
    p.add_argument("--data", default="synthetic",
                   help="'synthetic', a corpus from `torchpp data prepare`, or text files, tables or a datasets "
                        "save_to_disk folder (prepared once into --data-cache)")
    p.add_argument("--steps", type=int, default=10, help="optimizer steps")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--optimizer", choices=["adamw", "sgd"], default="adamw")
    p.add_argument("--adam-eps", type=float, default=1e-8, help="AdamW's epsilon")
    p.add_argument("--adam-betas", type=_betas, default=(0.9, 0.999), help="AdamW's beta1,beta2")
    p.add_argument("--max-grad-norm", type=float, default=0.0,
                   help="clip the global gradient norm (all stages and groups) to this (0: no clipping)")
    p.add_argument("--lr-schedule", choices=["constant", "linear", "cosine"], default="constant",
                   help="learning-rate decay to 0 at --steps after the warm-up (as HF's schedulers)")
    p.add_argument("--warmup-steps", type=int, default=0, help="linear warm-up from 0 over this many steps")
    p.add_argument("--eval-every", type=int, default=0,
                   help="steps between evaluation losses (0: only after the last step when held-out data is given)")
    p.add_argument("--eval-fraction", type=float, default=0.0, help="hold out this fraction of --data for evaluation")
    p.add_argument("--eval-data", default=None, help="evaluate on this file or directory instead of a held-out split")
    p.add_argument("--eval-batches", type=int, default=1, help="global batches per evaluation")
    p.add_argument("--attn-implementation", choices=["eager", "sdpa"], default=None,
                   help="attention kernels (default: sdpa where HF supports it for the model, eager where HF "
                        "requires it)")
    p.add_argument("--text-column", default="text", help="the text column of .csv/.parquet/.json(l) data tables")
    p.add_argument("--tokenizer", default=None,
                   help="a HF tokenizer directory or 'bytes' (UTF-8 bytes as ids); default: the model directory's")
    p.add_argument("--split", default=None, help="the split of a datasets DatasetDict folder given as --data")
    p.add_argument("--data-cache", type=Path, default=None,
                   help="where raw --data is prepared once (default $TORCHPP_CACHE/corpus or ~/.cache/torchpp/corpus)")
    p.add_argument("--data-timeout-s", type=float, default=3600.0,
                   help="the longest a rank waits for another process preparing the same --data")
    p.add_argument("--seed", type=int, default=0, help="weight init and data order")
    p.add_argument("--threads", type=int, default=None, help="torch threads per rank (default: cores / local ranks)")
    p.add_argument("--trace-dir", type=Path, default=None, help="write Chrome traces of --trace-steps here")
    p.add_argument("--trace-steps", type=_steps, default=(2,), help="1-based steps to trace, e.g. 2,5")
    p.add_argument("--torch-profiler", action="store_true",
                   help="also record --trace-steps with torch.profiler, on the same clock as torchpp's traces")
    p.add_argument("--profile-blocks", action="store_true", help="per-block (embed/layer/tail) events in traces")
    p.add_argument("--checkpoint-dir", type=Path, default=None)
    p.add_argument("--checkpoint-every", type=int, default=0, help="steps between checkpoints (0: only the last)")
    p.add_argument("--keep-checkpoints", type=int, default=3,
                   help="complete checkpoints kept; older ones are deleted once a newer one is complete (0: keep all)")
    p.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint")
    p.add_argument("--export-dir", type=Path, default=None,
                   help="write the trained model here as a HF directory (weights, config, generation config, "
                        "tokenizer); default <checkpoint-dir>/final")
    p.add_argument("--log-dir", type=Path, default=None, help="TensorBoard scalars and metrics.jsonl (rank 0)")
    p.add_argument("--timeout-s", type=float, default=300.0, help="a peer silent this long is an error")
    p.add_argument("--layers", type=int, default=None, help="keep only the first N decoder layers")
    p.add_argument("--checkpoint-background", action="store_true",
                   help="write each checkpoint during the next step (the manifest still comes last)")
    p.add_argument("--full-checkpoint-every", type=int, default=0,
                   help="with --checkpoint-every 1: a full checkpoint every N steps and a log of the step's gradients "
                        "(a third of AdamW's bytes, replayed on resume) between them; 1: every checkpoint full "
                        "(default 10)")
    p.add_argument("--output-dir", type=Path, default=None,
                   help="checkpoints (step_<N>/) and the trained model (final/) unless --checkpoint-dir is given "
                        "(default: runs/<plan stem>/ beside the plan, as HF Trainer's output_dir)")
    p.add_argument("--no-output", action="store_true", help="save nothing (no default --output-dir)")
    p.add_argument("--accept-changes", action="store_true",
                   help="resume even from a checkpoint trained with other data, tokenizer, model or optimizer settings")
    p.add_argument("--heartbeat-dir", type=Path, default=None, help="each rank notes its last step here (elastic)")
    p.add_argument("--elastic-log", type=Path, default=None, help="the elastic driver's decisions (JSON lines)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if argv is None:  # a rank process: it ends when its launcher does (a call from Python is not one)
        from .runtime.lifecycle import die_with_parent

        die_with_parent()
    from .data import DataError
    from .formats import FormatError
    from .models.presets import ModelSpecError
    from .runtime.comm import PeerError
    from .runtime.exchange import DisagreementError
    from .runtime.trainer import TrainConfig, prepare, train, world_from_env

    rank = os.environ.get("RANK", "0")
    try:
        cfg = TrainConfig(plan=args.plan, model=args.model, data=args.data, steps=args.steps, lr=args.lr,
                          weight_decay=args.weight_decay, optimizer=args.optimizer, adam_eps=args.adam_eps, seed=args.seed,
                          threads=args.threads, trace_dir=args.trace_dir, trace_steps=args.trace_steps,
                          checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every,
                          keep_checkpoints=args.keep_checkpoints, resume=args.resume, log_dir=args.log_dir, timeout_s=args.timeout_s, layers=args.layers,
                          profile_blocks=args.profile_blocks, adam_betas=args.adam_betas,
                          max_grad_norm=args.max_grad_norm, lr_schedule=args.lr_schedule,
                          warmup_steps=args.warmup_steps, eval_every=args.eval_every,
                          eval_fraction=args.eval_fraction, eval_data=args.eval_data,
                          eval_batches=args.eval_batches, attn_implementation=args.attn_implementation,
                          text_column=args.text_column, tokenizer=args.tokenizer, split=args.split,
                          data_cache=args.data_cache, data_timeout_s=args.data_timeout_s, export_dir=args.export_dir,
                          torch_profiler=args.torch_profiler, checkpoint_background=args.checkpoint_background,
                          full_checkpoint_every=args.full_checkpoint_every,
                          heartbeat_dir=args.heartbeat_dir, elastic_log=args.elastic_log,
                          output_dir=_output_dir(args), accept_changes=args.accept_changes)
        prepared = prepare(cfg, world_from_env()[1])
    except (FormatError, ModelSpecError, DataError, ValueError) as e:
        print(f"torchpp.train: rank {rank}: error: {e}", file=sys.stderr, flush=True)
        return 2
    try:
        summary = train(cfg, prepared)
    except DisagreementError as e:
        print(f"torchpp.train: rank {rank}: error: {e}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(2)  # the same error on every rank; nothing was trained or written
    except (PeerError, DataError, ModelSpecError) as e:
        print(f"torchpp.train: error: {e}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)  # waiter threads and a broken process group must not delay the exit
    except KeyboardInterrupt:
        print(f"torchpp.train: rank {rank}: interrupted", file=sys.stderr, flush=True)
        os._exit(130)
    if summary.stopped_by:
        sys.stdout.flush()
        return 128 + summary.stopped_by if summary.stopped_by > 0 else 1
    return 0


def _output_dir(args: argparse.Namespace) -> Path | None:
    """``--output-dir``, or by default ``runs/<plan stem>/`` beside the plan (none with --no-output)."""
    from .runtime.safekeeping import default_output_dir

    if args.no_output:
        return None
    return args.output_dir if args.output_dir is not None else default_output_dir(args.plan)


if __name__ == "__main__":
    sys.exit(main())
