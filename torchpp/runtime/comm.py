"""Point-to-point and group communication over gloo, with bounded waits and named failures.

Receives are posted ahead (``irecv`` into a preallocated buffer) and sends are non-blocking,
so transfers overlap compute. Each outstanding operation is waited on by a daemon thread,
which stamps the moment it completed (gloo's p2p works offer no futures): the trace shows
when data really arrived, and the compute loop blocks only when it needs the data.

Every wait is bounded by ``timeout_s``: a dead peer (connection closed) or a stalled one
(timeout) becomes a :class:`PeerError` that names the action and the peer, never a hang.
"""
from __future__ import annotations

import datetime
import threading
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..schedules import Action, Kind, Schedule

_DESCR = {Kind.SEND_ACT: ("send_act", "to"), Kind.RECV_ACT: ("recv_act", "from"),
          Kind.SEND_GRAD: ("send_grad", "to"), Kind.RECV_GRAD: ("recv_grad", "from")}


class PeerError(RuntimeError):
    """A communication with another rank failed or did not finish within the timeout."""


def describe(action: Action) -> str:
    if action.kind in _DESCR:
        name, prep = _DESCR[action.kind]
        return f"{name} of micro-batch {action.microbatch} {prep} rank {action.peer} ({action})"
    if action.kind == Kind.ALLREDUCE:
        what = "tied-weight all-reduce" if action.tied else "gradient all-reduce"
        return f"{what} with ranks {list(action.group or ())} ({action})"
    return str(action)


def tag_of(action: Action) -> int:
    """One tag per (micro-batch, direction, first sample): a receive can only match its own send."""
    grad = action.kind in (Kind.SEND_GRAD, Kind.RECV_GRAD)
    lo = action.samples[0] if action.samples else 0
    return (((action.microbatch or 0) << 1 | int(grad)) << 16) | lo


@dataclass(eq=False)
class Pending:
    """One posted send or receive; ``done_s`` is stamped by its waiter thread."""

    action: Action
    tensor: torch.Tensor
    work: object
    posted_s: float
    timeout_s: float
    done_s: float | None = None
    error: BaseException | None = None
    _event: threading.Event = field(default_factory=threading.Event)

    def _wait(self) -> None:
        try:
            self.work.wait(timeout=datetime.timedelta(seconds=self.timeout_s))
        except BaseException as e:  # re-raised, with the action named, by Comm.wait
            self.error = e
        self.done_s = time.perf_counter()
        self._event.set()

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()


class Comm:
    """This rank's links to its pipeline neighbours and its all-reduce groups."""

    def __init__(self, rank: int, timeout_s: float):
        self.rank, self.timeout_s = rank, timeout_s
        self.groups: dict[tuple[int, ...], object] = {}

    def make_groups(self, schedule: Schedule) -> None:
        """Create every all-reduce group of the schedule; all ranks call this in the same order."""
        wanted = sorted({tuple(a.group) for acts in schedule.values() for a in acts
                         if a.kind == Kind.ALLREDUCE and a.group})
        for g in wanted:
            pg = dist.new_group(list(g), timeout=datetime.timedelta(seconds=self.timeout_s))
            if self.rank in g:
                self.groups[g] = pg

    # -- p2p
    def _post(self, action: Action, tensor: torch.Tensor, fn) -> Pending:
        try:
            work = fn(tensor, action.peer, tag=tag_of(action))
        except RuntimeError as e:
            raise PeerError(self._message(action, time.perf_counter(), e)) from None
        p = Pending(action, tensor, work, time.perf_counter(), self.timeout_s)
        threading.Thread(target=p._wait, name=f"wait-{action}", daemon=True).start()
        return p

    def irecv(self, action: Action, tensor: torch.Tensor) -> Pending:
        return self._post(action, tensor, dist.irecv)

    def isend(self, action: Action, tensor: torch.Tensor) -> Pending:
        return self._post(action, tensor, dist.isend)

    def wait(self, p: Pending) -> torch.Tensor:
        start = time.perf_counter()
        if not p._event.wait(self.timeout_s + 5.0) and p.error is None:
            p.error = TimeoutError("waiter did not return")
        if p.error is not None:
            raise PeerError(self._message(p.action, start, p.error)) from None
        return p.tensor

    def _message(self, action: Action, start: float, cause: BaseException) -> str:
        text = str(cause)
        if "timed out" in text.lower() or "timeout" in text.lower() or isinstance(cause, TimeoutError):
            why = f"no progress within --timeout-s {self.timeout_s:g} (peer stalled or too slow)"
        elif "closed" in text.lower() or "reset" in text.lower() or "broken pipe" in text.lower():
            why = "the peer closed the connection (it crashed or exited)"
        else:
            why = text.splitlines()[0][:200] if text else type(cause).__name__
        return f"rank {self.rank}: {describe(action)} failed after {time.perf_counter() - start:.1f} s: {why}"

    # -- collectives
    def all_reduce(self, action: Action, tensors: list[torch.Tensor], bucket_bytes: int = 32 << 20) -> None:
        """Sum ``tensors`` in place over ``action.group`` (flattened into buckets)."""
        group = self.groups[tuple(action.group)]
        buckets: list[list[torch.Tensor]] = [[]]
        size = 0
        for t in tensors:
            if buckets[-1] and size + t.numel() * t.element_size() > bucket_bytes:
                buckets.append([])
                size = 0
            buckets[-1].append(t)
            size += t.numel() * t.element_size()
        start = time.perf_counter()
        try:
            flats = [torch._utils._flatten_dense_tensors(b) for b in buckets if b]
            works = [dist.all_reduce(f, group=group, async_op=True) for f in flats]
            for w in works:
                w.wait(timeout=datetime.timedelta(seconds=self.timeout_s))
        except RuntimeError as e:
            raise PeerError(self._message(action, start, e)) from None
        for b, f in zip([b for b in buckets if b], flats):
            for t, r in zip(b, torch._utils._unflatten_dense_tensors(f, b)):
                t.copy_(r)
