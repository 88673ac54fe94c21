"""`torchpp speed-check`: time a host's profiled layers again, just before a run.

A plan is priced from a profile taken minutes or days before it runs; a host that has since got
slower (a Raspberry Pi throttling at 80 °C, a laptop on battery, a machine shared with other work)
makes every prediction of it wrong by the same factor. The check re-runs the host's own profile
(the same model slice, batch sizes, threads and seed; blocks only, no call probe, no optimizer)
and writes ``speed_check_<host>.json`` with measured / profiled seconds per decoder layer;
``torchpp simulate plan --speed-check`` then prices a plan at the speed the hosts have now.
Run it on every host at once, as the profile's speed files were taken, so both see the same
contention.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from ..formats import LayersFile, SpeedCheck
from .. import argtypes as T


def compare(reference: LayersFile, measured: LayersFile, reference_source: str) -> SpeedCheck:
    """``measured`` against ``reference`` at the reference's largest batch, layer by layer."""
    from ..cost import Profiles

    batch = reference.run.batch
    prof = Profiles.from_layers([reference], sources=[reference_source])
    before = prof.layer_seconds(reference.host, batch)
    now = Profiles.from_layers([measured], sources=["<speed check>"]).layer_seconds(measured.host, batch)
    ratio = statistics.median(float(n / b) for n, b in zip(now, before))
    return SpeedCheck(host=reference.host, reference=reference_source, batch=batch,
                      profiled_s=[float(x) for x in before], measured_s=[float(x) for x in now], ratio=ratio,
                      iters=measured.run.iters)


def check_speed(reference: LayersFile, reference_source: str, iters: int | None = None,
                warmup: int | None = None) -> SpeedCheck:
    """Profile what ``reference`` profiled (blocks only) and compare."""
    from .measure import ProfileConfig, measure_layers

    run, model = reference.run, reference.model
    pc = ProfileConfig(model=model.name, seq_len=run.seq_len, batch=run.batch, dtype=model.precision,
                       fit_batches=tuple(run.batches), iters=iters or run.iters,
                       warmup=run.warmup if warmup is None else warmup, threads=run.threads, host=reference.host,
                       num_layers=model.num_layers, seed=run.seed, extras=False)
    return compare(reference, measure_layers(pc), reference_source)


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--reference", required=True, type=T.existing_path,
                   help="this host's layers file from `torchpp profile` (a few layers are enough: the "
                   "check takes as long as that profile did without its call probe)")
    p.add_argument("--out", type=T.out_file, default=None, help="file to write (default speed_check_<host>.json)")
    p.add_argument("--iters", type=T.int_in(1, 100_000), default=None, help="counted steps (default: the reference's)")
    p.add_argument("--warmup", type=T.int_in(0, 100_000), default=None, help="uncounted steps (default: the reference's)")
    p.add_argument("--quiet", action="store_true", help="no summary line")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..errors import UsageError
    from ..models.presets import ModelSpecError

    ref = LayersFile.load(args.reference)
    if ref.model.source == "path" and not Path(ref.model.name).is_dir():
        raise UsageError(f"{args.reference}: model.name: expected the checkpoint directory it was profiled from, "
                         f"{ref.model.name!r} is not one here")
    try:
        sc = check_speed(ref, str(args.reference), args.iters, args.warmup)
    except (ValueError, ModelSpecError) as e:
        raise UsageError(f"{args.reference}: {e}") from None
    out = sc.save(args.out or f"speed_check_{sc.host}.json")
    if not args.quiet:
        word = "slower" if sc.ratio >= 1 else "faster"
        print(f"{sc.host}: {abs(sc.ratio - 1) * 100:.1f}% {word} than profiled (x{sc.ratio:.3f} per decoder layer at "
              f"batch {sc.batch}, {len(sc.profiled_s)} layer(s), {sc.iters} steps); wrote {out}", file=sys.stdout)
    return 0
