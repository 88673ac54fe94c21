"""Speed checks: a host's profiled layers timed again, just before a run (`torchpp speed-check`).

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

import statistics

from ..formats import LayersFile, SpeedCheck


def compare(reference: LayersFile, measured: LayersFile, reference_source: str) -> SpeedCheck:
    """``measured`` against ``reference`` at the reference's largest batch, layer by layer."""
    from ..cost import Profiles

    if (measured.model.name, measured.model.num_layers, measured.run.seq_len) != (
            reference.model.name, reference.model.num_layers, reference.run.seq_len):
        raise ValueError(f"{reference_source}: the check measured {measured.model.name} ({measured.model.num_layers} "
                         f"layer(s), seq {measured.run.seq_len}), not what the reference profiled "
                         f"({reference.model.name}, {reference.model.num_layers}, seq {reference.run.seq_len})")
    batch = reference.run.batch
    prof = Profiles.from_layers([reference], sources=[reference_source], layers_only=True)
    before = prof.layer_seconds(reference.host, batch)
    now = Profiles.from_layers([measured], sources=["<speed check>"], layers_only=True).layer_seconds(measured.host,
                                                                                                   batch)
    ratio = statistics.median(float(n / b) for n, b in zip(now, before))
    return SpeedCheck(host=reference.host, reference=reference_source, batch=batch,
                      profiled_s=[float(x) for x in before], measured_s=[float(x) for x in now], ratio=ratio,
                      iters=measured.run.iters)


def check_speed(reference: LayersFile, reference_source: str, iters: int | None = None,
                warmup: int | None = None) -> SpeedCheck:
    """Profile what ``reference`` profiled (blocks only) and compare."""
    from .measure import ProfileConfig, measure_layers

    run, model = reference.run, reference.model
    pc = ProfileConfig(model=model.path or model.name, seq_len=run.seq_len, batch=run.batch, dtype=model.precision,
                       fit_batches=tuple(run.batches), iters=iters or run.iters,
                       warmup=run.warmup if warmup is None else warmup, threads=run.threads, host=reference.host,
                       num_layers=model.num_layers, seed=run.seed, extras=False, left_out=tuple(reference.left_out))
    return compare(reference, measure_layers(pc), reference_source)
