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

Outvoting is not enough: a round that disagrees with the others says the measurement went wrong
(on a quiet machine the emulated pi3 once read 0.411, 0.019 and 0.228 of the laptop in three
rounds), and the median of rounds that wide is a guess. So each host's rounds are compared with
their median: ``agreement[h]`` is the largest relative distance of one of them from it, and a round
farther than ``round_tolerance`` (what the two profiles' own step-to-step spread explains, at least
``MIN_TOLERANCE``) is listed in ``outliers``, for the caller to re-take (the demo does) or at least
report (with the CPU the machine lost to other guests of a virtual machine while that round was
profiled, where the profiles recorded it: steal slows a round without anything here being wrong).
``consensus_round[h]`` is the round whose ratio is the median, the profile a later
``speed-check`` should compare the host against (not round 1, which may be the outlier).
"""
from __future__ import annotations

import statistics
from typing import Sequence

from ..formats import Capacities, CapacityOutlier, FormatError, HostTable, LayersFile
from ..cost import Profiles
from ..cost.profiles import check_same_model


def block_seconds(lf: LayersFile) -> dict[tuple[str, int], float]:
    """(block name, batch) -> forward + backward seconds of one call, for every block and batch size
    the file measured."""
    out = {}
    for b in (b for b in (lf.embed, *lf.layers, lf.tail) if b.name not in lf.left_out):  # only what it timed
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


MIN_TOLERANCE = 0.10
"""Smallest relative distance from a host's median round that makes a round an outlier: rounds of
the emulated homelab that ran as they should agreed within a few percent, and 10% is where a
mispriced host starts to move the plan."""
SIGMAS = 3.0
"""Standard errors of a round's ratio (from its two profiles' step-to-step spread) that it may
stray from the median before the spread no longer explains it."""


def relative_error(lf: LayersFile) -> float:
    """Relative standard error of a profile's seconds per step (forward + backward of its blocks at
    the run's batch, over the counted steps): how far its mean could move by chance alone. 0 when the
    file kept no per-step samples."""
    steps = [0.0] * min((len(b.forward_samples_s) for b in (lf.embed, *lf.layers, lf.tail)), default=0)
    for b in (lf.embed, *lf.layers, lf.tail):
        for i in range(len(steps)):
            steps[i] += b.forward_samples_s[i] + (b.backward_samples_s[i] if i < len(b.backward_samples_s) else 0.0)
    if len(steps) < 2 or statistics.fmean(steps) <= 0:
        return 0.0
    return statistics.stdev(steps) / statistics.fmean(steps) / len(steps) ** 0.5


def round_tolerance(ref: LayersFile, mine: LayersFile) -> float:
    """How far one round's ratio of ``mine`` to ``ref`` may stray from the host's median by the two
    profiles' own spread: ``SIGMAS`` combined standard errors, at least ``MIN_TOLERANCE``."""
    return max(MIN_TOLERANCE, SIGMAS * (relative_error(ref) ** 2 + relative_error(mine) ** 2) ** 0.5)


def median_index(values: Sequence[float]) -> int:
    """Index of the median value (the lower middle one for an even count): a round that was measured."""
    order = sorted(range(len(values)), key=lambda i: (values[i], i))
    return order[(len(values) - 1) // 2]


def judge_rounds(rounds: Sequence[dict[str, float]], tolerances: Sequence[dict[str, float]], ref_host: str,
                 ref_seconds: Sequence[float]) -> tuple[dict[str, int], dict[str, float], list[CapacityOutlier]]:
    """Per host: the round whose ratio is the median, the largest relative distance of a round from
    it, and every round beyond its tolerance. The reference host's ratio is 1 in every round: it
    agrees by definition and is never an outlier (a round in which it alone ran slow moves every other
    host's ratio, and they are reported), but its own profiles still differ, so its consensus is the
    round in which it ran at median speed (``ref_seconds``: its seconds per round on the blocks all
    its rounds measured). Its absolute speed is not judged: a machine that got busier for a round
    slows every host alike, which the round's ratios cancel."""
    consensus, agreement, outliers = {}, {}, []
    for h in rounds[0]:
        ks = [k for k, r in enumerate(rounds) if h in r]
        if h == ref_host:
            consensus[h], agreement[h] = ks[median_index([-ref_seconds[k] for k in ks])], 0.0
            continue
        vals = [rounds[k][h] for k in ks]
        mid = median_index(vals)
        consensus[h], med = ks[mid], vals[mid]
        agreement[h] = max(abs(v / med - 1.0) for v in vals)
        for k, v in zip(ks, vals):
            tol = tolerances[k].get(h, MIN_TOLERANCE)
            if abs(v / med - 1.0) > tol:
                outliers.append(CapacityOutlier(host=h, round=k, value=v, median=med, tolerance=tol))
    return consensus, agreement, outliers


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
    all_files = [list(files)]
    for fs, srcs in again:
        _check_round(fs, srcs, files[0], sources[0], rounds[0])
        rounds.append(round_capacities(fs, ref_host, srcs))
        all_files.append(list(fs))
    capacity = {h: float(statistics.median(r[h] for r in rounds if h in r)) for h in rounds[0]}
    consensus, agreement, outliers = {}, {}, []
    if len(rounds) > 1:
        refs = [next(lf for lf in fs if lf.host == ref_host) for fs in all_files]
        shared = set.intersection(*(set(block_seconds(lf)) for lf in refs))
        ref_seconds = [sum(block_seconds(lf)[k] for k in shared) for lf in refs]
        tolerances = [{lf.host: round_tolerance(r, lf) for lf in fs} for r, fs in zip(refs, all_files)]
        consensus, agreement, outliers = judge_rounds(rounds, tolerances, ref_host, ref_seconds)
        for o in outliers:  # what the machine lost to steal may be why (the host's or the reference's profile)
            stolen = [lf.run.cpu_steal_cores for lf in all_files[o.round]
                      if lf.host in (o.host, ref_host) and lf.run.cpu_steal_cores is not None]
            o.cpu_steal_cores = max(stolen, default=None)
    tables = {}
    for lf in files:
        if lf.left_out:  # the blocks it did not time as Profiles prices them (from the hosts that did)
            tables[lf.host] = prof.as_host_table(lf.host, lf.run.batch)
            continue
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
                      rounds=rounds if len(rounds) > 1 else [], consensus_round=consensus, agreement=agreement,
                      outliers=outliers)
