"""Runs one rank's action list (``schedules.build``) for one optimizer step.

The list is the schedule; this loop adds nothing to the order. Each receive is posted
``RECV_LOOKAHEAD`` forward/backward passes before the pass that needs it (or at the start of
the step), sends are non-blocking and awaited before the optimizer step, so communication
overlaps compute as far as the order allows while only a few receive buffers are alive at a
time (posting all of a step's receives at once would hold 2m activation-sized buffers).

Loss scaling: the last stage divides each token-loss sum by the number of predicted tokens
in the *global* batch, so the gradients of all micro-batches and all ranks simply add up to
the single-process gradient. A group all-reduce is therefore a sum, and it is exactly the
sample-weighted mean of the members' per-sample gradients (each member's weight is its
share of the samples). The tied all-reduce between the first and the last stage adds the
embedding's gradient to the lm_head's: one member of each stage's group contributes its
(already group-summed) gradient, the others contribute zeros.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

import torch

from ..formats import Plan
from ..models.stages import Stage
from ..schedules import Action, Kind, sample_ranges
from .comm import Comm, Pending, PeerError, describe

RECV_LOOKAHEAD = 2
"""A receive is posted this many forward/backward passes before the pass that consumes it."""


def receive_posting(actions: list[Action], lookahead: int = RECV_LOOKAHEAD) -> dict[int, list[Action]]:
    """index in ``actions`` -> the receives to post just before executing that action.

    A receive is consumed by the first forward/backward after it in the list; it is posted
    before the pass ``lookahead`` passes earlier (at index 0 when there is none)."""
    passes = [i for i, a in enumerate(actions) if a.kind in (Kind.FORWARD, Kind.BACKWARD)]
    out: dict[int, list[Action]] = {}
    seen = 0
    for i, a in enumerate(actions):
        if a.kind in (Kind.FORWARD, Kind.BACKWARD):
            seen += 1
        elif a.is_recv:
            at = passes[seen - lookahead] if seen >= lookahead else 0
            out.setdefault(at, []).append(a)
    return out


class StepObserver(Protocol):
    """Receives the measured intervals of a step (the timeline recorder implements it)."""

    def compute(self, action: Action, start_s: float, end_s: float, args: dict) -> None: ...

    def p2p(self, pending: Pending, waited_from_s: float | None) -> None: ...

    def collective(self, action: Action, start_s: float, end_s: float, nbytes: int) -> None: ...

    def forward_microbatch(self, microbatch: int) -> None: ...

    def backward_begin(self, microbatch: int, t: float) -> None: ...

    def backward_end(self, microbatch: int, t: float) -> None: ...


@dataclass
class StepResult:
    loss: float
    """This rank's share of the global mean loss (the last stage's ranks; 0 elsewhere)."""
    compute_s: float
    comm_wait_s: float
    """Time the compute loop was blocked on receives, sends and all-reduces."""
    sent_bytes: int = 0
    timings: dict[str, float] = field(default_factory=dict)


@dataclass
class _StepState:
    """What one step holds between its actions: posted receives, unfinished sends, received
    sample ranges, each micro-batch's input and output, and the step's totals."""

    ids: torch.Tensor | None
    n_tokens: int | None
    grad_sends: dict[int, int]
    """Per micro-batch, gradient sends still to post (its input is dropped after the last)."""
    recv_shape: tuple[int, int]
    """(tokens, hidden) of a received activation or gradient, per sample."""
    dtype: torch.dtype
    pending: dict[Action, Pending] = field(default_factory=dict)
    sends: list[Pending] = field(default_factory=list)
    parts: dict[tuple[Kind, int], list[tuple[int, torch.Tensor]]] = field(default_factory=dict)
    inputs: dict[int, torch.Tensor] = field(default_factory=dict)
    outputs: dict[int, torch.Tensor] = field(default_factory=dict)
    loss: torch.Tensor = field(default_factory=lambda: torch.zeros((), dtype=torch.float64))
    compute_s: float = 0.0
    wait_s: float = 0.0
    sent: int = 0


class Executor:
    """One rank: its stage, its action list, its links and its optimizer."""

    def __init__(self, *, rank: int, plan: Plan, actions: list[Action], stage: Stage, comm: Comm,
                 optimizer: torch.optim.Optimizer):
        self.rank, self.plan, self.actions, self.stage, self.comm, self.optimizer = (
            rank, plan, actions, stage, comm, optimizer)
        self.pstage = plan.stage_of_rank(rank)
        self.range = sample_ranges(self.pstage)[rank]
        self.params = [p for p in stage.parameters() if p.requires_grad]
        tied = stage.tied_parameter()
        self.tied = tied
        self.tied_contributor = self.pstage.devices[0].rank == rank
        self.observer: StepObserver | None = None
        self.posting = receive_posting(actions)
        self.step_index = 0
        """Steps done so far (set to the resumed step); with the micro-batch it seeds dropout."""

    def _rows(self, mb: int, lo: int, hi: int) -> slice:
        base = mb * self.plan.micro_batch_size
        return slice(base + lo, base + hi)

    def step(self, ids: torch.Tensor | None, n_tokens: int | None) -> StepResult:
        """One optimizer step over the global batch ``ids`` (None on ranks that need no tokens)."""
        self.comm.stamp = self.observer is not None
        s = _StepState(ids=ids, n_tokens=n_tokens, grad_sends=self._grad_sends(),
                       recv_shape=(self.plan.seq_len, self.stage.hidden_size), dtype=self.stage.dtype)
        run = {Kind.FORWARD: self._forward, Kind.SEND_ACT: self._send_act, Kind.BACKWARD: self._backward,
               Kind.SEND_GRAD: self._send_grad, Kind.ALLREDUCE: self._allreduce_action,
               Kind.OPTIMIZER: self._optimizer_action}
        for i, act in enumerate(self.actions):
            self._post_receives(i, s)
            if act.is_recv:
                self._receive(act, s)
            elif act.kind in run:
                run[act.kind](act, s)
            else:  # pragma: no cover - build() only makes the kinds above
                raise RuntimeError(f"rank {self.rank}: cannot execute {describe(act)}")
            if act.kind in (Kind.FORWARD, Kind.BACKWARD) and s.sends:
                s.sent += self._release_finished(s.sends)
        if s.pending or s.parts or s.outputs:
            raise RuntimeError(f"rank {self.rank}: step ended with unconsumed messages or activations "
                               f"({len(s.pending)} receives, {len(s.parts)} parts, {len(s.outputs)} outputs)")
        self.step_index += 1
        return StepResult(loss=float(s.loss), compute_s=s.compute_s, comm_wait_s=s.wait_s, sent_bytes=s.sent)

    def _grad_sends(self) -> dict[int, int]:
        """Per micro-batch, the gradient sends of this step (its input is kept until the last one)."""
        out: dict[int, int] = {}
        for act in self.actions:
            if act.kind == Kind.SEND_GRAD:
                out[act.microbatch] = out.get(act.microbatch, 0) + 1
        return out

    def _post_receives(self, i: int, s: "_StepState") -> None:
        for r in self.posting.get(i, ()):
            lo, hi = r.samples
            s.pending[r] = self.comm.irecv(r, torch.empty((hi - lo, *s.recv_shape), dtype=s.dtype))

    def _receive(self, act: Action, s: "_StepState") -> None:
        t0 = time.perf_counter()
        p = s.pending.pop(act)
        tensor = self.comm.wait(p)
        s.wait_s += time.perf_counter() - t0
        if self.observer:
            self.observer.p2p(p, t0)
        s.parts.setdefault((act.kind, act.microbatch), []).append((act.samples[0], tensor))

    def _forward(self, act: Action, s: "_StepState") -> None:
        st, obs, mb = self.pstage, self.observer, act.microbatch
        a, b = self.range
        if obs:
            obs.forward_microbatch(mb)
        t0 = time.perf_counter()
        if st.has_embed:
            x = s.ids[self._rows(mb, a, b)]
        else:
            x = _joined(s.parts.pop((Kind.RECV_ACT, mb)), a, b).requires_grad_(True)
        labels = s.ids[self._rows(mb, a, b)] if st.has_tail else None
        self.stage.rng_key = (self.step_index, mb)
        out = self.stage.forward(x, labels, s.n_tokens)
        s.inputs[mb], s.outputs[mb] = x, out
        if st.has_tail:
            s.loss += out.detach().double()
        t1 = time.perf_counter()
        s.compute_s += t1 - t0
        if obs:
            obs.compute(act, t0, t1, {"samples": list(act.samples or (a, b))})

    def _send_act(self, act: Action, s: "_StepState") -> None:
        lo, hi = act.samples
        a = self.range[0]
        s.sends.append(self.comm.isend(act, s.outputs[act.microbatch][lo - a:hi - a].detach().contiguous()))

    def _backward(self, act: Action, s: "_StepState") -> None:
        obs, mb = self.observer, act.microbatch
        a, b = self.range
        t0 = time.perf_counter()
        if obs:
            obs.backward_begin(mb, t0)
        out = s.outputs.pop(mb)
        if self.pstage.has_tail:
            out.backward()
        else:
            grad = _joined(s.parts.pop((Kind.RECV_GRAD, mb)), a, b)
            torch.autograd.backward(out, grad)
        del out
        t1 = time.perf_counter()
        if obs:
            obs.backward_end(mb, t1)
        s.compute_s += t1 - t0
        if obs:
            obs.compute(act, t0, t1, {"samples": list(act.samples or (a, b))})
        if not s.grad_sends.get(mb):
            s.inputs.pop(mb)

    def _send_grad(self, act: Action, s: "_StepState") -> None:
        lo, hi = act.samples
        a, mb = self.range[0], act.microbatch
        s.sends.append(self.comm.isend(act, s.inputs[mb].grad[lo - a:hi - a].contiguous()))
        s.grad_sends[mb] -= 1
        if s.grad_sends[mb] == 0:  # the pending sends keep the gradient alive, not the input
            s.inputs.pop(mb)

    def _allreduce_action(self, act: Action, s: "_StepState") -> None:
        t0 = time.perf_counter()
        nbytes = self._all_reduce(act)
        t1 = time.perf_counter()
        s.wait_s += t1 - t0
        if self.observer:
            self.observer.collective(act, t0, t1, nbytes)

    def _optimizer_action(self, act: Action, s: "_StepState") -> None:
        """Wait for this step's sends, then step the optimizer."""
        obs = self.observer
        t0 = time.perf_counter()
        for p in s.sends:
            self.comm.wait(p)
            if obs:
                obs.p2p(p, None)
        t1 = time.perf_counter()
        s.wait_s += t1 - t0
        s.sent += sum(p.nbytes for p in s.sends)
        s.sends.clear()
        s.inputs.clear()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        t2 = time.perf_counter()
        s.compute_s += t2 - t1
        if obs:
            obs.compute(act, t1, t2, {})

    def _release_finished(self, sends: list[Pending]) -> int:
        """Drop sends that completed (their buffers can be freed); errors surface at the next wait."""
        done = [p for p in sends if p.done_s is not None and p.error is None]
        for p in done:
            sends.remove(p)
            if self.observer:
                self.observer.p2p(p, None)
        return sum(p.nbytes for p in done)

    def _all_reduce(self, act: Action) -> int:
        if act.tied:
            if self.tied is None:
                raise PeerError(f"rank {self.rank}: {describe(act)}: this stage holds no tied weight")
            g = self.tied.grad if self.tied.grad is not None else torch.zeros_like(self.tied)
            buf = g if self.tied_contributor else torch.zeros_like(g)
            self.comm.all_reduce(act, [buf])
            self.tied.grad = buf
            return buf.numel() * buf.element_size()
        grads = []
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
        self.comm.all_reduce(act, grads)
        return sum(g.numel() * g.element_size() for g in grads)


def _joined(parts: list[tuple[int, torch.Tensor]], a: int, b: int) -> torch.Tensor:
    """Concatenate received sample ranges (in sample order) into this rank's [a, b)."""
    parts = sorted(parts, key=lambda p: p[0])
    got = parts[0][0], parts[0][0] + sum(t.shape[0] for _, t in parts)
    if got != (a, b):
        raise RuntimeError(f"received samples {list(got)} do not cover this rank's range [{a}, {b})")
    return parts[0][1] if len(parts) == 1 else torch.cat([t for _, t in parts])
