"""`torchpp speed-check`: time this host's profiled layers again (see :mod:`.speed_check`)."""
from __future__ import annotations

import argparse
from pathlib import Path

from ..formats import LayersFile
from .. import argtypes as T


def configure(p: argparse.ArgumentParser) -> None:
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
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
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
