"""The one schedule: plan -> per-rank ordered action lists.

The runtime executes these lists, the simulator prices them and the planner searches over
plans by pricing them. The 1F1B and GPipe orders are written down once, in
:func:`compute_order`; everything else (sends, receives, all-reduces) is added by separate
passes and then checked by :func:`validate`, which proves every send has its receive in
the same order on both sides and that the lists cannot deadlock.
"""
from __future__ import annotations

import enum
import functools
import json
import re
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from .formats import Plan, PlanStage


class Kind(enum.Enum):
    FORWARD = "F"
    BACKWARD = "B"
    SEND_ACT = "SA"
    RECV_ACT = "RA"
    SEND_GRAD = "SG"
    RECV_GRAD = "RG"
    ALLREDUCE = "AR"
    OPTIMIZER = "OPT"


SENDS = {Kind.SEND_ACT: Kind.RECV_ACT, Kind.SEND_GRAD: Kind.RECV_GRAD}
RECVS = {v: k for k, v in SENDS.items()}
COMPUTE = (Kind.FORWARD, Kind.BACKWARD, Kind.OPTIMIZER)


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
    r"^(?P<stage>\d+)(?P<kind>OPT|SA|RA|SG|RG|AR|F|B)(?P<tied>T)?(?:\{(?P<group>[\d,]*)\})?"
    r"(?P<mb>\d+)?(?:[<>](?P<peer>\d+))?(?:\[(?P<a>\d+):(?P<b>\d+)\])?$"
)


def parse_action(text: str) -> Action:
    m = _ACTION_RE.match(text.strip())
    if not m:
        raise ValueError(f"not an action: {text!r} (expected e.g. '1F0', '1SA0>2[0:4]', '0AR{{0,1}}', '2OPT')")
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


# ----------------------------------------------------------------------------- the order
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


@functools.lru_cache(maxsize=65536)
def in_flight(schedule: str, num_stages: int, stage: int, num_microbatches: int) -> int:
    """Most micro-batches a stage has forwarded and not yet backwarded, read off its order: the
    activations it holds at its peak (cached: the planner asks for it in its inner loops)."""
    held = peak = 0
    for kind, _ in compute_order(schedule, num_stages, stage, num_microbatches):
        held += 1 if kind == Kind.FORWARD else -1
        peak = max(peak, held)
    return peak


# ----------------------------------------------------------------------------- passes
def sample_ranges(stage: PlanStage) -> dict[int, tuple[int, int]]:
    """rank -> [a, b) of every micro-batch, in the order the stage lists its devices."""
    out, a = {}, 0
    for d in stage.devices:
        out[d.rank] = (a, a + d.samples)
        a += d.samples
    return out


def _overlaps(mine: tuple[int, int], theirs: dict[int, tuple[int, int]]) -> list[tuple[int, tuple[int, int]]]:
    res = []
    for rank, (a, b) in sorted(theirs.items(), key=lambda kv: kv[1]):
        lo, hi = max(mine[0], a), min(mine[1], b)
        if lo < hi:
            res.append((rank, (lo, hi)))
    return res


def add_communication(plan: Plan, compute: dict[int, list[Action]]) -> Schedule:
    """Wrap each forward/backward with the receives before it and the sends after it."""
    ranges = [sample_ranges(s) for s in plan.stages]
    out: Schedule = {}
    for rank, acts in compute.items():
        st = plan.stage_of_rank(rank).index
        mine = ranges[st][rank]
        prev = _overlaps(mine, ranges[st - 1]) if st > 0 else []
        nxt = _overlaps(mine, ranges[st + 1]) if st + 1 < plan.num_stages else []
        seq: list[Action] = []
        for a in acts:
            mb = a.microbatch
            if a.kind == Kind.FORWARD:
                seq += [Action(Kind.RECV_ACT, st, mb, peer, rng) for peer, rng in prev]
                seq.append(a)
                seq += [Action(Kind.SEND_ACT, st, mb, peer, rng) for peer, rng in nxt]
            elif a.kind == Kind.BACKWARD:
                seq += [Action(Kind.RECV_GRAD, st, mb, peer, rng) for peer, rng in nxt]
                seq.append(a)
                seq += [Action(Kind.SEND_GRAD, st, mb, peer, rng) for peer, rng in prev]
            else:
                seq.append(a)
        out[rank] = seq
    return out


def add_sync(plan: Plan, sched: Schedule) -> Schedule:
    """Group gradient all-reduce, the tied-weight all-reduce, then the optimizer step."""
    first, last = plan.stages[0], plan.stages[-1]
    tied_group = tuple(sorted(set(first.ranks) | set(last.ranks)))
    out: Schedule = {}
    for rank, acts in sched.items():
        st = plan.stage_of_rank(rank)
        seq = list(acts)
        if len(st.devices) > 1:
            seq.append(Action(Kind.ALLREDUCE, st.index, group=tuple(sorted(st.ranks))))
        if plan.model.tied_embeddings and plan.num_stages > 1 and st.index in (first.index, last.index):
            seq.append(Action(Kind.ALLREDUCE, st.index, group=tied_group, tied=True))
        seq.append(Action(Kind.OPTIMIZER, st.index))
        out[rank] = seq
    return out


def build(plan: Plan) -> Schedule:
    """plan -> {rank: [Action, ...]}: order, then communication, then sync, then validation."""
    ranges = [sample_ranges(s) for s in plan.stages]
    compute = {
        rank: [Action(kind, s.index, mb, samples=ranges[s.index][rank])
               for kind, mb in compute_order(plan.schedule, plan.num_stages, s.index, plan.num_microbatches)]
        for s in plan.stages for rank in s.ranks
    }
    sched = add_sync(plan, add_communication(plan, compute))
    validate(sched)
    return dict(sorted(sched.items()))


# ----------------------------------------------------------------------------- validation
class ScheduleError(RuntimeError):
    pass


def _recv_matches(send: Action, recv: Action, src: int, dst: int) -> bool:
    return (SENDS[send.kind] == recv.kind and send.peer == dst and recv.peer == src
            and send.microbatch == recv.microbatch and send.samples == recv.samples)


def validate(sched: Schedule) -> None:
    """Run the lists with non-blocking sends and blocking receives/collectives.

    Fails (printing the grid with each rank's position) if a receive meets a different
    message than the one its peer sent next on that link, if a collective's members
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
    progress = True
    while progress:
        progress = False
        for r, acts in sched.items():
            while pos[r] < len(acts):
                a = acts[pos[r]]
                if a.is_send:
                    links.setdefault((r, a.peer), deque()).append(a)
                elif a.is_recv:
                    q = links.get((a.peer, r))
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
