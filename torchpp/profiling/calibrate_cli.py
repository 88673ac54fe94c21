"""`torchpp calibrate-memory`: the command line of :mod:`torchpp.profiling.calibrate`."""
from __future__ import annotations

import argparse
from pathlib import Path

from .. import argtypes as T, validate as V
from ..formats import FormatError, LayersFile
from ..cost.memory import describe
from .calibrate import calibrate, default_extra


def configure(p: argparse.ArgumentParser) -> None:
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
    p.add_argument("--microbatch", default=None, help="samples per span run, or sizes taken in turn such as 2,8 "
                   "(better separates weights from activations; default: run.batch)")
    p.add_argument("--seq-len", type=T.int_in(1, V.MAX_SEQ_LEN), default=None, help="default: the layers file's run.seq_len")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=T.int_in(1, V.MAX_THREADS), default=1)
    p.add_argument("--timeout", type=T.float_in(0.0, lo_open=True), default=300.0, help="seconds per span")
    p.add_argument("--out", type=T.out_file, default=Path("memory_model.json"))
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..errors import UsageError
    from ..models.presets import ModelSpecError, load_config, num_hidden_layers

    lf = LayersFile.load(args.layers)
    try:
        n = num_hidden_layers(load_config(args.model))
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
    print(f"calibrating memory of {args.model} on {lf.host}: {args.samples} span(s) + {zb} in I/W "
          f"order + {held} holding several micro-batches, micro-batch "
          f"{', '.join(map(str, batch))}")
    mm = calibrate(lf, args.model, samples=args.samples, batch=batch, seq_len=args.seq_len, seed=args.seed,
                   timeout_s=args.timeout, threads=args.threads, split_samples=zb, held_samples=held)
    mm.save(args.out)
    print(f"wrote {args.out}: {describe(mm)}")
    return 0
