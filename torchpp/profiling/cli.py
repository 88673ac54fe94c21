"""`torchpp profile`: measure per-block times and bytes on this host into layers_<host>.json."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..models.presets import DTYPE_NAMES, ModelSpecError
from .. import argtypes as T, validate as V


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="preset name (qwen3-0.6b, qwen3-tiny, ...) or a local HF "
                   "checkpoint directory (read offline)")
    p.add_argument("--seq-len", type=T.int_in(1, V.MAX_SEQ_LEN), default=128, help="tokens per sample (default 128)")
    p.add_argument("--batch", default="2", help="samples per step (default 2); a list such as 1,4 measures every "
                   "size and fits each block's per-call time (the largest size gives the block times)")
    p.add_argument("--dtype", default="float32", help=f"one of {', '.join(DTYPE_NAMES)} (default float32)")
    p.add_argument("--iters", type=T.int_in(1, 100_000), default=6, help="counted steps (default 6)")
    p.add_argument("--warmup", type=T.int_in(0, 100_000), default=2, help="steps run first and not counted (default 2)")
    p.add_argument("--threads", type=T.int_in(1, V.MAX_THREADS), default=1, help="torch intra-op threads (default 1)")
    p.add_argument("--host", type=T.host, default=None, help="name of this host in the file (default: $TORCHPP_HOST, else $HOST, else the hostname)")
    p.add_argument("--out", type=T.out_file, default=None, help="layers file to write (default layers_<host>.json)")
    p.add_argument("--trace", type=T.out_file, default=None, help="also write the counted steps as a Chrome trace")
    p.add_argument("--layers", type=T.int_in(1, V.MAX_LAYERS), default=None, help="profile only the first N decoder layers")
    p.add_argument("--attn-implementation", choices=["eager", "sdpa"], default=None,
                   help="attention kernels to time (default: the ones torchpp.train picks for the model)")
    p.add_argument("--seed", type=int, default=0, help="seed of preset weights and synthetic tokens")
    p.add_argument("--timer", choices=["cpp", "python"], default=None, help="force the span timer backend: cpp or python")
    p.add_argument("--no-call-probe", action="store_true",
                   help="skip the call probe: a few steps of torchpp's own runtime on a 2-stage pipeline of local "
                   "processes (~10 s) that measure the runtime's seconds per compute call on this host "
                   "(call_overhead_s, which the cost model adds to every forward and backward); skipped, it is 0")
    p.add_argument("--memory", type=T.size, default=None,
                   help="this host's memory limit, e.g. 2G, where the machine does not show it (the limit is the "
                   "smallest of this, its memory cgroup's, TORCHPP_HOST_MEMORY and the machine's memory); blocks it cannot hold (the embedding and tail of a "
                   "large vocabulary) are left out and priced by the planner from hosts that timed them")
    p.add_argument("--quiet", action="store_true", help="no progress lines and no summary")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..errors import UsageError
    from ..trace.chrome import TraceWriter
    from ..models.presets import load_config
    from .host_memory import DoesNotFit
    from .measure import ProfileConfig, format_summary, max_positions, measure_layers, stderr_progress

    if args.timer not in (None, "cpp", "python"):
        raise UsageError(f"--timer: expected cpp or python, got {args.timer!r}")
    from ..hostname import host_name
    try:
        host = host_name(args.host)
    except ValueError as e:
        raise UsageError(str(e)) from None
    try:
        batches = [int(x) for x in str(args.batch).split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"--batch: expected an integer or a list such as 1,4, got {args.batch!r}") from None
    if not batches:
        raise UsageError(f"--batch: expected an integer or a list such as 1,4, got {args.batch!r}")
    try:
        pc = ProfileConfig(model=args.model, seq_len=args.seq_len, batch=max(batches), dtype=args.dtype,
                           fit_batches=tuple(batches),
                           iters=args.iters, warmup=args.warmup, threads=args.threads, host=host,
                           num_layers=args.layers, seed=args.seed, timer=args.timer,
                           attn_implementation=args.attn_implementation, memory_bytes=args.memory)
        cfg = load_config(pc.model, pc.num_layers, pc.attn_implementation)  # reject a bad --model/--layers before any work
        limit = max_positions(cfg)
        if limit is not None and pc.seq_len > limit:
            raise ValueError(f"--seq-len: expected at most {limit} (the model's position limit), got {pc.seq_len}")
    except (ValueError, ModelSpecError) as e:
        raise UsageError(str(e)) from None
    out = Path(args.out or f"layers_{host}.json")
    tw = TraceWriter(world_size=1, rank=0) if args.trace else None
    # the probe first: its two ranks start while this process holds no model yet (a small host's memory)
    call_s = None if args.no_call_probe else call_overhead(args.threads, args.quiet)
    try:
        lf = measure_layers(pc, progress=None if args.quiet else stderr_progress(pc.model), trace=tw,
                            note=lambda line: print(f"profile: {line}", file=sys.stderr, flush=True))
    except (ModelSpecError, DoesNotFit) as e:
        raise UsageError(str(e)) from None
    if call_s is not None:
        lf.call_overhead_s = call_s
    lf.save(out)
    if tw is not None:
        tw.save(args.trace)
    if not args.quiet:
        print(format_summary(lf))
        print(f"runtime per compute call: {1e3 * lf.call_overhead_s:.3f} ms (call_overhead_s"
              + (", --no-call-probe)" if args.no_call_probe else ", call probe)"))
        print(f"wrote {out}" + (f" and {args.trace}" if args.trace else ""))
    return 0


def call_overhead(threads: int, quiet: bool) -> float:
    """The call probe's seconds per compute call; 0 with one warning when it cannot run (a plan
    priced from this file then under-predicts its steps, so the failure is never silent)."""
    import sys

    from .call_probe import CallProbeConfig, CallProbeError, probe_call_overhead

    cfg = CallProbeConfig(threads=threads)
    if not quiet:
        print(f"call probe: {cfg.steps} steps of the runtime on 2 local ranks ({cfg.model}, {cfg.microbatches} "
              f"micro-batches, gloo), timeout {cfg.timeout_s:g} s", file=sys.stderr, flush=True)
    try:
        res = probe_call_overhead(cfg)
    except CallProbeError as e:
        print(f"warning: the call probe failed, call_overhead_s = 0 in the layers file (plans priced from it "
              f"under-predict their steps; `torchpp replan` measures it from a run): {e}", file=sys.stderr)
        return 0.0
    return res.call_overhead_s
