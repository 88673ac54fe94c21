"""The tied weight kept in sync by the rows a step touches (plan ``tied_sync: {"kind": "rows"}``).

A dense all-reduce of the tied weight moves the whole embedding each way every step (qwen3-small:
4 MB, 3.5 s of a 4.4 s step at 10 Mbit/s), although the first stage reads and writes only the
rows of the step's tokens. Here the last stage owns the tied weight and its optimizer state:

- at a step's start it sends the first stage the current rows of the step's distinct token ids
  (both ends hold the global batch, so the ids never cross the wire); the first stage writes
  them into its copy, the only rows its forward reads;
- at the tied action the first stage sends the rows of its embedding gradient at those ids (its
  gradient is zero everywhere else) and drops its gradient, so its optimizer leaves the copy
  alone; the last stage scatters them into a zero tensor and adds it to its own gradient — the
  same two fp32 tensors a two-member all-reduce adds, so the sum, the update, every weight the
  forward reads and every loss equal the dense all-reduce's bit for bit (the last stage also sends
  the sum's squared norm, which the first stage counts in the global norm where the dense
  all-reduce left it the gradient itself: the norm is summed in the same order);
- the rest of the first stage's copy is stale; :meth:`TiedRows.whole` sends all of it before
  anything reads it whole (a checkpoint, an evaluation, the export, a resumed run's replay).

Every message is a broadcast over the tied all-reduce's process group, in the same order on every
rank. Where an end stage is a data-parallel group, its group all-reduce has already given every
member the same gradient (zero outside the step's rows, which ``formats.rows_refusal`` requires of
its sync): the last stage's first device sends the rows, the first stage's first device the
gradient rows, every last-stage member adds them and steps its whole copy as its peers do, every
first-stage member takes the rows and drops its gradient, and only the first stage's first device,
the one that counts its stage in the global norm, counts the square.
"""
from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from ..formats import Plan
from ..schedules import tied_group
from .comm import PeerError
from .optim import Square, squared_norm


def uses_rows(plan: Plan) -> bool:
    return plan.tied_sync is not None and plan.tied_sync.kind == "rows" and bool(tied_group(plan))


class TiedRows:
    """One member of the tied pair's group (a rank of the first stage or of the last), its tied weight."""

    def __init__(self, plan: Plan, rank: int, weight: torch.nn.Parameter, group: object, timeout_s: float):
        self.first = plan.stages[0].devices[0].rank
        """Sends the first stage's gradient rows (its group has summed them) and counts the square."""
        self.last = plan.stages[-1].devices[0].rank
        """Sends the step's rows and the summed gradient's square."""
        self.holders = frozenset(plan.stages[-1].ranks)
        """The last stage's ranks: each holds the summed gradient and steps the whole weight."""
        if rank not in self.holders and rank not in plan.stages[0].ranks:
            raise ValueError(f"rank {rank}: holds neither end of the tied pair (stages 0 and {plan.num_stages - 1})")
        self.rank, self.weight, self.group = rank, weight, group
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.ids: torch.Tensor | None = None
        """The step's distinct token ids (sorted), set by :meth:`begin`."""
        self.square: Square | None = None
        """On the first stage's first device: the summed gradient's squared norm, from the last stage."""
        self._push: object = None
        """A last-stage member's pending broadcast of the step's rows (awaited at the exchange)."""

    @property
    def owner(self) -> bool:
        """A last-stage member: it holds the summed gradient and steps the weight."""
        return self.rank in self.holders

    def _wait(self, work: object) -> None:
        try:
            work.wait(timeout=self.timeout)
        except RuntimeError as e:
            raise PeerError(f"rank {self.rank}: the tied weight's rows with ranks {self.first} and {self.last} "
                            f"failed: {e}") from None

    def _broadcast(self, buf: torch.Tensor, src: int) -> object:
        return dist.broadcast(buf, src=src, group=self.group, async_op=True)

    def begin(self, ids: torch.Tensor) -> int:
        """The step's rows from the last stage to the first (the first stage waits: its forward reads
        them; the last stage's members hold them already). Returns the bytes moved."""
        self.ids = torch.unique(ids.reshape(-1))
        with torch.no_grad():
            if self.rank == self.last:
                rows = self.weight.detach().index_select(0, self.ids)
            else:
                rows = torch.empty((self.ids.numel(), self.weight.shape[1]), dtype=self.weight.dtype)
            work = self._broadcast(rows, self.last)
            if self.owner:
                self._push = (work, rows)  # the buffer lives until the broadcast is done
            else:
                self._wait(work)
                self.weight.data.index_copy_(0, self.ids, rows)
        return rows.numel() * rows.element_size()

    def exchange(self) -> int:
        """The first stage's gradient rows to the last stage, whose members add them to their gradient;
        the first stage's gradients are dropped. Returns the bytes moved."""
        assert self.ids is not None, "TiedRows.begin was not called this step"
        w = self.weight
        if self._push is not None:
            self._wait(self._push[0])
            self._push = None
        if self.rank == self.first:
            g = w.grad if w.grad is not None else torch.zeros_like(w)
            rows = g.index_select(0, self.ids)
        else:
            rows = torch.empty((self.ids.numel(), w.shape[1]), dtype=w.dtype)
        self._wait(self._broadcast(rows, self.first))
        if self.owner:
            theirs = torch.zeros_like(w).index_copy_(0, self.ids, rows)
            mine = w.grad if w.grad is not None else torch.zeros_like(w)
            w.grad = mine + theirs  # the dense all-reduce's sum of the same two tensors
            sq = squared_norm(w.grad).reshape(1)
        else:
            w.grad = None  # the last stage steps the weight; this copy takes its rows at the next step's start
            sq = torch.empty(1, dtype=torch.float64)
        # the first stage counts the summed gradient in the global norm, as after a dense all-reduce
        self._wait(self._broadcast(sq, self.last))
        self.square = Square(sq.reshape(())) if self.rank == self.first else None
        self.ids = None
        return 2 * rows.numel() * rows.element_size()

    def squares(self) -> dict[int, Square]:
        """The first stage's term of the global gradient norm for the tied weight (``optim.Square``)."""
        return {id(self.weight): self.square} if self.square is not None else {}

    def whole(self) -> None:
        """The whole weight, last stage to first: before anything reads the first stage's copy whole."""
        with torch.no_grad():
            buf = self.weight.detach().contiguous() if self.rank == self.last else torch.empty_like(self.weight)
            self._wait(self._broadcast(buf, self.last))
            if not self.owner:
                self.weight.data.copy_(buf)
