"""The plan's wire formats and group syncs, as :class:`~torchpp.runtime.comm.Comm` applies them.

:class:`Comm` calls three methods here and nothing else, so its hot path stays its own: a send
is encoded just before it is posted (:meth:`WireLinks.encode`), a receive is posted into a
buffer of the encoded size and decoded just after its wait (:meth:`WireLinks.receiving`), and
a group all-reduce whose plan entry names a ``sync`` goes through :meth:`WireLinks.all_reduce`.

- Links: chunk i's ``wire`` is the format of everything between chunk i and chunk i+1. Gradients
  (in every lossy format) carry their rounding error to the next message of the same stream: a
  bf16 gradient rounded without it drifted training measurably (benchmarks/bench_wire.py), with it
  the sum over micro-batches and steps of what arrives is what was sent.
- ``allreduce`` in bf16: the gradients cast to bf16, summed by gloo, cast back. In int8: the
  flat gradient in rows of :data:`INT8_ROW`, encoded with error feedback (what rounding lost this
  step is added to the next step's gradient), all-gathered (an int8 sum would overflow), decoded
  and summed in fp32 on every member.
- ``powersgd``: torch's ``powerSGD_hook`` with its ``PowerSGDState`` (error feedback, warm
  start), fed a bucket object with the methods the hook calls (``GradBucket`` has no Python
  constructor); the hook averages, the plan's all-reduce sums, so the result is scaled back.
- ``diloco``: no gradient all-reduce at all; each replica's gradient is scaled from its share
  of the global batch to its own batch mean, and :mod:`torchpp.runtime.diloco` syncs the
  parameters every H steps.
"""
from __future__ import annotations

import datetime
from typing import Callable

import torch
import torch.distributed as dist

from .. import wire
from ..formats import Plan, Sync
from ..schedules import Action, Kind

INT8_ROW = 256
"""Elements per scale of an int8 all-reduce (a flat gradient has no rows of its own)."""


def boundary(action: Action) -> int:
    """The chunk a p2p message leaves downwards (as ``comm.tag_of``): its link is that chunk's ``wire``."""
    return action.stage if action.kind in (Kind.SEND_ACT, Kind.RECV_GRAD) else action.stage - 1


class _Bucket:
    """What ``powerSGD_hook`` reads of a ``dist.GradBucket``: one flat buffer and its parameters' views."""

    def __init__(self, index: int, flat: torch.Tensor, tensors: list[torch.Tensor]):
        self._index, self._flat = index, flat
        self._views, o = [], 0
        for t in tensors:
            self._views.append(flat[o:o + t.numel()].view_as(t))
            o += t.numel()

    def buffer(self) -> torch.Tensor:
        return self._flat

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        return True

    def gradients(self) -> list[torch.Tensor]:
        return self._views

    def parameters(self) -> list[torch.Tensor]:
        return self._views


class WireLinks:
    """This rank's codecs per link and its group syncs, from the plan."""

    def __init__(self, plan: Plan, rank: int):
        self.plan, self.rank = plan, rank
        self.formats = {s.index: s.wire for s in plan.stages if s.wire not in (None, "fp32")}
        self.feedback: dict[str, wire.ErrorFeedback] = {}
        self._powersgd: dict[tuple[bool, int], object] = {}

    # -- p2p
    def format(self, action: Action) -> str:
        return self.formats.get(boundary(action), "fp32")

    def encode(self, action: Action, tensor: torch.Tensor) -> torch.Tensor:
        fmt = self.format(action)
        if fmt != "fp32" and action.kind == Kind.SEND_GRAD:
            ef = self.feedback.setdefault(fmt, wire.ErrorFeedback(fmt))
            return ef.encode((action.stage, action.peer, action.samples), tensor)
        return wire.encode(fmt, tensor)

    def receiving(self, action: Action, tensor: torch.Tensor) -> tuple[torch.Tensor, Callable | None]:
        """The buffer to receive into and the function that turns it back into ``tensor``'s form."""
        fmt = self.format(action)
        if fmt == "fp32":
            return tensor, None
        shape, dtype = tuple(tensor.shape), tensor.dtype
        buf = torch.empty(wire.encoded_numel(fmt, shape), dtype=wire.encoded_dtype(fmt, dtype))
        return buf, lambda msg: wire.decode(fmt, msg, shape, dtype)

    # -- group syncs
    def sync_of(self, action: Action) -> Sync | None:
        return self.plan.tied_sync if action.tied else self.plan.stages[action.stage].sync

    def syncs(self, action: Action) -> bool:
        s = self.sync_of(action)
        return s is not None and s.lossy

    def all_reduce(self, action: Action, tensors: list[torch.Tensor], group: object, timeout_s: float) -> int:
        """Sync ``tensors`` in place as the plan says; returns this rank's payload in bytes as encoded
        (what an fp32 all-reduce's trace records as its buffer's bytes; 0 for diloco's skipped one)."""
        s = self.sync_of(action)
        assert s is not None
        if s.kind == "diloco":
            frac = self.plan.stages[action.stage].device(self.rank).samples / self.plan.micro_batch_size
            for t in tensors:
                t.div_(frac)
            return 0
        flat = torch._utils._flatten_dense_tensors(tensors) if len(tensors) > 1 else tensors[0].reshape(-1).clone()
        timeout = datetime.timedelta(seconds=timeout_s)
        if s.kind == "allreduce" and s.wire == "int8":
            flat, sent = self._int8_all_reduce((action.tied, action.stage), flat, group, timeout)
        elif s.kind == "allreduce":  # bf16
            half = flat.to(torch.bfloat16)
            dist.all_reduce(half, group=group, async_op=True).wait(timeout=timeout)
            flat = half.to(flat.dtype)
            sent = half.numel() * 2
        else:  # the two rank-r factors of each matrix, vectors as they are
            flat = self._power_sgd(action, s, flat, tensors, group)
            sent = sum(4 * (t.shape[0] + t[0].numel()) * s.rank if t.dim() > 1 else 4 * t.numel() for t in tensors)
        for t, r in zip(tensors, torch._utils._unflatten_dense_tensors(flat, tensors)):
            t.copy_(r)
        return sent

    def _int8_all_reduce(self, key: tuple[bool, int], flat: torch.Tensor, group: object,
                         timeout: datetime.timedelta) -> tuple[torch.Tensor, int]:
        """The sum over ``group`` of ``flat`` sent as int8 with error feedback, and the message's bytes."""
        n = flat.numel()
        want = torch.cat([flat.float(), flat.new_zeros(-n % INT8_ROW, dtype=torch.float32)]).reshape(-1, INT8_ROW)
        residual = self.feedback.setdefault("int8", wire.ErrorFeedback("int8")).residual
        r = residual.get(("sync", *key))
        if r is not None and r.shape == want.shape:
            want.add_(r)
        msg = wire.encode("int8", want)
        mine = wire.decode("int8", msg, tuple(want.shape), torch.float32)  # decoded once: residual and sum
        residual[("sync", *key)] = want.sub_(mine)
        world, me = dist.get_world_size(group), dist.get_group_rank(group, self.rank)
        parts = [torch.empty_like(msg) for _ in range(world)]
        dist.all_gather(parts, msg, group=group, async_op=True).wait(timeout=timeout)
        total = None
        for i, m in enumerate(parts):  # in group order on every member: the same sum everywhere
            x = mine if i == me else wire.decode("int8", m, tuple(want.shape), torch.float32)
            total = x.clone() if total is None else total.add_(x)
        return total.reshape(-1)[:n].to(flat.dtype), msg.numel()

    def _power_sgd(self, action: Action, s: Sync, flat: torch.Tensor, tensors: list[torch.Tensor],
                   group: object) -> torch.Tensor:
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as P

        key = (action.tied, action.stage)
        if key not in self._powersgd:
            # start_powerSGD_iter=2: torch requires > 1 with error feedback; step 1 is a plain all-reduce
            self._powersgd[key] = P.PowerSGDState(process_group=group, matrix_approximation_rank=s.rank,
                                                  start_powerSGD_iter=2, min_compression_rate=1.0)
        state = self._powersgd[key]
        out = P.powerSGD_hook(state, _Bucket(0, flat, tensors)).wait()
        return out * dist.get_world_size(group)  # the hook averages; the plan's all-reduce sums


def install(plan: Plan, rank: int) -> WireLinks | None:
    """``Comm.wire`` for ``plan``: None when the plan sends fp32 everywhere (today's path, untouched)."""
    if not plan.lossy:
        return None
    return WireLinks(plan, rank)
