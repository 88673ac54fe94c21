"""`torchpp capacities`: per-host speed relative to a reference host (seed 000 step 2).

``capacity[h]`` = the reference host's seconds over h's, forward + backward, summed over every block
both files measured (embedding, decoder layers, tail) at every batch size both measured
(``batch_times_s``; the run's batch where a file has one size). One ratio of totals, not a median of
per-layer ratios: on a host under a small CPU quota each span is off by whether a quota period's
pause falls inside it, an error of roughly fixed seconds, so the long spans and their sum are the
steadiest figure, and they weigh each block as a step does. On the demo's homelab profile the
median of two layers' ratios at batch 8 put pi3 at 0.319 of the laptop, the totals at 0.342 (its
quota ratio is 0.357); the even split, which puts the tail and 16 micro-batches of 2 on pi3, was
priced +11.6% against its run with the first and +4.8% with the second (the plan −0.1%, the
re-plan −1.2%, from +1.5% and +2.5%). Forward and backward together: a forward pass of a few
quota periods is bimodal, the backward, twice as long, steadier. Every measured host's own block
table is kept too: the planner prices a host from its own table where it has one and from the
scaled reference table only where it does not.
Each file's ``call_overhead_s`` (the runtime's seconds per compute call, measured by the profile's
call probe on that host) is carried too: a host priced from capacities keeps its own.
Each host's measured optimizer rate (``optimizer_s_per_byte``) travels with it the same way.

Profiles taken together can be given again as further rounds (``--inputs`` repeated): each round's
ratios are taken within the round, so a load that slowed every host at once cancels, and a host's
capacity is the median of its rounds. The reference host divides every capacity, so one profile of
it taken while something slowed it alone moves them all: on the demo's homelab one 2-layer profile
of the laptop read 29% slower than its whole-model profile a minute later on the same blocks, every
Pi's capacity came out ~20% high and the runs missed their prediction by 19.6%. With three rounds
one such profile is outvoted. The first round's files give the tables, call overhead and rates.
"""
from __future__ import annotations

import statistics
from typing import Sequence

from ..formats import Capacities, FormatError, HostTable, LayersFile
from ..cost import Profiles
from ..cost.profiles import check_same_model


def block_seconds(lf: LayersFile) -> dict[tuple[str, int], float]:
    """(block name, batch) -> forward + backward seconds of one call, for every block and batch size
    the file measured."""
    out = {}
    for b in (lf.embed, *lf.layers, lf.tail):
        rows = b.batch_times_s or [[lf.run.batch, b.forward_time_s, b.backward_time_s]]
        for n, fw, bw in rows:
            out[(b.name, int(n))] = fw + bw
    return out


def speed_ratio(ref: dict[tuple[str, int], float], mine: dict[tuple[str, int], float], source: str) -> float:
    """The reference's seconds over ``mine`` on the (block, batch) pairs both measured."""
    both = sorted(set(ref) & set(mine))
    if not both:
        raise FormatError(source, "layers", "a block measured at a batch size the reference host measured too "
                          f"(it has {sorted(mine)[:4]}..., the reference {sorted(ref)[:4]}...)")
    return float(sum(ref[k] for k in both) / sum(mine[k] for k in both))


def round_capacities(files: Sequence[LayersFile], ref_host: str, sources: Sequence[str]) -> dict[str, float]:
    """One round's ratios: each host's seconds against the reference's in the same round."""
    refs = [lf for lf in files if lf.host == ref_host]
    if not refs:
        raise FormatError(", ".join(sources), "host", f"the reference host {ref_host!r} among a round's files "
                          "(each --inputs is one round of profiles taken together)",
                          ", ".join(lf.host for lf in files))
    ref = block_seconds(refs[0])
    return {lf.host: speed_ratio(ref, block_seconds(lf), src) for lf, src in zip(files, sources)}


def _check_round(files: Sequence[LayersFile], sources: Sequence[str], first: LayersFile, src0: str,
                 hosts: dict[str, float]) -> None:
    """A further round: the first round's model (its first layers may be fewer), each host once, no new host."""
    seen: dict[str, str] = {}
    for lf, src in zip(files, sources):
        check_same_model(lf, src, first, src0, same_layers=False)
        if lf.host in seen:
            raise FormatError(src, "host", f"a host not already in this round ({seen[lf.host]})", lf.host)
        if lf.host not in hosts:
            raise FormatError(src, "host", f"a host of the first round ({', '.join(hosts)})", lf.host)
        seen[lf.host] = src


def compute_capacities(files: Sequence[LayersFile], ref_host: str, sources: Sequence[str] | None = None,
                       again: Sequence[tuple[Sequence[LayersFile], Sequence[str]]] = ()) -> Capacities:
    """``files``: one round of profiles; ``again``: further rounds ((files, sources) each), of the
    first round's hosts. A host's capacity is the median of its rounds' ratios."""
    sources = list(sources) if sources is not None else [f"layers_{f.host}.json" for f in files]
    prof = Profiles.from_layers(files, sources=sources)  # checks that all files describe one model
    if ref_host not in prof.fwd:
        raise FormatError("--ref-host", "ref_host", f"one of the measured hosts ({', '.join(prof.fwd)})", ref_host)
    rounds = [round_capacities(files, ref_host, sources)]
    for fs, srcs in again:
        _check_round(fs, srcs, files[0], sources[0], rounds[0])
        rounds.append(round_capacities(fs, ref_host, srcs))
    capacity = {h: float(statistics.median(r[h] for r in rounds if h in r)) for h in rounds[0]}
    tables = {}
    for lf in files:
        bl = [lf.embed, *lf.layers, lf.tail]
        tables[lf.host] = HostTable(batch=lf.run.batch, forward_time_s=[b.forward_time_s for b in bl],
                                    backward_time_s=[b.backward_time_s for b in bl],
                                    forward_fixed_s=[b.forward_fixed_s for b in bl],
                                    backward_fixed_s=[b.backward_fixed_s for b in bl])
    # each host's own, measured where it runs (0: not probed, so left out and scaled from the reference)
    call = {lf.host: lf.call_overhead_s for lf in files if lf.call_overhead_s > 0}
    opt = {lf.host: lf.optimizer_s_per_byte for lf in files if lf.optimizer_s_per_byte is not None}
    split = {lf.host: lf.backward_split_factor for lf in files if lf.backward_split_factor is not None}
    split_layer = {lf.host: lf.backward_split_layer_s for lf in files if lf.backward_split_layer_s is not None}
    return Capacities(ref_host=ref_host, capacity=capacity, tables=tables, call_overhead_s=call,
                      optimizer_s_per_byte=opt, backward_split_factor=split, backward_split_layer_s=split_layer,
                      rounds=rounds if len(rounds) > 1 else [])
