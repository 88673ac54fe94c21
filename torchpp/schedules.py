"""The one schedule: plan -> per-rank ordered action lists.

The runtime executes these lists, the simulator prices them and the planner searches over
plans by pricing them. Each order is written down once, per pipeline position (a device
group and the chunks it holds, ``Plan.placement``): 1F1B and GPipe in :func:`compute_order`,
interleaved 1F1B and its zero-bubble form (ZB-H1 is its one-chunk case) in
:func:`interleaved_order`, the V shape and ZBV in :func:`zbv_order`. Everything else (sends,
receives, all-reduces) is added by separate passes and then checked by :func:`validate`,
which proves every send has its receive in the same order on both sides, that a rank runs a
micro-batch's actions in dependency order, and that the lists cannot deadlock.

String forms (each parses back): ``<chunk><kind><microbatch>``, the kind one of ``F``
(forward), ``B`` (full backward), ``I`` (backward for the input gradient only), ``W``
(backward for the weight gradient only, after the ``I`` of the same micro-batch), ``SA``/
``RA``/``SG``/``RG`` (send/receive activation/gradient, ``>peer``/``<peer``, ``[a:b]``
samples), ``AR`` (all-reduce, ``T`` when tied, ``{ranks}``) and ``OPT``.
"""
from __future__ import annotations

import enum
import functools
import json
import re
from collections import defaultdict, deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from .formats import (KIND_NAMES, KINDS, SPLIT_BACKWARD, KindSpec, Placement, Plan, PlanStage, parse_kinds,
                      placement_of)


class Kind(enum.Enum):
    FORWARD = "F"
    BACKWARD = "B"
    BACKWARD_INPUT = "I"
    """Backward for the input gradient only (what the previous chunk waits for)."""
    BACKWARD_WEIGHT = "W"
    """Backward for the weight gradient only, of a micro-batch whose ``I`` already ran."""
    SEND_ACT = "SA"
    RECV_ACT = "RA"
    SEND_GRAD = "SG"
    RECV_GRAD = "RG"
    ALLREDUCE = "AR"
    OPTIMIZER = "OPT"

    # members are singletons: hash them by identity, in C (Enum's own hashes the name in Python,
    # and building and pricing a search's schedules hashes kinds a few hundred thousand times)
    __hash__ = object.__hash__


SENDS = {Kind.SEND_ACT: Kind.RECV_ACT, Kind.SEND_GRAD: Kind.RECV_GRAD}
RECVS = {v: k for k, v in SENDS.items()}
COMPUTE = (Kind.FORWARD, Kind.BACKWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT, Kind.OPTIMIZER)
PASSES = (Kind.FORWARD, Kind.BACKWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT)
"""Actions that run a chunk on a micro-batch (every compute action but the optimizer step)."""
GRAD_OUT = (Kind.BACKWARD, Kind.BACKWARD_INPUT)
"""Backward actions that produce the gradient the previous chunk receives."""
RELEASES = (Kind.BACKWARD, Kind.BACKWARD_WEIGHT)
"""Backward actions after which a micro-batch's activations are freed."""


@dataclass(frozen=True, slots=True)
class Action:
    """One step of one rank. Its string form parses back: ``1F0``, ``1SA0>2[0:4]``, ``0ART{0,3}``."""

    kind: Kind
    stage: int
    microbatch: int | None = None
    peer: int | None = None
    """The other rank of a send or receive."""
    samples: tuple[int, int] | None = None
    """Sample range [a, b) inside the micro-batch that this action computes or moves."""
    group: tuple[int, ...] | None = None
    """Ranks taking part in an ALLREDUCE."""
    tied: bool = False
    """ALLREDUCE of the tied embedding / lm_head weight between first and last stage."""
    # OPTIMIZER: one per rank, stepping every chunk it holds; its stage is the rank's first chunk.

    def __str__(self) -> str:
        s = f"{self.stage}{self.kind.value}"
        if self.kind == Kind.ALLREDUCE:
            return s + ("T" if self.tied else "") + "{" + ",".join(map(str, self.group or ())) + "}"
        if self.microbatch is not None:
            s += str(self.microbatch)
        if self.peer is not None:
            s += (">" if self.kind in SENDS else "<") + str(self.peer)
        if self.samples is not None:
            s += f"[{self.samples[0]}:{self.samples[1]}]"
        return s

    @property
    def is_send(self) -> bool:
        return self.kind in SENDS

    @property
    def is_recv(self) -> bool:
        return self.kind in RECVS


_ACTION_RE = re.compile(
    r"^(?P<stage>\d+)(?P<kind>OPT|SA|RA|SG|RG|AR|F|B|I|W)(?P<tied>T)?(?:\{(?P<group>[\d,]*)\})?"
    r"(?P<mb>\d+)?(?:[<>](?P<peer>\d+))?(?:\[(?P<a>\d+):(?P<b>\d+)\])?$"
)


def parse_action(text: str) -> Action:
    m = _ACTION_RE.match(text.strip())
    if not m:
        raise ValueError(f"not an action: {text!r} (expected e.g. '1F0', '1I0', '1W0', '1SA0>2[0:4]', '0AR{{0,1}}', '2OPT')")
    g = m.groupdict()
    return Action(
        kind=Kind(g["kind"]), stage=int(g["stage"]),
        microbatch=int(g["mb"]) if g["mb"] is not None else None,
        peer=int(g["peer"]) if g["peer"] is not None else None,
        samples=(int(g["a"]), int(g["b"])) if g["a"] is not None else None,
        group=tuple(int(x) for x in g["group"].split(",") if x) if g["group"] is not None else None,
        tied=bool(g["tied"]),
    )


Schedule = dict[int, list[Action]]


# ----------------------------------------------------------------------------- the orders
Step = tuple[Kind, int, int]
"""(kind, chunk, micro-batch): one compute step of a pipeline position's order."""


def compute_order(schedule: str, num_stages: int, stage: int, num_microbatches: int) -> list[tuple[Kind, int]]:
    """The forward/backward order of one stage: the only place 1F1B and GPipe are written."""
    m = num_microbatches
    if schedule == "gpipe":
        return [(Kind.FORWARD, i) for i in range(m)] + [(Kind.BACKWARD, i) for i in range(m)]
    if schedule == "1f1b":
        warmup = min(num_stages - stage - 1, m)
        order = [(Kind.FORWARD, i) for i in range(warmup)]
        for i in range(m - warmup):
            order += [(Kind.FORWARD, warmup + i), (Kind.BACKWARD, i)]
        order += [(Kind.BACKWARD, i) for i in range(m - warmup, m)]
        return order
    raise ValueError(f"unknown schedule {schedule!r}: expected one of 1f1b, gpipe")


def interleaved_order(p: int, v: int, position: int, m: int, zero_bubble: bool = False) -> list[Step]:
    """Megatron's interleaved 1F1B for the device at ``position`` of ``p`` holding chunks
    ``position + k·p`` (k < v), in torch's flexible form: micro-batches go in rounds of
    ``m // max(1, m // p)``, which must divide ``m``. Warm-up ``(v-1)·round + 2·(p-1-position)``
    forwards, then one forward and one backward, chunks taken a round at a time (forwards in
    chunk order, backwards in reverse). ``zero_bubble``: backwards split into ``I`` and ``W``,
    warm-up ``(v-1)·round + (p-1-position)``, and the device at ``position`` holds back its first
    ``position`` weight gradients to fill the bubble (ZB-H1 when v = 1)."""
    rounds = max(1, m // p)
    k = m // rounds
    if m % rounds:
        near = [n for n in range(max(1, m - 2 * p), m + 2 * p + 1) if n % max(1, n // p) == 0]
        below, above = max((n for n in near if n < m), default=None), min((n for n in near if n > m), default=None)
        raise ValueError(f"interleaved schedules run num_microbatches m in m // p rounds (p={p} devices) of equal "
                         f"size: expected m divisible by {rounds}, got {m} ({rounds} rounds of {k} leave "
                         f"{m - rounds * k} over); the nearest that work: "
                         + ", ".join(str(n) for n in (below, above) if n is not None))
    total = v * m
    warm = min((v - 1) * k + (1 if zero_bubble else 2) * (p - 1 - position), total)
    nxt: dict[tuple[Kind, int], int] = defaultdict(int)
    order: list[Step] = []
    pending: deque[tuple[int, int]] = deque()

    def step(kind: Kind, chunk: int) -> None:
        mb = nxt[(kind, chunk)]
        nxt[(kind, chunk)] += 1
        order.append((kind, chunk, mb))
        if kind == Kind.BACKWARD_INPUT:
            pending.append((chunk, mb))

    def weight() -> None:
        chunk, mb = pending.popleft()
        order.append((Kind.BACKWARD_WEIGHT, chunk, mb))

    for j in range(warm):
        step(Kind.FORWARD, (j // k) % v * p + position)
    for b in range(total):
        if warm + b < total:
            step(Kind.FORWARD, ((warm + b) // k) % v * p + position)
        step(Kind.BACKWARD_INPUT if zero_bubble else Kind.BACKWARD, (v - 1 - (b // k) % v) * p + position)
        if zero_bubble and b >= position:
            weight()
    while pending:
        weight()
    return order


def zbv_order(p: int, position: int, m: int) -> list[Step]:
    """ZBV (torch's ``ScheduleZBVZeroBubble``): the device at ``position`` holds chunk
    ``position`` (down the V) and chunk ``2p-1-position`` (back up). Warm-up ``2(p-position)-1``
    forwards of the first chunk, then ``position`` alternating forwards of both, ``p-position``
    forward+I+W of the second; steady state forward+I+W of each in turn; cool-down of input
    gradients with the weight gradients deferred. Written for at least ``2p-1`` micro-batches;
    with fewer, the steps of the missing ones are dropped."""
    n = max(2 * p - 1, m)
    c0, c1 = position, 2 * p - 1 - position
    cnt: dict[tuple[Kind, int], int] = defaultdict(int)
    order: list[Step] = []

    def step(kind: Kind, chunk: int) -> None:
        order.append((kind, chunk, cnt[(kind, chunk)]))
        cnt[(kind, chunk)] += 1

    F, I, W = Kind.FORWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT
    for _ in range(2 * (p - position) - 1):
        step(F, c0)
    for _ in range(position):
        step(F, c1), step(F, c0)
    for _ in range(p - position):
        step(F, c1), step(I, c1), step(W, c1)
    while cnt[(F, c1)] < cnt[(F, c0)] or cnt[(F, c0)] < n:
        if cnt[(F, c0)] < n:
            step(F, c0)
        step(I, c0), step(W, c0), step(F, c1), step(I, c1), step(W, c1)
    for _ in range(position):
        step(I, c0), step(I, c1)
    for _ in range(p - position):
        step(I, c0), step(W, c0)
    while cnt[(W, c1)] < cnt[(I, c1)]:
        step(W, c1)
    while cnt[(W, c0)] < cnt[(I, c0)]:
        step(W, c0)
    return [s for s in order if s[2] < m]


def merge_backward(order: list[Step]) -> list[Step]:
    """The same order with each ``I`` run as a full backward ``B`` and its ``W`` dropped: the
    V-shape 1F1B from ZBV (cross-chunk dependencies, and so deadlock freedom, are unchanged)."""
    return [(Kind.BACKWARD if k == Kind.BACKWARD_INPUT else k, c, mb) for k, c, mb in order
            if k != Kind.BACKWARD_WEIGHT]


# ----------------------------------------------------------------------------- the registry
OrderFn = Callable[[Placement, int, int], list[Step]]
"""(placement, pipeline position, micro-batches) -> that position's compute order."""

_ORDERS: dict[str, OrderFn] = {
    "1f1b": lambda pl, pos, m: [(k, pos, mb) for k, mb in compute_order("1f1b", pl.p, pos, m)],
    "gpipe": lambda pl, pos, m: [(k, pos, mb) for k, mb in compute_order("gpipe", pl.p, pos, m)],
    "zb-h1": lambda pl, pos, m: interleaved_order(pl.p, 1, pos, m, zero_bubble=True),
    "interleaved": lambda pl, pos, m: interleaved_order(pl.p, pl.v, pos, m),
    "interleaved-zb": lambda pl, pos, m: interleaved_order(pl.p, pl.v, pos, m, zero_bubble=True),
    "v": lambda pl, pos, m: merge_backward(zbv_order(pl.p, pos, m)),
    "zbv": lambda pl, pos, m: zbv_order(pl.p, pos, m),
}
"""Each kind's order function, attached to the kinds of ``formats.kinds`` (the one list of kinds)."""


@dataclass(frozen=True)
class ScheduleKind:
    """A schedule kind: its static facts (``formats.KindSpec``) and its order function."""

    spec: KindSpec
    order: OrderFn

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def placement(self) -> str:
        return self.spec.placement

    @property
    def split_backward(self) -> bool:
        return self.spec.split_backward

    @property
    def family(self) -> str | None:
        return self.spec.family


if set(_ORDERS) != set(KIND_NAMES):
    raise ImportError(f"schedules: order functions for {sorted(_ORDERS)}, kinds {sorted(KIND_NAMES)}")
REGISTRY: dict[str, ScheduleKind] = {name: ScheduleKind(KINDS[name], _ORDERS[name]) for name in KIND_NAMES}
"""Every schedule kind by name: what formats, the planner, the simulator and the help read."""
schedule_kinds = parse_kinds


def position_order(schedule: str, placement: Placement, position: int, m: int) -> list[Step]:
    """The compute order of the device group at ``position``: the one dispatch over schedule kinds."""
    return list(_position_order(schedule, placement, position, m))


@functools.lru_cache(maxsize=256)
def _position_order(schedule: str, placement: Placement, position: int, m: int) -> tuple[Step, ...]:
    """:func:`position_order`, kept: a pure function of its arguments, which a search asks again for
    every plan of the same shape."""
    kind = REGISTRY.get(schedule)
    if kind is None:
        raise ValueError(f"unknown schedule {schedule!r}: expected one of {', '.join(KIND_NAMES)}")
    return tuple(kind.order(placement, position, m))


def held_split(order: Iterable[Step]) -> list[dict[int, tuple[int, int]]]:
    """Per chunk, micro-batches held (forwarded, activations not yet freed by ``B`` or ``W``) and
    those of them whose ``I`` ran but not their ``W``, after each step of an order: what memory
    is read off."""
    held: dict[int, int] = defaultdict(int)
    split: dict[int, int] = defaultdict(int)
    out = []
    for kind, chunk, _ in order:
        if kind == Kind.FORWARD:
            held[chunk] += 1
        elif kind == Kind.BACKWARD_INPUT:
            split[chunk] += 1
        if kind in RELEASES:
            held[chunk] -= 1
        if kind == Kind.BACKWARD_WEIGHT:
            split[chunk] -= 1
        out.append({c: (held[c], split[c]) for c in held})
    return out


def held_counts(order: Iterable[Step]) -> list[dict[int, int]]:
    """``held_split`` without the split count."""
    return [{c: n for c, (n, _) in h.items()} for h in held_split(order)]


@functools.lru_cache(maxsize=65536)
def in_flight(schedule: str, num_stages: int, stage: int, num_microbatches: int) -> int:
    """Most micro-batches a stage has forwarded and not yet backwarded, read off its order: the
    activations it holds at its peak (cached: the planner asks for it in its inner loops).
    One chunk per device; :func:`in_flight_chunks` for several."""
    pl = placement_of(schedule, num_stages, 1)
    counts = held_counts(position_order(schedule, pl, pl.position[stage], num_microbatches))
    return max((sum(h.values()) for h in counts), default=0)


@functools.lru_cache(maxsize=65536)
def in_flight_chunks(schedule: str, placement: Placement, position: int, num_microbatches: int
                     ) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Every distinct (chunk, held) profile a device at ``position`` passes through, read off its
    order: a device's peak activation memory is the largest of ``Σ held·bytes(chunk)`` over them."""
    counts = held_counts(position_order(schedule, placement, position, num_microbatches))
    return tuple(sorted({tuple(sorted(h.items())) for h in counts}))


@functools.lru_cache(maxsize=65536)
def split_in_flight(schedule: str, num_stages: int, stage: int, num_microbatches: int) -> int:
    """Micro-batches between their I and W at the step of a one-chunk stage's order holding the
    most micro-batches (:func:`in_flight`), the fewest such of those steps: the n_w its peak is
    priced with (``cost.memory``). A micro-batch past its I holds less than one before it (the
    input pass frees the graph, ``models.deferred``), so the peak is the step where the most are
    still whole; a step holding one micro-batch fewer has at most one more past its I. 0 for
    schedules without a split backward."""
    pl = placement_of(schedule, num_stages, 1)
    steps = [tuple(map(sum, zip((0, 0), *h.values()))) for h in
             held_split(position_order(schedule, pl, pl.position[stage], num_microbatches))]
    if not steps:
        return 0
    top = max(n for n, _ in steps)
    return min(w for n, w in steps if n == top)


PeakState = tuple[int, int, bool]
"""(micro-batches held, of them between their I and their W, whether a W ran before) at one step
of a one-chunk stage's order."""


@functools.lru_cache(maxsize=65536)
def peak_states(schedule: str, num_stages: int, stage: int, num_microbatches: int) -> tuple[PeakState, ...]:
    """Every distinct state a one-chunk stage passes through, read off its order: its memory
    peaks at one of them (``cost.StageMemory.peak_over`` prices each and keeps the largest).

    Whether a W ran before matters: the heap a W leaves when it frees the gradients I set aside
    (the memory model's Kz) exists only after the first W. With as many micro-batches as stages
    (ZB-H1, n = p) a stage holds the most micro-batches before any W: [2, 7) of qwen3-homelab at 8
    samples, 4 of 4 held, peaked at 365 MiB with 4 micro-batches against 424 MiB with 8, whose
    steady state comes back to that count after W's. Schedules without a split backward have no
    W: their states are (held, 0, False), the largest being :func:`in_flight`."""
    pl = placement_of(schedule, num_stages, 1)
    order = position_order(schedule, pl, pl.position[stage], num_microbatches)
    most: dict[tuple[int, bool], int] = {}  # (past I, after a W) -> most held: a held micro-batch only adds
    after_w = False
    for (kind, _, _), h in zip(order, held_split(order)):
        after_w = after_w or kind == Kind.BACKWARD_WEIGHT
        n, w = map(sum, zip((0, 0), *h.values()))
        most[(w, after_w)] = max(n, most.get((w, after_w), 0))
    return tuple(sorted((n, w, a) for (w, a), n in most.items()))


Profile = tuple[tuple[int, int, int], ...]
"""(chunk, micro-batches held, of them between their I and their W) of each chunk at one step."""


@functools.lru_cache(maxsize=65536)
def held_profiles(schedule: str, placement: Placement, position: int, num_microbatches: int
                  ) -> tuple[Profile, ...]:
    """Every distinct (chunk, held, between I and W) profile a device at ``position`` passes
    through, read off its order (:func:`in_flight_chunks` with the split count)."""
    counts = held_split(position_order(schedule, placement, position, num_microbatches))
    return tuple(sorted({tuple(sorted((c, n, w) for c, (n, w) in h.items())) for h in counts}))


def rank_profiles(plan: Plan, rank: int) -> tuple[Profile, ...]:
    """``held_profiles`` of ``rank``'s position in ``plan``: every profile its order passes through."""
    pl = plan.placement()
    return held_profiles(plan.schedule, pl, pl.position[plan.stages_of_rank(rank)[0].index], plan.num_microbatches)


def rank_in_flight(plan: Plan, rank: int) -> dict[int, int]:
    """Most micro-batches each of ``rank``'s chunks holds at once (each chunk's own peak)."""
    pl = plan.placement()
    pos = pl.position[plan.stages_of_rank(rank)[0].index]
    out: dict[int, int] = {c: 0 for c in pl.chunks[pos]}
    for prof in in_flight_chunks(plan.schedule, pl, pos, plan.num_microbatches):
        for c, n in prof:
            out[c] = max(out[c], n)
    return out


# ----------------------------------------------------------------------------- passes
def sample_ranges(stage: PlanStage) -> dict[int, tuple[int, int]]:
    """rank -> [a, b) of every micro-batch, in the order the stage lists its devices."""
    out, a = {}, 0
    for d in stage.devices:
        out[d.rank] = (a, a + d.samples)
        a += d.samples
    return out


def _overlaps(mine: tuple[int, int], theirs: dict[int, tuple[int, int]], me: int) -> list[tuple[int, tuple[int, int]]]:
    """The other ranks holding samples of ``mine`` (the part ``me`` holds itself is a local hand-off)."""
    res = []
    for rank, (a, b) in sorted(theirs.items(), key=lambda kv: kv[1]):
        lo, hi = max(mine[0], a), min(mine[1], b)
        if lo < hi and rank != me:
            res.append((rank, (lo, hi)))
    return res


def add_communication(plan: Plan, compute: dict[int, list[Action]]) -> Schedule:
    """Wrap each forward/backward with the receives before it and the sends after it. Between two
    chunks on the same rank (V: chunk p-1 to p) the hand-off is local: no send, no receive."""
    ranges = [sample_ranges(s) for s in plan.stages]
    S = plan.num_stages
    out: Schedule = {}
    peers: dict[tuple[int, int], tuple[list, list]] = {}  # (rank, chunk) -> its peers before and after
    wrapped = (Kind.FORWARD, *GRAD_OUT)
    for rank, acts in compute.items():
        seq: list[Action] = []
        for a in acts:
            st, mb = a.stage, a.microbatch
            if a.kind not in wrapped:
                seq.append(a)
                continue
            got = peers.get((rank, st))
            if got is None:
                mine = ranges[st][rank]
                got = peers[(rank, st)] = (_overlaps(mine, ranges[st - 1], rank) if st > 0 else [],
                                           _overlaps(mine, ranges[st + 1], rank) if st + 1 < S else [])
            prev, nxt = got
            if a.kind == Kind.FORWARD:
                seq += [Action(Kind.RECV_ACT, st, mb, peer, rng) for peer, rng in prev]
                seq.append(a)
                seq += [Action(Kind.SEND_ACT, st, mb, peer, rng) for peer, rng in nxt]
            else:
                seq += [Action(Kind.RECV_GRAD, st, mb, peer, rng) for peer, rng in nxt]
                seq.append(a)
                seq += [Action(Kind.SEND_GRAD, st, mb, peer, rng) for peer, rng in prev]
        out[rank] = seq
    return out


def tied_group(plan: Plan) -> tuple[int, ...]:
    """Ranks of the tied-weight all-reduce: empty when every rank holding the embedding chunk also
    holds the tail chunk (one stage, or the V placement), which then shares the weight in-process."""
    first, last = set(plan.stages[0].ranks), set(plan.stages[-1].ranks)
    if not plan.model.tied_embeddings or first == last:
        return ()
    return tuple(sorted(first | last))


def add_sync(plan: Plan, sched: Schedule) -> Schedule:
    """Each chunk's group gradient all-reduce (in chunk order, the same total order on every
    rank), the tied-weight all-reduce where needed, then one optimizer step per rank."""
    tied = tied_group(plan)
    ends = (plan.stages[0].index, plan.stages[-1].index)
    out: Schedule = {}
    for rank, acts in sched.items():
        chunks = plan.stages_of_rank(rank)
        seq = list(acts)
        for st in chunks:
            if len(st.devices) > 1:
                seq.append(Action(Kind.ALLREDUCE, st.index, group=tuple(sorted(st.ranks))))
        mine = [st.index for st in chunks if st.index in ends]
        if tied and mine:
            seq.append(Action(Kind.ALLREDUCE, mine[0], group=tied, tied=True))
        seq.append(Action(Kind.OPTIMIZER, chunks[0].index))
        out[rank] = seq
    return out


def build(plan: Plan, validated: bool = True) -> Schedule:
    """plan -> {rank: [Action, ...]}: order, then communication, then sync, then validation
    (``validated=False``: none; the planner prices many plans and validates the one it returns)."""
    sched = add_sync(plan, add_communication(plan, compute_lists(plan)))
    if validated:
        validate(sched)
    return dict(sorted(sched.items()))


def build_forward(plan: Plan) -> Schedule:
    """plan -> forward-only lists (evaluation): each rank's order with its backward passes left out,
    then communication, then validation; no sync (nothing to all-reduce or step).

    The forwards keep their training order, micro-batches, sample ranges and messages, for every
    schedule kind (interleaved and V chunks included); ``validate`` proves the lists complete."""
    compute = {r: [a for a in acts if a.kind == Kind.FORWARD] for r, acts in compute_lists(plan).items()}
    sched = add_communication(plan, compute)
    validate(sched)
    return dict(sorted(sched.items()))


def compute_lists(plan: Plan) -> dict[int, list[Action]]:
    """Each rank's compute actions (F, B, I, W over its chunks) in the schedule's order."""
    pl = plan.placement()
    ranges = [sample_ranges(s) for s in plan.stages]
    compute: dict[int, list[Action]] = {}
    for pos, chunks in enumerate(pl.chunks):
        order = position_order(plan.schedule, pl, pos, plan.num_microbatches)
        for rank in plan.stages[chunks[0]].ranks:
            compute[rank] = [Action(kind, c, mb, samples=ranges[c][rank]) for kind, c, mb in order]
    return compute


# ----------------------------------------------------------------------------- validation
class ScheduleError(RuntimeError):
    pass


def _recv_matches(send: Action, recv: Action, src: int, dst: int) -> bool:
    return (SENDS[send.kind] == recv.kind and send.peer == dst and recv.peer == src
            and send.microbatch == recv.microbatch and send.samples == recv.samples)


def validate(sched: Schedule) -> None:
    """Run the lists with non-blocking sends and blocking receives/collectives.

    Messages of one kind (activations, gradients) on one link arrive in the order they were
    sent; the two kinds do not wait for each other (the runtime tags them apart: interleaved
    and V placements send both ways between the same two ranks). Fails (printing the grid
    with each rank's position) if a rank runs a micro-batch's steps out of dependency order,
    if a receive meets a different message than the one its peer sent next of that kind on
    that link, if a collective's members
    disagree, if no rank can move (deadlock), or if a send is never received.
    """
    pos = {r: 0 for r in sched}
    links: dict[tuple[int, int], deque[Action]] = {}
    for r, acts in sched.items():
        for a in acts:
            if (a.is_send or a.is_recv) and (a.peer is None or a.peer not in sched or a.peer == r):
                raise ScheduleError(f"rank {r}: {a} names peer {a.peer}, which is not another rank\n"
                                    + format_schedule(sched, {r: acts.index(a)}))
            if a.kind == Kind.ALLREDUCE and (not a.group or r not in a.group):
                raise ScheduleError(f"rank {r}: {a} does not include rank {r}\n"
                                    + format_schedule(sched, {r: acts.index(a)}))
    _check_local_order(sched)
    progress = True
    while progress:
        progress = False
        for r, acts in sched.items():
            while pos[r] < len(acts):
                a = acts[pos[r]]
                if a.is_send:
                    links.setdefault((r, a.peer, a.kind), deque()).append(a)
                elif a.is_recv:
                    q = links.get((a.peer, r, RECVS[a.kind]))
                    if not q:
                        break
                    if not _recv_matches(q[0], a, a.peer, r):
                        raise ScheduleError(f"rank {r} step {pos[r]}: {a} would receive {q[0]} sent by rank "
                                            f"{a.peer}\n" + format_schedule(sched, pos))
                    q.popleft()
                elif a.kind == Kind.ALLREDUCE:
                    heads = {m: (sched[m][pos[m]] if pos[m] < len(sched[m]) else None) for m in a.group}
                    if any(h is None or h.kind != Kind.ALLREDUCE for h in heads.values()):
                        break
                    bad = [m for m, h in heads.items() if (h.group, h.tied) != (a.group, a.tied)]
                    if bad:
                        raise ScheduleError(f"rank {r} step {pos[r]}: {a} meets {heads[bad[0]]} on rank "
                                            f"{bad[0]}\n" + format_schedule(sched, pos))
                    for m in a.group:
                        pos[m] += 1
                    progress = True
                    continue
                pos[r] += 1
                progress = True
    stuck = {r: p for r, p in pos.items() if p < len(sched[r])}
    if stuck:
        raise ScheduleError("deadlock: no rank can move; blocked at " +
                            ", ".join(f"rank {r} on {sched[r][p]}" for r, p in stuck.items()) + "\n" +
                            format_schedule(sched, pos))
    left = {k: list(map(str, q)) for k, q in links.items() if q}
    if left:
        raise ScheduleError(f"sends never received: {left}\n" + format_schedule(sched, pos))


def _overlap(a: tuple[int, int] | None, b: tuple[int, int] | None) -> bool:
    return a is None or b is None or (max(a[0], b[0]) < min(a[1], b[1]))


def _needs(a: Action, mine: dict[int, tuple[int, int] | None]) -> list[tuple[tuple[Kind, ...], int]]:
    """What must run earlier on the same rank before ``a``: (kinds, chunk) of the same micro-batch."""
    c = a.stage
    if a.kind == Kind.FORWARD:
        return [((Kind.FORWARD,), c - 1)] if c - 1 in mine and _overlap(mine[c - 1], a.samples) else []
    if a.kind in GRAD_OUT:
        out = [((Kind.FORWARD,), c)]
        if c + 1 in mine and _overlap(mine[c + 1], a.samples):
            out.append((GRAD_OUT, c + 1))
        return out
    if a.kind == Kind.BACKWARD_WEIGHT:
        return [((Kind.BACKWARD_INPUT,), c)]
    return []


def _check_local_order(sched: Schedule) -> None:
    """Each rank runs a micro-batch's steps in dependency order: forward before its backward, ``I``
    before ``W``, and across two chunks of the same rank (a local hand-off) the earlier chunk's
    forward first and the later chunk's backward first."""
    for r, acts in sched.items():
        mine = {a.stage: a.samples for a in acts if a.kind in PASSES}
        done: set[tuple[Kind, int, int | None]] = set()
        for i, a in enumerate(acts):
            for kinds, chunk in _needs(a, mine):
                if not any((k, chunk, a.microbatch) in done for k in kinds):
                    raise ScheduleError(f"rank {r} step {i}: {a} runs before "
                                        f"{'/'.join(k.value for k in kinds)} of chunk {chunk}, micro-batch "
                                        f"{a.microbatch} on the same rank\n" + format_schedule(sched, {r: i}))
            if a.kind in PASSES:
                if (a.kind, a.stage, a.microbatch) in done:
                    raise ScheduleError(f"rank {r} step {i}: {a} runs twice\n" + format_schedule(sched, {r: i}))
                done.add((a.kind, a.stage, a.microbatch))


def format_schedule(sched: Schedule, marks: dict[int, int] | None = None) -> str:
    """rank x step grid; ``*`` marks each rank's current (failing) step."""
    marks = marks or {}
    width = max((len(str(a)) for acts in sched.values() for a in acts), default=4) + 1
    lines = []
    for r in sorted(sched):
        cells = [("*" if marks.get(r) == i else " ") + str(a).ljust(width) for i, a in enumerate(sched[r])]
        if marks.get(r) == len(sched[r]):
            cells.append("*<end>")
        lines.append(f"rank {r:>3}: " + "".join(cells))
    return "\n".join(lines)


# ----------------------------------------------------------------------------- save / load
def to_json(sched: Schedule) -> dict[str, list[str]]:
    return {str(r): [str(a) for a in acts] for r, acts in sorted(sched.items())}


def from_json(data: dict[str, Iterable[str]]) -> Schedule:
    return {int(r): [parse_action(t) for t in acts] for r, acts in data.items()}


def save(sched: Schedule, path: str | Path) -> None:
    Path(path).write_text(json.dumps({"format": "torchpp.schedule/1", "ranks": to_json(sched)}, indent=1) + "\n")


def load(path: str | Path) -> Schedule:
    data = json.loads(Path(path).read_text())
    if data.get("format") != "torchpp.schedule/1":
        raise ValueError(f"{path}: field 'format': expected 'torchpp.schedule/1', got {data.get('format')!r}")
    return from_json(data["ranks"])
