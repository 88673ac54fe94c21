"""Where in a rank's list each of its sends is surely delivered, read off the whole schedule.

A gloo send completes once its bytes are written; the peer's receive completes once they are
read. So once the peer has waited on the receive, the send is complete, and waiting on it costs
nothing (at most the microseconds its own I/O thread takes to mark it). The sender learns that
its peer got past that receive from a message the peer posted later (its arrival) or from a
collective with the peer that the peer entered later (its completion). From that point in the
sender's list the send is waited on inline by the compute loop and its buffer freed: no waiter
thread has to be woken to wait on it, and the compute loop is not interrupted by one (what a
waiter thread costs is a queue hand-off, two thread wake-ups and two turns of the GIL per send).

In 1F1B every activation sent to the next stage is known delivered when a gradient comes back
from that stage (at the latest its own, just before the backward that frees the activation
anyway), and a gradient sent back when the next activation arrives from the same peer. A send that nothing
later in the step proves delivered (the last gradients of a step, GPipe's gradients) keeps a
waiter thread, so no buffer lives longer than it did.
"""
from __future__ import annotations

from bisect import bisect_right
from collections import Counter

from ..schedules import SENDS, Kind, Schedule


def _matches(schedule: Schedule) -> tuple[dict[tuple[int, int], int], dict[tuple[int, int], int]]:
    """(receiver, index) -> the index of its message's send on the sender, and (sender, index) -> the
    index of the send's receive on the receiver. Messages of one kind on one link are matched in
    list order, as ``schedules.validate`` proves they arrive."""
    sends: dict[tuple[int, int, Kind], list[int]] = {}
    for r, acts in schedule.items():
        for i, a in enumerate(acts):
            if a.is_send:
                sends.setdefault((r, a.peer, SENDS[a.kind]), []).append(i)
    taken: Counter = Counter()
    sent_at, received_at = {}, {}
    for r, acts in schedule.items():
        for j, a in enumerate(acts):
            if a.is_recv:
                key = (a.peer, r, a.kind)
                n, queue = taken[key], sends.get(key, [])
                taken[key] += 1
                if n < len(queue):
                    sent_at[(r, j)] = queue[n]
                    received_at[(a.peer, queue[n])] = j
    return sent_at, received_at


def _collectives(schedule: Schedule) -> dict[tuple[int, tuple, int], int]:
    """(rank, (group, tied), n) -> the index of that rank's n-th all-reduce of that group: the
    members run a group's all-reduces in the same order (``validate``)."""
    out = {}
    for r, acts in schedule.items():
        seen: Counter = Counter()
        for i, a in enumerate(acts):
            if a.kind == Kind.ALLREDUCE:
                g = (a.group, a.tied)
                out[(r, g, seen[g])] = i
                seen[g] += 1
    return out


def delivery_points(schedule: Schedule, rank: int) -> dict[int, tuple[int, ...]]:
    """index i in ``rank``'s list -> the indices of its sends known delivered once action i has run
    (the receive of a message its peer posted after receiving them, or a later all-reduce with
    that peer). Sends found in no entry are proved delivered by nothing in the step."""
    acts = schedule[rank]
    sent_at, received_at = _matches(schedule)
    coll = _collectives(schedule)
    # per peer: (my index, the peer's index it had run everything before), in my list's order
    news: dict[int, tuple[list[int], list[int]]] = {}
    seen: Counter = Counter()
    for i, a in enumerate(acts):
        if a.is_recv and (rank, i) in sent_at:
            mine, theirs = news.setdefault(a.peer, ([], []))
            mine.append(i)
            theirs.append(sent_at[(rank, i)])  # the peer posted it at that index: everything before ran
        elif a.kind == Kind.ALLREDUCE:
            g = (a.group, a.tied)
            n = seen[g]
            seen[g] += 1
            for m in a.group or ():
                if m != rank and (m, g, n) in coll:
                    mine, theirs = news.setdefault(m, ([], []))
                    mine.append(i)
                    theirs.append(coll[(m, g, n)])  # the member entered it there: everything before ran
    out: dict[int, list[int]] = {}
    for i, a in enumerate(acts):
        if not a.is_send or (rank, i) not in received_at:
            continue
        j = received_at[(rank, i)]  # the peer's receive: its wait returned only once the bytes were in
        mine, theirs = news.get(a.peer, ([], []))
        for k in range(bisect_right(mine, i), len(mine)):
            if theirs[k] > j:
                out.setdefault(mine[k], []).append(i)
                break
    return {i: tuple(v) for i, v in sorted(out.items())}

