"""Evaluation loss on held-out batches, through the same pipeline and sample split as training.

The forward-only action list is the rank's training list with everything but FORWARD,
SEND_ACT and RECV_ACT removed: a sub-sequence of a valid schedule in which every stage runs
its micro-batches in order, so it cannot deadlock, and the micro-batches, sample ranges and
message tags are the training step's own. Dropout is off (the stage is in eval mode) and no
autograd graph is kept.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..formats import Plan
from ..models.stages import Stage, count_targets
from ..schedules import Action, Kind, sample_ranges
from .comm import Comm, Pending

FORWARD_KINDS = (Kind.FORWARD, Kind.SEND_ACT, Kind.RECV_ACT)


def forward_actions(actions: list[Action]) -> list[Action]:
    """The forward-only sub-sequence of a rank's training action list."""
    return [a for a in actions if a.kind in FORWARD_KINDS]


class Evaluator:
    """One rank's forward-only pass over a global batch; every rank calls :meth:`loss` together."""

    def __init__(self, *, rank: int, plan: Plan, actions: list[Action], stage: Stage, comm: Comm):
        self.rank, self.plan, self.stage, self.comm = rank, plan, stage, comm
        self.actions = forward_actions(actions)
        self.pstage = plan.stage_of_rank(rank)
        self.range = sample_ranges(self.pstage)[rank]

    def loss(self, ids: torch.Tensor | None) -> float:
        """The global mean token loss of the batch ``ids`` (None on ranks that need no tokens)."""
        was_training = self.stage.module.training
        self.stage.train(False)
        try:
            with torch.no_grad():
                part = self._run(ids)
        finally:
            self.stage.train(was_training)
        v = torch.tensor([part], dtype=torch.float64)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(v)
        return float(v[0])

    def _run(self, ids: torch.Tensor | None) -> float:
        st, comm = self.pstage, self.comm
        a, b = self.range
        mbs = self.plan.micro_batch_size
        T, H = self.plan.seq_len, self.stage.hidden_size
        n_tokens = count_targets(ids) if ids is not None and st.has_tail else None
        parts: dict[int, list[tuple[int, torch.Tensor]]] = {}
        outputs: dict[int, torch.Tensor] = {}
        sends: list[Pending] = []
        total = 0.0
        for act in self.actions:
            mb = act.microbatch
            if act.kind == Kind.RECV_ACT:
                lo, hi = act.samples
                p = comm.irecv(act, torch.empty((hi - lo, T, H), dtype=self.stage.dtype))
                parts.setdefault(mb, []).append((lo, comm.wait(p)))
            elif act.kind == Kind.SEND_ACT:
                lo, hi = act.samples
                sends.append(comm.isend(act, outputs[mb][lo - a:hi - a].contiguous()))
            else:
                rows = slice(mb * mbs + a, mb * mbs + b)
                x = ids[rows] if st.has_embed else _joined(parts.pop(mb))
                out = self.stage.forward(x, ids[rows] if st.has_tail else None, n_tokens)
                if st.has_tail:
                    total += float(out)
                else:
                    outputs[mb] = out
        for p in sends:
            comm.wait(p)
        return total


def _joined(parts: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
    parts = sorted(parts, key=lambda p: p[0])
    return parts[0][1] if len(parts) == 1 else torch.cat([t for _, t in parts])
