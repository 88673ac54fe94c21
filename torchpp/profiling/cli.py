"""`torchpp profile`, `torchpp speed-check` and `torchpp calibrate-memory`: the profiling command lines.

`profile` measures per-block times and bytes on this host into layers_<host>.json; `speed-check`
times them again before a run; `calibrate-memory` fits the memory model from random spans."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable

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
    p.add_argument("--call-probe-steps", type=T.int_in(2, 100_000), default=None,
                   help="steps of the call probe, the first not measured (default 64: its mean needs many on a "
                   "small CPU quota; a check that the profile runs needs 3)")
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
    from .measure import ProfileConfig, codec_costs, format_summary, max_positions, measure_layers
    from ..trace import cpu_steal

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
        _check_activations_fit(cfg, pc.batch, pc.seq_len)
    except (ValueError, ModelSpecError) as e:
        raise UsageError(str(e)) from None
    out = Path(args.out or f"layers_{host}.json")
    tw = TraceWriter(world_size=1, rank=0) if args.trace else None
    # the probe first: its two ranks start while this process holds no model yet (a small host's memory)
    call_s = None if args.no_call_probe else call_overhead(args.threads, args.quiet, args.call_probe_steps)
    try:
        lf = measure_layers(pc, progress=None if args.quiet else stderr_progress(pc.model), trace=tw,
                            note=lambda line: print(f"profile: {line}", file=sys.stderr, flush=True))
    except (ModelSpecError, DoesNotFit) as e:
        raise UsageError(str(e)) from None
    if call_s is not None:
        lf.call_overhead_s = call_s
    lf.codec_s_per_byte = codec_costs(pc.seq_len * pc.batch, lf.model.hidden_size)
    lf.save(out)
    if tw is not None:
        tw.save(args.trace)
    if cpu_steal.slowed(lf.run.cpu_steal_cores, cpu_steal.cpus()):  # even with --quiet: the times are off
        print(f"warning: {lf.host}: this machine lost {cpu_steal.describe(lf.run.cpu_steal_cores, cpu_steal.cpus())} "
              "to other guests of the virtual machine (steal) while the blocks were timed; the times in "
              f"{out} include that slowdown", file=sys.stderr, flush=True)
    if not args.quiet:
        print(format_summary(lf))
        print(f"runtime per compute call: {1e3 * lf.call_overhead_s:.3f} ms (call_overhead_s"
              + (", --no-call-probe)" if args.no_call_probe else ", call probe)"))
        print(f"wrote {out}" + (f" and {args.trace}" if args.trace else ""))
    return 0


def _check_activations_fit(cfg, batch: int, seq_len: int) -> None:
    """Refuse a batch whose activations alone exceed this host's memory, before anything is
    allocated (a lower bound: the logits with their gradient and one layer's hidden states)."""
    import psutil

    from ..models.presets import hidden_size

    tokens = batch * seq_len
    need = tokens * 4 * (2 * int(cfg.vocab_size) + 4 * hidden_size(cfg))
    total = psutil.virtual_memory().total
    if need > total:
        raise ValueError(f"--batch {batch} x --seq-len {seq_len}: one step needs at least {need / 2**30:,.1f} GiB of "
                         f"activations, this host has {total / 2**30:,.1f} GiB: profile smaller batches")


def call_overhead(threads: int, quiet: bool, steps: int | None = None) -> float:
    """The call probe's seconds per compute call (``steps``: its steps, default its config's); 0
    with one warning when it cannot run (a plan priced from this file then under-predicts its
    steps, so the failure is never silent)."""
    import sys

    from .call_probe import CallProbeConfig, CallProbeError, probe_call_overhead

    cfg = CallProbeConfig(threads=threads) if steps is None else CallProbeConfig(threads=threads, steps=steps)
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


def stderr_progress(model: str) -> Callable[[str, int, int, float], None]:
    """tqdm bar on a terminal, else one line per step (readable in logs)."""
    if sys.stderr.isatty():
        from tqdm import tqdm

        bars: dict[str, tqdm] = {}

        def show(phase: str, i: int, n: int, step_s: float) -> None:
            if phase not in bars:
                bars[phase] = tqdm(total=n, desc=f"profile {model} {phase}", file=sys.stderr, unit="step")
            bars[phase].set_postfix_str(f"{step_s * 1e3:.1f} ms/step")
            bars[phase].update(1)
            if i == n:
                bars[phase].close()
        return show

    def line(phase: str, i: int, n: int, step_s: float) -> None:
        print(f"[profile] {model} {phase} {i}/{n}: step {step_s * 1e3:.1f} ms", file=sys.stderr, flush=True)
    return line


def configure_calibrate(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layers", required=True, type=T.existing_path, help="layers_<host>.json of this host (bytes per block)")
    p.add_argument("--model", required=True, help="preset name or local checkpoint (the profiled model)")
    p.add_argument("--samples", type=T.int_in(3, 10_000), default=20, help="number of random spans")
    p.add_argument("--zb-samples", type=T.int_in(0, 10_000), default=None,
                   help="more spans run in a ZB-H1 stage's own order of F, I and W to fit Kw, the bytes a "
                   "micro-batch holds between its I and its W (0: none, no Kw; default: a quarter of --samples)")
    p.add_argument("--held-samples", type=T.int_in(0, 10_000), default=None,
                   help="more spans holding several micro-batches at once (all F, then all B) to fit Kb, what "
                   "one running backward adds once however many are held (0: none, no Kb; default: a quarter "
                   "of --samples)")
    p.add_argument("--chunk-samples", type=T.int_in(0, 10_000), default=None,
                   help="more probes of one device holding two chunks in an interleaved order to fit Kc, the heap "
                   "each chunk beyond a device's first leaves (0: none, no Kc; default: a quarter of --samples)")
    p.add_argument("--microbatch", default=None, help="samples per span run, or sizes taken in turn such as 2,8 "
                   "(better separates weights from activations; default: run.batch)")
    p.add_argument("--seq-len", type=T.int_in(1, V.MAX_SEQ_LEN), default=None, help="default: the layers file's run.seq_len")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=T.int_in(1, V.MAX_THREADS), default=1)
    p.add_argument("--timeout", type=T.float_in(0.0, lo_open=True), default=300.0, help="seconds per span")
    p.add_argument("--out", type=T.out_file, default=Path("memory_model.json"))
    p.set_defaults(func=run_calibrate)


def run_calibrate(args: argparse.Namespace) -> int:
    """`torchpp calibrate-memory`: the command line of :mod:`torchpp.profiling.calibrate`."""
    from ..cost.memory import describe
    from ..formats import FormatError, LayersFile
    from .calibrate import calibrate, default_extra
    from ..errors import UsageError
    from ..models.presets import ModelSpecError, is_preset, load_config, num_hidden_layers, preset_info, resolve_model

    lf = LayersFile.load(args.layers)
    try:  # a preset's layers read off its table: this process imports no transformers (each span's process does)
        n = preset_info(args.model).num_layers if is_preset(args.model) else num_hidden_layers(load_config(args.model))
        if not is_preset(args.model):
            # every span reads the checkpoint in a fresh process: weights it would refuse (pickled, missing) are
            # refused here, in one line, instead of in each span's traceback
            from ..models.stages import safetensors_index

            safetensors_index(resolve_model(args.model))
    except ModelSpecError as e:
        raise UsageError(str(e)) from None
    if n != lf.model.num_layers:
        raise FormatError(str(args.layers), "model.num_layers", f"{n} (the layers of --model {args.model})",
                          lf.model.num_layers)
    if args.samples < 3:
        raise UsageError("--samples: expected at least 3 spans (three coefficients are fitted)")
    try:
        batch = [int(x) for x in str(args.microbatch).split(",")] if args.microbatch else [lf.run.batch]
    except ValueError:
        raise UsageError(f"--microbatch: expected an integer or a list such as 2,8, got {args.microbatch!r}") from None
    if min(batch) < 1:
        raise UsageError(f"--microbatch: expected sizes >= 1, got {args.microbatch!r}")
    zb, held = default_extra(args.samples, args.zb_samples), default_extra(args.samples, args.held_samples)
    chunks = default_extra(args.samples, args.chunk_samples)
    print(f"calibrating memory of {args.model} on {lf.host}: {args.samples} span(s) + {zb} in I/W "
          f"order + {held} holding several micro-batches + {chunks} device(s) of two chunks, micro-batch "
          f"{', '.join(map(str, batch))}")
    mm = calibrate(lf, args.model, samples=args.samples, batch=batch, seq_len=args.seq_len, seed=args.seed,
                   timeout_s=args.timeout, threads=args.threads, split_samples=zb, held_samples=held,
                   chunk_samples=chunks)
    mm.save(args.out)
    print(f"wrote {args.out}: {describe(mm)}")
    return 0


def configure_speed_check(p: argparse.ArgumentParser) -> None:
    p.add_argument("--reference", required=True, type=T.existing_path,
                   help="this host's layers file from `torchpp profile` (a few layers are enough: the "
                   "check takes as long as that profile did without its call probe)")
    p.add_argument("--out", type=T.out_file, default=None, help="file to write (default speed_check_<host>.json)")
    p.add_argument("--iters", type=T.int_in(1, 100_000), default=None, help="counted steps (default: the reference's)")
    p.add_argument("--warmup", type=T.int_in(0, 100_000), default=None, help="uncounted steps (default: the reference's)")
    p.add_argument("--host", type=T.host, default=None,
                   help="this host's name (default: $TORCHPP_HOST, else $HOST, else the reference's host); a name "
                   "given must be the reference's")
    p.add_argument("--quiet", action="store_true", help="no summary line")
    p.set_defaults(func=run_speed_check)


def run_speed_check(args: argparse.Namespace) -> int:
    """`torchpp speed-check`: time this host's profiled layers again (see :mod:`.speed_check`)."""
    from ..formats import LayersFile
    from ..errors import UsageError
    from ..models.presets import ModelSpecError
    from .speed_check import check_speed
    from ..hostname import host_name, host_source

    ref = LayersFile.load(args.reference)
    try:
        host = host_name(args.host, default=ref.host)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if host != ref.host:
        raise UsageError(f"{args.reference}: host: expected this host's layers file ({host!r}, from "
                         f"{host_source(args.host)}), got {ref.host!r}'s")
    where = ref.model.path or ref.model.name
    if ref.model.source == "path" and not Path(where).is_dir():
        raise UsageError(f"{args.reference}: model.{'path' if ref.model.path else 'name'}: expected the checkpoint "
                         f"directory it was profiled from, {where!r} is not one here")
    try:
        sc = check_speed(ref, str(args.reference), args.iters, args.warmup)
    except (ValueError, ModelSpecError) as e:
        raise UsageError(f"{args.reference}: {e}") from None
    out = sc.save(args.out or f"speed_check_{sc.host}.json")
    if not args.quiet:
        word = "slower" if sc.ratio >= 1 else "faster"
        print(f"{sc.host}: {abs(sc.ratio - 1) * 100:.1f}% {word} than profiled (x{sc.ratio:.3f} per decoder layer at "
              f"batch {sc.batch}, {len(sc.profiled_s)} layer(s), {sc.iters} steps); wrote {out}")
    return 0
