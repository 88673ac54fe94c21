"""A schedule flattened into integer arrays once, and the per-action durations priced on it.

Every action of every rank gets an index; the stepping core and the comm models work on
these indices only (lists of ints and floats are what CPython reads fastest), and a sweep
that prices one pipeline shape thousands of times flattens it once.
"""
from __future__ import annotations

from ..schedules import Action, Kind, Schedule, ScheduleError, format_schedule
from .model import SimError
from .types import CostModel, Span, Timeline

# action codes (compute first: ``code <= OPT`` is a compute action; a receive's code is its send's + 2)
F, B, BI, BW, OPT, SA, SG, RA, RG, AR = range(10)
CODE = {Kind.FORWARD: F, Kind.BACKWARD: B, Kind.BACKWARD_INPUT: BI, Kind.BACKWARD_WEIGHT: BW, Kind.OPTIMIZER: OPT,
        Kind.SEND_ACT: SA, Kind.SEND_GRAD: SG, Kind.RECV_ACT: RA, Kind.RECV_GRAD: RG, Kind.ALLREDUCE: AR}


def compute_impact(fwd: float, bwd: float) -> list[float]:
    """Per compute code, the share of a rank's compute a concurrent gradient sync takes (every
    backward kind as a backward, the optimizer none)."""
    return [fwd, bwd, bwd, bwd, 0.0]
CTYPE = {SA: 0, SG: 1, AR: 2}
"""Comm type of a comm action: 0 fwd_prop, 1 grad_prop, 2 grad_sync (the seed's tie order)."""


class Compiled:
    """A schedule flattened into arrays once, so that pricing it again (a sweep) is cheap.

    ``prog[ri]`` lists rank ``ranks[ri]``'s action indices in order; ``match`` pairs each send
    with its receive; ``coll[a]`` names the all-reduce instance of ``a``, whose member indices
    are ``coll_members[coll[a]]`` (the first member stands for the whole collective).
    """

    def __init__(self, sched: Schedule):
        self.sched = sched
        self.ranks = sorted(sched)
        self.rank_pos = {r: i for i, r in enumerate(self.ranks)}
        sends, recvs, ars = self._flatten(sched)
        self.match = self._match_messages(sends, recvs)
        self.coll, self.coll_members = self._collectives(ars)
        self._comm: tuple | None = None

    def _flatten(self, sched: Schedule) -> tuple[dict[tuple, list[int]], list[int], list[int]]:
        acts: list[Action] = []
        owner: list[int] = []
        step: list[int] = []
        code: list[int] = []
        peer: list[int] = []
        prog: list[list[int]] = []
        sends: dict[tuple, list[int]] = {}
        recvs: list[int] = []
        ars: list[int] = []
        pos = self.rank_pos
        for ri, r in enumerate(self.ranks):
            idx = []
            for i, a in enumerate(sched[r]):
                ix = len(acts)
                idx.append(ix)
                acts.append(a)
                owner.append(ri)
                step.append(i)
                k = CODE[a.kind]
                code.append(k)
                pr = -1 if a.peer is None else pos.get(a.peer, -1)
                peer.append(pr)
                if k == SA or k == SG:
                    sends.setdefault((ri, pr, a.microbatch, a.samples, k), []).append(ix)
                elif k == RA or k == RG:
                    recvs.append(ix)
                elif k == AR:
                    ars.append(ix)
            prog.append(idx)
        self.acts, self.owner, self.prog, self.step, self.code, self.peer = acts, owner, prog, step, code, peer
        return sends, recvs, ars

    def _match_messages(self, sends: dict[tuple, list[int]], recvs: list[int]) -> list[int]:
        """Each receive with its send: the k-th message of a kind on a link, in list order."""
        acts, peer, owner, code, ranks = self.acts, self.peer, self.owner, self.code, self.ranks
        match = [-1] * len(acts)
        for a in recvs:
            act = acts[a]
            q = sends.get((peer[a], owner[a], act.microbatch, act.samples, code[a] - 2))
            if not q:
                raise ScheduleError(f"rank {ranks[owner[a]]}: {act} has no matching send\n"
                                    + format_schedule(self.sched, {ranks[owner[a]]: self.step[a]}))
            s = q.pop(0)
            match[a], match[s] = s, a
        return match

    def _collectives(self, ars: list[int]) -> tuple[list[int], list[list[int]]]:
        """The k-th all-reduce of (group, tied) on each member is one instance."""
        seen: dict[tuple, int] = {}
        inst: dict[tuple, list[int]] = {}
        coll = [-1] * len(self.acts)
        for a in ars:
            act = self.acts[a]
            key = (act.group, act.tied, self.owner[a])
            k = seen.get(key, 0)
            seen[key] = k + 1
            inst.setdefault((act.group, act.tied, k), []).append(a)
        members_of: list[list[int]] = []
        for (group, _tied, _k), members in inst.items():
            if len(members) != len(group or ()):
                raise ScheduleError(f"all-reduce over {group}: {len(members)} of {len(group or ())} members "
                                    "reach it\n" + format_schedule(self.sched))
            for a in members:
                coll[a] = len(members_of)
            members_of.append(members)
        return coll, members_of

    @property
    def ctype(self) -> list[int]:
        return self._comm_arrays()[0]

    @property
    def mbkey(self) -> list[int]:
        return self._comm_arrays()[1]

    @property
    def task_of(self) -> list[int]:
        return self._comm_arrays()[2]

    def _comm_arrays(self) -> tuple[list[int], list[int], list[int]]:
        """Per comm entry: type (0 fwd_prop, 1 grad_prop, 2 grad_sync), tie key, fluid task."""
        if self._comm is None:
            cm = self.coll_members
            self._comm = ([CTYPE.get(k, -1) for k in self.code],
                          [a.microbatch if a.microbatch is not None else 1 << 30 for a in self.acts],
                          [cm[ci][0] if ci >= 0 else a for a, ci in enumerate(self.coll)])
        return self._comm


def durations(c: Compiled, cost: CostModel) -> list[float]:
    """Seconds of every action at full speed (an all-reduce's on its first member's index).

    A cost model may price a whole compiled schedule at once (``cost.durations(c)``), which a
    sweep's parametric cost does; the values must equal :func:`durations_generic`'s.
    """
    fast = getattr(cost, "durations", None)
    if fast is not None:
        return fast(c)
    return durations_generic(c, cost)


def durations_generic(c: Compiled, cost: CostModel) -> list[float]:
    """Ask ``cost`` for every action that takes time (receives wait, they are not priced)."""
    ranks, acts, code, owner, peer, coll, members_of = c.ranks, c.acts, c.code, c.owner, c.peer, c.coll, \
        c.coll_members
    compute_s, transfer_s, allreduce_s = cost.compute_s, cost.transfer_s, cost.allreduce_s
    dur = [0.0] * len(acts)
    for a, k in enumerate(code):
        if k <= OPT:
            d = float(compute_s(ranks[owner[a]], acts[a]))
        elif k == SA or k == SG:
            d = float(transfer_s(ranks[owner[a]], ranks[peer[a]], acts[a]))
        elif k == AR and members_of[coll[a]][0] == a:
            d = float(allreduce_s(acts[a]))
        else:
            continue
        if not d >= 0:
            raise SimError(f"cost of {acts[a]} on rank {ranks[owner[a]]}: expected >= 0 seconds, got {d}")
        dur[a] = d
    return dur


def bursts(c: Compiled, cost: CostModel) -> list[tuple[float, float]] | None:
    """Per send, (its link's bucket, what a full bucket takes off it) in seconds, from the cost
    model's optional ``burst_s(src, dst, action)``; None where it has none (or prices none)."""
    burst_s = getattr(cost, "burst_s", None)
    if burst_s is None:
        return None
    ranks, acts, code, owner, peer = c.ranks, c.acts, c.code, c.owner, c.peer
    out = [(0.0, 0.0)] * len(acts)
    for a, k in enumerate(code):
        if k == SA or k == SG:
            out[a] = burst_s(ranks[owner[a]], ranks[peer[a]], acts[a])
    return out if any(depth > 0 for depth, _ in out) else None


def nics(c: Compiled, cost: CostModel) -> list[tuple[int, float, int, float]] | None:
    """Per send, (its sender's uplink, the seconds it holds it, its receiver's downlink, the seconds
    it holds that), interfaces numbered in order of first use, from the cost model's optional
    ``nic_s(src, dst, action) -> (src_host, up_s, dst_host, down_s)``; None where it has none."""
    nic_s = getattr(cost, "nic_s", None)
    if nic_s is None:
        return None
    ranks, acts, code, owner, peer = c.ranks, c.acts, c.code, c.owner, c.peer
    ids: dict[tuple[str, str], int] = {}
    out = [(0, 0.0, 0, 0.0)] * len(acts)
    for a, k in enumerate(code):
        if k == SA or k == SG:
            src, up, dst, down = nic_s(ranks[owner[a]], ranks[peer[a]], acts[a])
            u = ids.setdefault(("up", src), len(ids))
            d = ids.setdefault(("down", dst), len(ids))
            out[a] = (u, float(up), d, float(down))
    return out if any(up > 0 or down > 0 for _, up, _, down in out) else None


def timeline(c: Compiled, start: list[float], end: list[float], ready: list[float]) -> Timeline:
    """The per-rank spans of a finished run, in list order."""
    tl = Timeline({r: [] for r in c.ranks})
    acts, code = c.acts, c.code
    for ri, r in enumerate(c.ranks):
        spans = tl.spans[r]
        for a in c.prog[ri]:
            if code[a] <= OPT:
                spans.append(Span(r, acts[a], start[a], end[a]))
            else:
                spans.append(Span(r, acts[a], start[a], end[a], ready[a]))
    return tl


def check_finished(c: Compiled, pc: list[int]) -> None:
    """Raise with the schedule drawn if a rank's cursor stopped before its list's end (deadlock)."""
    stuck = {c.ranks[ri]: pc[ri] for ri in range(len(c.ranks)) if pc[ri] < len(c.prog[ri])}
    if stuck:
        raise ScheduleError("cannot price a schedule that deadlocks\n" + format_schedule(c.sched, stuck))
