"""Evaluation loss on held-out batches: the executor running the forward-only action list.

``schedules.build_forward`` keeps each rank's forwards in their training order with their
communication (every schedule kind, chunks included), so evaluation runs through the same
interpreter, pipeline and sample split as a training step. Dropout is off (the stages are in
eval mode) and no autograd graph is kept.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..formats import Plan
from ..models.stages import Stage, StageSet, count_targets
from ..schedules import build_forward
from .comm import Comm
from .executor import Executor


class Evaluator:
    """One rank's forward-only pass over a global batch; every rank calls :meth:`loss` together."""

    def __init__(self, *, rank: int, plan: Plan, stage: Stage | StageSet, comm: Comm):
        schedule = build_forward(plan)
        self.executor = Executor(rank=rank, plan=plan, actions=schedule[rank], stage=stage, comm=comm,
                                 optimizer=None, schedule=schedule)
        self.stages = self.executor.stages
        self.has_tail = plan.stages_of_rank(rank)[-1].has_tail

    def loss(self, ids: torch.Tensor | None) -> float:
        """The global mean token loss of the batch ``ids`` (None on ranks that need no tokens)."""
        n_tokens = count_targets(ids) if ids is not None and self.has_tail else None
        was_training = {c: st.module.training for c, st in self.stages.chunks.items()}
        for st in self.stages.chunks.values():
            st.train(False)
        try:
            with torch.no_grad():
                part = self.executor.step(ids, n_tokens).loss
        finally:
            for c, st in self.stages.chunks.items():
                st.train(was_training[c])
        v = torch.tensor([part], dtype=torch.float64)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(v)
        return float(v[0])
