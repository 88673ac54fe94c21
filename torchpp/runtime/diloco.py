"""DiLoCo: data-parallel replicas that talk every H steps instead of every step.

Each replica of a group whose plan ``sync`` is ``diloco`` takes its inner optimizer steps
(AdamW, or the run's optimizer) on its own gradient (``wire_links`` skips the group's gradient
all-reduce and scales the gradient to the replica's own batch mean). Every ``H`` steps the
replicas all-reduce their parameter change since the last outer step, weighted by their share
of the samples (``Δ = Σ share_r (anchor − θ_r)``), and take one outer SGD step on the anchor
(Nesterov momentum ``outer_momentum``, learning rate ``outer_lr``); every replica then starts
from the new anchor. With H = 1, an inner SGD and an outer SGD of lr 1 without momentum this is
exactly synchronous SGD.

Checkpoints: between outer steps the replicas hold different weights, and each always holds its
own inner optimizer moments, while a stage checkpoint is written by one member of its group.
So each replica also writes its own state (weights, inner optimizer, anchor, outer momentum) at
every checkpoint, under ``<checkpoint dir>/diloco/``, and a resumed replica loads it over the
stage checkpoint; the position inside the period follows from the step number, so a resumed
run continues exactly where an uninterrupted one would be.

The change may cross the wire as fp32, bf16 (a bf16 all-reduce) or int8 (per-row codes
all-gathered, then decoded and summed in fp32 on every replica: an int8 sum would overflow).
"""
from __future__ import annotations

import datetime
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .. import wire
from ..formats import Plan, Sync

INT8_ROW = 256
"""Elements per int8 scale in the outer all-reduce (a parameter change has no rows of its own)."""


class _Group:
    """One diloco chunk of this rank: its parameters, its group, its sync and this rank's share."""

    def __init__(self, params: list[torch.nn.Parameter], group: object, sync: Sync, share: float):
        self.params, self.group, self.sync, self.share = params, group, sync, share


class DiLoCo:
    """Wraps the rank's stepped optimizer: the executor calls ``step`` and ``zero_grad`` as before."""

    def __init__(self, stepper: Any, optimizer: torch.optim.Optimizer, groups: list[_Group], *, rank: int,
                 done_steps: int, timeout_s: float):
        self.stepper, self.optimizer, self.groups, self.rank = stepper, optimizer, groups, rank
        self.steps, self.timeout = done_steps, datetime.timedelta(seconds=timeout_s)
        self.sent_bytes = 0
        """Bytes this rank put into outer all-reduces so far (the payload, before the ring's factor)."""
        self._anchor = {id(p): p.detach().float().clone() for g in groups for p in g.params}
        """The weights at the last outer step (fp32), per parameter."""
        self._momentum: dict[int, torch.Tensor] = {}
        """The outer Nesterov momentum per parameter (created at the first outer step)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stepper, name)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.stepper.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        self.stepper.step()
        self.steps += 1
        for g in self.groups:
            if self.steps % g.sync.H == 0:
                self._outer(g)

    def _outer(self, g: _Group) -> None:
        delta = torch.cat([(self._anchor[id(p)] - p.detach().float()).reshape(-1) for p in g.params])
        delta = self._reduce(g, delta.mul_(g.share))
        o, mu, lr = 0, g.sync.outer_momentum, g.sync.outer_lr
        with torch.no_grad():
            for p in g.params:
                a = self._anchor[id(p)]
                d = delta[o:o + p.numel()].view_as(a)
                o += p.numel()
                if mu > 0:  # torch.optim.SGD's Nesterov form, dampening 0
                    buf = self._momentum.setdefault(id(p), torch.zeros_like(a))
                    buf.mul_(mu).add_(d)
                    d = d.add(buf, alpha=mu)
                a.add_(d, alpha=-lr)
                p.copy_(a.to(p.dtype))

    # -- checkpoints
    def _file(self, root: str | Path, step: int) -> Path:
        return Path(root) / "diloco" / f"rank{self.rank}_step{step:08d}.pt"

    def save(self, root: str | Path, step: int, keep: int = 0) -> Path:
        """This replica's own state at ``step``: its weights, its inner optimizer state, the anchor and
        the outer momentum (replicas differ between outer steps, and each holds its own inner moments,
        which the stage checkpoint, written by one member of the group, cannot hold). Keeps the newest
        ``keep`` files (0: all)."""
        params = [p for g in self.groups for p in g.params]
        state = {"step": step, "params": [p.detach().clone() for p in params],
                 "anchor": [self._anchor[id(p)].clone() for p in params],
                 "momentum": [self._momentum[id(p)].clone() if id(p) in self._momentum else None for p in params],
                 "inner": self.optimizer.state_dict()}
        path = self._file(root, step)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        torch.save(state, tmp)
        os.replace(tmp, path)
        if keep > 0:
            for old in sorted(path.parent.glob(f"rank{self.rank}_step*.pt"))[:-keep]:
                old.unlink(missing_ok=True)
        return path

    def load(self, root: str | Path, step: int) -> None:
        """Restore what :meth:`save` wrote at ``step`` (after the stage checkpoint was loaded)."""
        path = self._file(root, step)
        if not path.is_file():
            raise FileNotFoundError(f"{path}: the diloco state of rank {self.rank} at step {step} is missing (a "
                                    "diloco run resumes from checkpoints it wrote itself)")
        state = torch.load(path, weights_only=True)
        params = [p for g in self.groups for p in g.params]
        with torch.no_grad():
            for p, v, a, m in zip(params, state["params"], state["anchor"], state["momentum"]):
                p.copy_(v)
                self._anchor[id(p)] = a
                if m is not None:
                    self._momentum[id(p)] = m
        self.optimizer.load_state_dict(state["inner"])

    def _reduce(self, g: _Group, delta: torch.Tensor) -> torch.Tensor:
        fmt = g.sync.wire
        if fmt == "int8":
            n = delta.numel()
            rows = torch.cat([delta, delta.new_zeros(-n % INT8_ROW)]).reshape(-1, INT8_ROW)
            msg = wire.encode("int8", rows)
            self.sent_bytes += msg.numel()
            parts = [torch.empty_like(msg) for _ in range(dist.get_world_size(g.group))]
            dist.all_gather(parts, msg, group=g.group, async_op=True).wait(timeout=self.timeout)
            return sum(wire.decode("int8", m, tuple(rows.shape), torch.float32) for m in parts).reshape(-1)[:n]
        t = delta.to(torch.bfloat16) if fmt == "bf16" else delta
        self.sent_bytes += t.numel() * t.element_size()
        dist.all_reduce(t, group=g.group, async_op=True).wait(timeout=self.timeout)
        return t.float()


def wrap(stepper: Any, optimizer: torch.optim.Optimizer, plan: Plan, rank: int, stage: Any, groups: dict,
         *, done_steps: int, timeout_s: float, checkpoint_dir: str | Path | None = None) -> Any:
    """``stepper`` itself unless one of this rank's chunks syncs by diloco; then a :class:`DiLoCo` over it,
    restored from ``checkpoint_dir`` when the run resumes (``done_steps`` > 0).

    ``stage``: the rank's StageSet; ``groups``: ``Comm.groups`` (the process group of each rank tuple)."""
    mine = []
    for c in plan.stages_of_rank(rank):
        if c.sync is None or c.sync.kind != "diloco":
            continue
        params = [p for _, p in stage.owned(c.index) if p.requires_grad]
        share = c.device(rank).samples / plan.micro_batch_size
        mine.append(_Group(params, groups[tuple(sorted(c.ranks))], c.sync, share))
    if not mine:
        return stepper
    out = DiLoCo(stepper, optimizer, mine, rank=rank, done_steps=done_steps, timeout_s=timeout_s)
    if done_steps > 0 and checkpoint_dir is not None:
        out.load(checkpoint_dir, done_steps)
    return out
