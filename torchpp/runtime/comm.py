"""Point-to-point and group communication over gloo, with bounded waits and named failures.

Receives are posted ahead (``irecv`` into a preallocated buffer) and sends are non-blocking,
so transfers overlap compute (gloo's own I/O thread moves the bytes). The compute loop waits
on a receive only when it needs the data. A send whose delivery a later message proves
(``runtime.delivery``) is waited on inline by the compute loop at that point, which costs
nothing then; any other send is waited on by a long-lived daemon thread (:class:`Waiters`),
so a sent buffer is freed as soon as it has gone without the compute loop doing anything
(gloo's p2p works make no progress on their own and offer no futures). While a step is traced
(``stamp``) every send and receive is handed to those threads, so each operation's completion
is stamped the moment it happened and the trace shows when data really arrived. The threads are
reused: a step creates none once the first has run. Messages are posted on the default process
group directly, with their tags computed once per action.

Every wait is bounded by ``timeout_s``: a dead peer (connection closed) or a stalled one
(timeout) becomes a :class:`PeerError` that names the action and the peer, never a hang.
"""
from __future__ import annotations

import _thread
import datetime
import functools
import os
import queue
import threading
import time

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


def tag_of(action: Action, boundaries: int = 1, samples: int = 1 << 16) -> int:
    """One tag per (micro-batch, direction, chunk boundary, first sample): a receive can only match
    its own send, also when two ranks exchange several chunks' messages (interleaved, V).

    ``boundaries``: chunk boundaries of the plan (stages - 1); ``samples``: the micro-batch size.
    The boundary of a message is the chunk it leaves downwards: the sender's chunk for
    activations, the receiver's for gradients."""
    grad = action.kind in (Kind.SEND_GRAD, Kind.RECV_GRAD)
    down = action.kind in (Kind.SEND_ACT, Kind.RECV_GRAD)
    boundary = action.stage if down else action.stage - 1
    lo = action.samples[0] if action.samples else 0
    tag = (((action.microbatch or 0) * 2 + int(grad)) * max(1, boundaries) + boundary) * samples + lo
    if not 0 <= tag < 1 << 31:
        raise PeerError(f"{action}: message tag {tag} does not fit gloo's 31 bits (too many micro-batches "
                        f"x chunks x samples)")
    return tag


class Pending:
    """One posted send or receive; ``done_s`` is stamped by the thread that waited on it."""

    __slots__ = ("action", "tensor", "work", "posted_s", "timeout_s", "threaded", "done_s", "error", "_done",
                 "restore", "codec_s")

    def __init__(self, action: Action, tensor: torch.Tensor, work: object, posted_s: float, timeout_s: float,
                 threaded: bool = True):
        self.action, self.tensor, self.work, self.posted_s, self.timeout_s = action, tensor, work, posted_s, timeout_s
        self.threaded = threaded
        """A waiter thread stamps ``done_s``; otherwise :meth:`Comm.wait` waits inline."""
        self.done_s: float | None = None
        self.error: BaseException | None = None
        self._done = None
        """Held until a waiter thread is done with the operation (a bare lock: an ``Event`` is a
        condition, a lock and a list, built for every message)."""
        if threaded:
            self._done = _thread.allocate_lock()
            self._done.acquire()
        self.restore: object = None
        """A receive in a wire format: turns the message back into the tensor (``runtime.wire_links``)."""
        self.codec_s = 0.0
        """Seconds spent encoding (a send) or decoding (a receive) the message."""

    def _wait(self) -> None:
        try:
            self.work.wait(timeout=_timedelta(self.timeout_s))
        except BaseException as e:  # re-raised, with the action named, by Comm.wait
            self.error = e
        self.done_s = time.perf_counter()
        if self._done is not None:
            self._done.release()

    def _join(self) -> bool:
        """Wait for the waiter thread (bounded); False if it did not return in time."""
        if self.done_s is not None:
            return True
        if not self._done.acquire(timeout=self.timeout_s + 5.0):
            return False
        self._done.release()  # a second wait passes at once
        return True

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()


@functools.lru_cache(maxsize=8)
def _timedelta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


class Waiters:
    """Long-lived threads that wait on posted operations, one operation each at a time, and
    stamp when it completed. A thread is started only when every existing one is busy, so a
    step starts threads only until it reaches its most operations in flight (the first step);
    after that, handing an operation over is one queue put, and no thread is created or ended."""

    def __init__(self, name: str):
        self.name = name
        self._queue: queue.SimpleQueue[Pending] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0
        """Threads free to take an operation no earlier put has claimed."""
        self.threads = 0

    def put(self, p: Pending) -> None:
        with self._lock:
            start = self._idle == 0
            if not start:
                self._idle -= 1
        if start:
            self.threads += 1
            threading.Thread(target=self._run, name=f"{self.name}-{self.threads}", daemon=True).start()
        self._queue.put(p)

    def _run(self) -> None:
        while True:
            self._queue.get()._wait()
            with self._lock:
                self._idle += 1


def calm_gloo_loops() -> int:
    """Run this process's gloo I/O threads (``gloo_tcp_loop``) under ``SCHED_BATCH``; returns how many
    threads were changed.

    Such a thread handles a message only when it takes its pair's lock without waiting; while a
    compute thread holds that lock (posting a send or a receive) it returns to ``epoll_wait``, which
    reports the same readable socket again at once. Woken by a message that arrives in that moment (a
    peer's reply to the post, microseconds later on a fast link), it preempted the compute thread on
    its core and spun through its whole time slice: measured ~4,000 wake-ups in 4-5 ms, about 7 ms of
    CPU a step of 16 calls. A batch thread keeps its fair share of the CPU but never preempts on
    waking, so the lock holder finishes first; it runs at once on an idle core, else at the next
    tick. Linux only (elsewhere, or where refused, nothing changes); it needs no privilege."""
    changed = 0
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return 0
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() != "gloo_tcp_loop":
                    continue
            if os.sched_getscheduler(int(tid)) == os.SCHED_OTHER:
                os.sched_setscheduler(int(tid), os.SCHED_BATCH, os.sched_param(0))
                changed += 1
        except (OSError, ValueError, AttributeError):
            continue
    return changed


def guarded(rank: int, what: str, timeout_s: float, fn, /, *args, **kwargs):
    """Run a collective; a failure becomes a :class:`PeerError` naming ``what``."""
    start = time.perf_counter()
    try:
        return fn(*args, **kwargs)
    except RuntimeError as e:
        raise PeerError(f"rank {rank}: {what} failed after {time.perf_counter() - start:.1f} s: "
                        f"{_why(e, timeout_s)}") from None


def _why(cause: BaseException, timeout_s: float) -> str:
    text = str(cause)
    low = text.lower()
    if "timed out" in low or "timeout" in low or isinstance(cause, TimeoutError):
        return f"no progress within --timeout-s {timeout_s:g} (peer stalled or too slow)"
    if "closed" in low or "reset" in low or "broken pipe" in low:
        return "a peer closed the connection (it crashed or exited)"
    return text.splitlines()[0][:200] if text else type(cause).__name__


class Comm:
    """This rank's links to its pipeline neighbours and its all-reduce groups."""

    def __init__(self, rank: int, timeout_s: float, boundaries: int = 1, samples: int = 1 << 16):
        self.rank, self.timeout_s = rank, timeout_s
        self.tag_space = (boundaries, samples)
        """(chunk boundaries, micro-batch size) of the plan: what :func:`tag_of` spreads tags over."""
        self.groups: dict[tuple[int, ...], object] = {}
        self.stamp = False
        """Stamp each operation's completion from a waiter thread (for traces)."""
        self._waiters = Waiters(f"wait-rank{rank}")
        self._pg = None
        """The default process group, called directly: ``dist.isend``'s checks, run for every message, cost more than the call."""
        self._tags: dict[Action, int] = {}
        self.wire = None
        """Per-link wire formats and per-group sync of the plan (``runtime.wire_links.install``); None: fp32."""

    def make_groups(self, schedule: Schedule) -> None:
        """Create every all-reduce group of the schedule; all ranks call this in the same order."""
        wanted = sorted({tuple(a.group) for acts in schedule.values() for a in acts
                         if a.kind == Kind.ALLREDUCE and a.group})
        for g in wanted:
            pg = dist.new_group(list(g), timeout=datetime.timedelta(seconds=self.timeout_s))
            if self.rank in g:
                self.groups[g] = pg
        calm_gloo_loops()  # every group's device has started its I/O thread by now

    # -- p2p
    def tag(self, action: Action) -> int:
        """The message tag of ``action`` (computed once per action)."""
        tag = self._tags.get(action)
        if tag is None:
            tag = self._tags[action] = tag_of(action, *self.tag_space)
        return tag

    def _post(self, action: Action, tensor: torch.Tensor, send: bool, tag: int | None, threaded: bool) -> Pending:
        pg = self._pg
        if pg is None:
            pg = self._pg = dist.distributed_c10d._get_default_group()
        if tag is None:
            tag = self.tag(action)
        threaded = threaded or self.stamp
        posted = time.perf_counter()  # before the call: gloo may start moving bytes inside isend
        try:
            work = pg.send([tensor], action.peer, tag) if send else pg.recv([tensor], action.peer, tag)
        except RuntimeError as e:
            raise PeerError(self._message(action, time.perf_counter(), e)) from None
        p = Pending(action, tensor, work, posted, self.timeout_s, threaded=threaded)
        if threaded:
            self._waiters.put(p)
        return p

    def irecv(self, action: Action, tensor: torch.Tensor, tag: int | None = None) -> Pending:
        """Post a receive into ``tensor``; waited on inline by :meth:`wait` (by a waiter thread
        while ``stamp`` is set)."""
        if self.wire is None:
            return self._post(action, tensor, False, tag, False)
        buf, restore = self.wire.receiving(action, tensor)
        p = self._post(action, buf, False, tag, False)
        p.restore = restore
        return p

    def isend(self, action: Action, tensor: torch.Tensor, tag: int | None = None, threaded: bool = True) -> Pending:
        """Post a send of ``tensor``; ``threaded=False``: the caller waits on it (:meth:`wait`) once
        it is known delivered (``runtime.delivery``), no waiter thread does (unless ``stamp`` is set)."""
        if self.wire is None:
            return self._post(action, tensor, True, tag, threaded)
        t0 = time.perf_counter()
        msg = self.wire.encode(action, tensor)
        codec_s = time.perf_counter() - t0
        p = self._post(action, msg, True, tag, threaded)
        p.codec_s = codec_s
        return p

    def wait(self, p: Pending) -> torch.Tensor:
        start = time.perf_counter()
        if not p.threaded:
            if p.done_s is None:
                p._wait()
        elif not p._join() and p.error is None:
            p.error = TimeoutError("waiter did not return")
        if p.error is not None:
            raise PeerError(self._message(p.action, start, p.error)) from None
        if p.restore is not None:
            t0 = time.perf_counter()
            out = p.restore(p.tensor)
            p.codec_s = time.perf_counter() - t0
            return out
        return p.tensor

    def _message(self, action: Action, start: float, cause: BaseException) -> str:
        return (f"rank {self.rank}: {describe(action)} failed after {time.perf_counter() - start:.1f} s: "
                f"{_why(cause, self.timeout_s)}")

    # -- collectives
    def all_reduce(self, action: Action, tensors: list[torch.Tensor], bucket_bytes: int = 32 << 20) -> int | None:
        """Sum ``tensors`` in place over ``action.group`` (flattened into buckets), or sync them as
        the plan's ``sync`` for this group says (``runtime.wire_links``; then the bytes this rank
        sent are returned, else None)."""
        group = self.groups[tuple(action.group)]
        if self.wire is not None and self.wire.syncs(action):
            try:
                return self.wire.all_reduce(action, tensors, group, self.timeout_s)
            except RuntimeError as e:
                raise PeerError(self._message(action, time.perf_counter(), e)) from None
        buckets: list[list[torch.Tensor]] = [[]]
        size = 0
        for t in tensors:
            if buckets[-1] and size + t.numel() * t.element_size() > bucket_bytes:
                buckets.append([])
                size = 0
            buckets[-1].append(t)
            size += t.numel() * t.element_size()
        buckets = [b for b in buckets if b]
        # a bucket of one contiguous tensor (the tied weight's gradient) is reduced in place: no copy
        inplace = [len(b) == 1 and b[0].is_contiguous() for b in buckets]
        start = time.perf_counter()
        try:
            flats = [b[0] if one else torch._utils._flatten_dense_tensors(b) for b, one in zip(buckets, inplace)]
            works = [dist.all_reduce(f, group=group, async_op=True) for f in flats]
            for w in works:
                w.wait(timeout=datetime.timedelta(seconds=self.timeout_s))
        except RuntimeError as e:
            raise PeerError(self._message(action, start, e)) from None
        for b, f, one in zip(buckets, flats, inplace):
            if not one:
                for t, r in zip(b, torch._utils._unflatten_dense_tensors(f, b)):
                    t.copy_(r)
