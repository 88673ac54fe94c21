"""Lower bounds on a layout's priced step, known before it is built or priced, so the search can
skip layouts that cannot win.

A rank's compute actions run one after another in the replay (one compute thread per rank), so
a step is at least the busiest rank's compute. Over a group holding b samples of every
micro-batch in whole shares of at least one sample each, the busiest device computes at least
``min over shares of max_d (s_d·τ_d + τ0_d)`` per micro-batch (τ_d, τ0_d: its seconds per sample
and per call, nothing recomputed: recomputation only adds); m micro-batches pass. Around that
compute the rank waits for the pipeline's fill, and after it runs its all-reduces or waits for the
drain; links carry their sends one after another; where the backward is not split, one sample's
path forward and back passes every chunk (:func:`pipeline_bound`). A layout whose bound is not
below the step it would have to beat (the best priced step, or the current step of a local search)
is never priced: the search's answer is unchanged. ``tests/test_planner_prune.py`` holds the bound
below every priced step, with bursts and latencies on the links.
"""
from __future__ import annotations

from typing import Sequence

from .tables import Tables


def group_bound(t: Tables, group: Sequence[int], cuts: Sequence[tuple[int, int]], b: int, m: int) -> float:
    """Least compute seconds of a step on the busiest device of ``group`` holding chunks ``cuts``
    (kept in the tables' memo: layouts one move apart share most of their groups)."""
    key = ("bound", tuple(group), tuple(cuts), b, m)
    got = t.memo.get(key)
    if got is None:
        got = t.memo[key] = _group_bound(t, group, cuts, b, m)
    return got


def _group_bound(t: Tables, group: Sequence[int], cuts: Sequence[tuple[int, int]], b: int, m: int) -> float:
    per_sample = [sum(float(t.tau[(h, 0)][c]) for c in cuts) for h in group]
    per_call = [sum(float(t.tau0[(h, 0)][c]) for c in cuts) for h in group]
    if len(group) > b:  # no plan gives this group a sample each: the continuous bound
        samples = 0.0 if min(per_sample) <= 0.0 else b / sum(1.0 / x for x in per_sample)
        return m * (samples + min(per_call))
    # whole samples, at least one each (planner/allocate.py), every further one where it ends
    # soonest: the least busiest device over integer shares (greedy is exact for a min-max of
    # non-decreasing costs)
    shares = [1] * len(group)
    for _ in range(b - len(group)):
        i = min(range(len(group)), key=lambda j: (shares[j] + 1) * per_sample[j] + per_call[j])
        shares[i] += 1
    return m * max(n * x + y for n, x, y in zip(shares, per_sample, per_call))


def sync_bound(t: Tables, group: Sequence[int], cuts: Sequence[tuple[int, int]]) -> float:
    """Seconds of the group's gradient all-reduces (one per chunk, one after another, after the
    rank's last compute), as the search prices them: fp32 rings over the cost model's links."""
    if len(group) < 2:
        return 0.0
    key = ("sync", tuple(group), tuple(cuts))
    got = t.memo.get(key)
    if got is None:
        names = [t.hosts[h] for h in group]
        got = t.memo[key] = sum(t.pb.links.ring_allreduce(names, float(t.W[c])) for c in cuts)
    return got


def _tied_bound(t: Tables, first: Sequence[int], last: Sequence[int]) -> float:
    """Seconds of the tied embedding's all-reduce between the first and the last chunk's groups
    (none where one group holds both), after the gradient all-reduces of every rank in it."""
    if not t.pb.profiles.model.tied_embeddings or set(first) == set(last):
        return 0.0
    key = ("tied", tuple(sorted(set(first) | set(last))))
    got = t.memo.get(key)
    if got is None:
        got = t.memo[key] = t.pb.links.ring_allreduce([t.hosts[h] for h in key[1]], float(t.pb.profiles.tied_bytes))
    return got


def _passes(t: Tables, chunks: Sequence[tuple[tuple[int, int], Sequence[int]]], b: int
            ) -> tuple[list[float], list[float]]:
    """Per chunk (pipeline order), the least seconds of the first micro-batch's forward and of the
    last one's backward on it: on the group's soonest device, holding all b samples where the group
    is one device, at least one otherwise."""
    fw, bw = [], []
    for c, g in chunks:
        n = b if len(g) == 1 else 1
        key = ("pass", c, tuple(g), n)
        got = t.memo.get(key)
        if got is None:
            got = t.memo[key] = (
                min(n * float(t.pass_time[h][0][c]) + float(t.pass_time[h][1][c]) for h in g),
                min(n * float(t.pass_time[h][2][c]) + float(t.pass_time[h][3][c]) for h in g))
        fw.append(got[0])
        bw.append(got[1])
    return fw, bw


def _hops(t: Tables, chunks: Sequence[tuple[tuple[int, int], Sequence[int]]], b: int
          ) -> tuple[list[float], list[float]]:
    """Per boundary between chunk c and c+1, the least seconds of an activation's transfer forward
    and of its gradient's back: over the soonest pair of the two groups' devices, on a rested link
    (its burst taken off), all b samples where both groups are one device, at least one otherwise;
    0 where both chunks are on the same group."""
    xa, xg = [], []
    for (c, g), (_, g2) in zip(chunks, chunks[1:]):
        if tuple(g) == tuple(g2):
            xa.append(0.0)
            xg.append(0.0)
            continue
        n = b if len(g) == 1 and len(g2) == 1 else 1
        key = ("hop", c[1], tuple(g), tuple(g2), n)
        got = t.memo.get(key)
        if got is None:
            nbytes = n * float(t.out_bytes[c[1]])
            got = t.memo[key] = (min(_rested(t, x, y, nbytes) for x in g for y in g2),
                                 min(_rested(t, y, x, nbytes) for x in g for y in g2))
        xa.append(got[0])
        xg.append(got[1])
    return xa, xg


def _rested(t: Tables, src: int, dst: int, nbytes: float) -> float:
    a, b = t.hosts[src], t.hosts[dst]
    return t.pb.links.time(a, b, nbytes) - t.pb.links.burst_s(a, b, nbytes)[1]


def pipeline_bound(t: Tables, chunks: Sequence[tuple[tuple[int, int], Sequence[int]]], holder: Sequence[int],
                   b: int, m: int, split: bool) -> float:
    """The step's bound from the ranks' compute and the links (``chunks``: (layer cut, group) in
    pipeline order; ``holder[c]``: chunk c's group, by number):

    - each group's compute on its chunks from its k-th on, after the fill up to its k-th chunk, and
      then its all-reduces or (where the backward is not split) its drain, whichever is longer: a
      chunk's work can start no sooner than the first micro-batch's forward has passed every chunk
      before it; after its last compute a rank runs its all-reduces; after its last backward
      (on its first chunk or a later one) every chunk before its first runs one more;
    - where the backward is not split, one sample's path: its forward through every chunk and the
      transfers between them, then its backward back;
    - each link: its sends (m per boundary it carries) one after another, after the first could be
      posted and before what the last must still be followed by, less what its burst passes at once
      (the simulator's FIFO token bucket); between groups of several devices, every sample crossing
      one of their links, all links at once."""
    fw, bw = _passes(t, chunks, b)
    xa, xg = _hops(t, chunks, b)
    S = len(chunks)
    head, drain = [0.0], [0.0]  # head[c]: the first forward reaches chunk c; drain[c]: back from c to 0
    for c in range(S - 1):
        head.append(head[-1] + fw[c] + xa[c])
        drain.append(drain[-1] + bw[c] + xg[c])
    held: dict[int, list[int]] = {}
    for c, g in enumerate(holder):
        held.setdefault(g, []).append(c)
    tied = _tied_bound(t, chunks[0][1], chunks[-1][1])
    best = 0.0
    for cs in held.values():
        group = chunks[cs[0]][1]
        cuts = [chunks[c][0] for c in cs]
        sync = sync_bound(t, group, cuts) + (tied if cs[0] == 0 or cs[-1] == S - 1 else 0.0)
        after = max(sync, 0.0 if split else drain[cs[0]])
        for k, c in enumerate(cs):
            best = max(best, head[c] + group_bound(t, group, cuts[k:], b, m) + after)
    if not split:
        best = max(best, head[-1] + fw[-1] + bw[-1] + drain[-1])
    return max(best, _link_bound(t, chunks, fw, bw, head, drain, b, m, split))


def _link_bound(t: Tables, chunks: Sequence[tuple[tuple[int, int], Sequence[int]]], fw: Sequence[float],
                bw: Sequence[float], head: Sequence[float], drain: Sequence[float], b: int, m: int, split: bool
                ) -> float:
    """The busiest link's bound (:func:`pipeline_bound`): between two one-device groups, its FIFO's
    sends; between larger groups, every sample crossing one of their links, all links at once."""
    forward_done = head[-1] + fw[-1]
    # (sender group, receiver group) -> [earliest post, fp32 bytes of one micro-batch, after the last], per boundary
    sends: dict[tuple[tuple[int, ...], tuple[int, ...]], list[tuple[float, float, float]]] = {}
    for c, ((cut, g), (_, g2)) in enumerate(zip(chunks, chunks[1:])):
        g, g2 = tuple(g), tuple(g2)
        if g == g2:
            continue
        nbytes = b * float(t.out_bytes[cut[1]])
        sends.setdefault((g, g2), []).append(
            (head[c] + fw[c], nbytes, fw[c + 1] + (0.0 if split else bw[c + 1] + drain[c + 1])))
        sends.setdefault((g2, g), []).append((forward_done, nbytes, 0.0 if split else bw[c] + drain[c]))
    best = 0.0
    for (g, g2), got in sends.items():
        first = min(e for e, _, _ in got) + min(a for _, _, a in got)
        total = m * sum(nb for _, nb, _ in got)
        if len(g) == 1 and len(g2) == 1:
            lat, per_byte, depth = _link(t, g[0], g2[0])
            busy = m * len(got) * lat + total * per_byte - depth
        else:  # fluid: each link moves its share at its rate, less its bucket
            speed, saved = _links_between(t, g, g2)
            busy = (total - saved) / speed
        best = max(best, first + busy)
    return best


def _link(t: Tables, x: int, y: int) -> tuple[float, float, float]:
    """(latency, seconds per byte, bucket seconds) of the link x -> y (the cost model's transfer
    time is affine in the bytes)."""
    key = ("link", x, y)
    got = t.memo.get(key)
    if got is None:
        a, b, links = t.hosts[x], t.hosts[y], t.pb.links
        lat = links.time(a, b, 0.0)
        got = t.memo[key] = (lat, links.time(a, b, 1.0) - lat, links.burst_s(a, b, 0.0)[0])
    return got


def _links_between(t: Tables, g: tuple[int, ...], g2: tuple[int, ...]) -> tuple[float, float]:
    """(bytes per second, bytes their buckets pass at once) of every link from group g to g2."""
    speed, saved = 0.0, 0.0
    for x in g:
        for y in g2:
            _, per_byte, depth = _link(t, x, y)
            speed += 1.0 / per_byte
            saved += depth / per_byte
    return speed, saved


def layout_bound(t: Tables, stages: Sequence[tuple[tuple[int, int], Sequence[int]]], b: int, m: int,
                 split: bool = True) -> float:
    """A one-chunk layout's bound: stages as (layer cut, group of host indices); ``split``: the
    kind splits its backward (no path bound, no drain)."""
    return pipeline_bound(t, stages, range(len(stages)), b, m, split)


def chunk_bound(t: Tables, groups: Sequence[Sequence[int]], bounds: Sequence[int], position: Sequence[int], b: int,
                m: int, split: bool = True, quick: bool = False) -> float:
    """A chunked layout's bound: chunk c holds layers [bounds[c], bounds[c+1]) on ``groups[position[c]]``;
    ``quick``: only the busiest group's compute (a weaker bound, a fraction of the cost: a first filter
    over many layouts)."""
    cuts: list[list[tuple[int, int]]] = [[] for _ in groups]
    for c, g in enumerate(position):
        cuts[g].append((bounds[c], bounds[c + 1]))
    if quick:
        return max(group_bound(t, groups[g], cuts[g], b, m) for g in range(len(groups)) if cuts[g])
    chunks = [((bounds[c], bounds[c + 1]), groups[g]) for c, g in enumerate(position)]
    return pipeline_bound(t, chunks, position, b, m, split)
