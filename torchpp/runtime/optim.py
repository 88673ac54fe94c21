"""The optimizer step of a pipeline rank: global-norm gradient clipping and the LR schedule.

Clipping must see the gradient of the *whole* model, which no rank holds: each rank adds the
squared norms of the gradients it is the one owner of, and one all-reduce over the world gives
the squared global norm. After the group and tied all-reduces every member of a data-parallel
group holds the same gradient, and the first and last stage both hold the tied weight's summed
gradient, so only the group's first device counts its stage, and the tied copy on a last stage
that does not also hold the embedding is skipped: each parameter is counted once and the norm
equals single-process ``torch.nn.utils.clip_grad_norm_``.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

SCHEDULES = ("constant", "linear", "cosine")


@dataclass(kw_only=True, slots=True)
class OptimSettings:
    """What the optimizer step does besides the update itself."""

    max_grad_norm: float = 0.0
    """Clip the global gradient norm to this value (0: no clipping; the norm is still logged)."""
    schedule: str = "constant"
    """Learning-rate shape after warm-up: constant, linear (to 0) or cosine (to 0), as HF's schedulers."""
    warmup_steps: int = 0
    total_steps: int = 1

    def __post_init__(self) -> None:
        if self.max_grad_norm < 0:
            raise ValueError(f"--max-grad-norm: expected >= 0 (0: no clipping), got {self.max_grad_norm}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"--lr-schedule: expected one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        if self.warmup_steps < 0:
            raise ValueError(f"--warmup-steps: expected >= 0, got {self.warmup_steps}")


def lr_lambda(settings: OptimSettings) -> Callable[[int], float]:
    """The factor on the base learning rate after ``k`` optimizer steps (HF's
    ``get_{constant,linear,cosine}_schedule_with_warmup``, so runs compare with HF training)."""
    warm, total, shape = settings.warmup_steps, settings.total_steps, settings.schedule

    def factor(k: int) -> float:
        if k < warm:
            return k / max(1, warm)
        if shape == "constant":
            return 1.0
        progress = (k - warm) / max(1, total - warm)
        if shape == "linear":
            return max(0.0, 1.0 - progress)
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))

    return factor


def make_scheduler(optimizer: torch.optim.Optimizer, settings: OptimSettings,
                   done_steps: int = 0) -> torch.optim.lr_scheduler.LambdaLR:
    """A ``LambdaLR`` placed at ``done_steps`` (a resumed run continues the same curve)."""
    for g in optimizer.param_groups:
        g.setdefault("initial_lr", g["lr"])
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(settings), last_epoch=done_steps - 1)


class Square:
    """A gradient's squared norm (0-d float64) counted in place of a gradient this rank does not hold:
    the tied weight's summed gradient lives on the last stage under a ``rows`` sync, and the first
    stage counts its square where a dense all-reduce would have left the gradient itself."""

    __slots__ = ("value",)

    def __init__(self, value: torch.Tensor):
        self.value = value


def owned_gradients(params: list[torch.nn.Parameter], *, counts_stage: bool, skip: torch.nn.Parameter | None,
                    squares: dict[int, Square] | None = None) -> list[torch.Tensor | Square]:
    """The gradients this rank counts in the global norm (see the module docstring), in parameter
    order, a :class:`Square` in the place of a parameter ``squares`` names."""
    if not counts_stage:
        return []
    squares = squares or {}
    return [squares[id(p)] if id(p) in squares else p.grad for p in params
            if (p.grad is not None or id(p) in squares) and p is not skip]


class GradNorm:
    """The global gradient norm, its all-reduce started and not waited for: without clipping no
    rank needs it before its update, and waiting would make every rank's update wait for the
    slowest rank's last backward (an end-of-step barrier the cost model does not have, and
    which replan would read as a slow optimizer)."""

    def __init__(self, grads: list[torch.Tensor | Square], group: object = None):
        self.sq = torch.zeros((), dtype=torch.float64)
        for g in grads:
            self.sq += g.value if isinstance(g, Square) else squared_norm(g)
        self.work = (dist.all_reduce(self.sq, group=group, async_op=True)
                     if dist.is_initialized() and dist.get_world_size(group) > 1 else None)
        self._value: float | None = None

    def value(self) -> float:
        """sqrt of the squared norms summed over ``grads`` and over every rank of ``group`` (waits)."""
        if self._value is None:
            if self.work is not None:
                self.work.wait()
            self._value = float(self.sq.sqrt())
        return self._value


def squared_norm(grad: torch.Tensor) -> torch.Tensor:
    """One gradient's term of the global norm (0-d float64), the same expression wherever it is taken."""
    return torch.linalg.vector_norm(grad.detach(), dtype=torch.float32).double() ** 2


def global_grad_norm(grads: list[torch.Tensor], group: object = None) -> float:
    """sqrt of the squared norms summed over ``grads`` and over every rank of ``group``."""
    return GradNorm(grads, group).value()


def clip_(params: list[torch.nn.Parameter], total_norm: float, max_norm: float) -> None:
    """Scale every gradient as ``clip_grad_norm_`` does (same coefficient, same epsilon)."""
    coef = max_norm / (total_norm + 1e-6)
    if coef < 1.0:
        for p in params:
            if p.grad is not None:
                p.grad.mul_(coef)


class SteppedOptimizer:
    """What the executor calls at its OPTIMIZER action: global norm, clipping, the update,
    then the scheduler (so step k runs at the schedule's k-th rate, as in HF training).

    ``last_grad_norm``, ``last_lr`` and ``last_lrs`` (per group) are what the step used. With ``keep_grads`` the
    gradients the update used stay referenced (``take_grads``) after the optimizer drops them,
    for a gradient-log checkpoint."""

    def __init__(self, optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter], settings: OptimSettings,
                 *, counts_stage: bool, skip: torch.nn.Parameter | None, done_steps: int = 0,
                 keep_grads: bool = False):
        self.optimizer, self.params, self.settings = optimizer, params, settings
        self.counts_stage, self.skip = counts_stage, skip
        self.scheduler = make_scheduler(optimizer, settings, done_steps)
        self._norm: GradNorm | None = None
        self.sync_s = 0.0
        """Seconds the last step waited for the other ranks (the norm's all-reduce, when clipping)."""
        self.last_lrs = tuple(float(g["lr"]) for g in optimizer.param_groups)
        self.squares: Callable[[], dict[int, Square]] | None = None
        """The squared norms this rank counts for gradients it does not hold (``Square``), asked each step."""
        self.keep_grads = keep_grads
        self._kept: dict[int, torch.Tensor] | None = None

    @property
    def last_lr(self) -> float:
        """The first parameter group's learning rate in the last step (what the logs show)."""
        return self.last_lrs[0]

    @property
    def last_grad_norm(self) -> float:
        """The last step's global gradient norm (waits for its all-reduce; nan before a step)."""
        return self._norm.value() if self._norm is not None else float("nan")

    def step(self) -> None:
        grads = owned_gradients(self.params, counts_stage=self.counts_stage, skip=self.skip,
                                squares=self.squares() if self.squares is not None else None)
        t0 = time.perf_counter()
        self._norm = GradNorm(grads)
        self.sync_s = 0.0
        if self.settings.max_grad_norm > 0:  # clipping needs every rank's gradients: a barrier
            clip_(self.params, self._norm.value(), self.settings.max_grad_norm)
            self.sync_s = time.perf_counter() - t0
        self.last_lrs = tuple(float(g["lr"]) for g in self.optimizer.param_groups)
        if self.keep_grads:
            self._kept = {id(p): p.grad for p in self.params if p.grad is not None}
        self.optimizer.step()
        self.scheduler.step()

    def take_grads(self) -> dict[int, torch.Tensor]:
        """The last update's gradients by parameter id (its learning rates: ``last_lrs``); the
        optimizer no longer holds them, so after this only the caller does."""
        if self._kept is None:
            raise RuntimeError("no gradients kept: the optimizer was built without keep_grads or has not stepped")
        kept, self._kept = self._kept, None
        return kept

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)
