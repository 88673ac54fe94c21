"""Runs one rank's action list (``schedules.build``) for one optimizer step.

The list is the schedule; this loop adds nothing to the order. A rank may hold several chunks
(interleaved, V): each action runs on its chunk's :class:`Stage`, and where two chunks of the
rank hold the same samples (the V's turn, chunk p-1 to p) the activation and the gradient are
handed over in-process. ``I`` computes only the input gradient (what the previous chunk waits
for) and keeps the graph; ``W`` computes the weight gradients from it later and frees it. Each receive is posted
``RECV_LOOKAHEAD`` forward/backward passes before the pass that needs it (or at the start of
the step), sends are non-blocking and awaited before the optimizer step, so communication
overlaps compute as far as the order allows while only a few receive buffers are alive at a
time (posting all of a step's receives at once would hold 2m activation-sized buffers). A send
is awaited by the loop itself right after the action that proves it delivered
(``runtime.delivery``), else by a waiter thread (``runtime.comm``).

Everything about an action that does not change between steps (its handler, message tag, the
receives to post before it, the slice a send takes, the key of a received part, trace
arguments) is worked out once per plan, so a step's loop does little more than call the
stage's forward and backward: the runtime's own CPU per compute call is what
``benchmarks/bench_call_cost.py`` measures.

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
from typing import Callable, Protocol

import torch

from ..formats import Plan
from ..models.stages import Stage, StageSet, WeightTask, backward_input, backward_weight
from ..schedules import GRAD_OUT, PASSES, Action, Kind, sample_ranges, tied_group

from .comm import Comm, Pending, PeerError, describe
from .delivery import delivery_points
from .tied_rows import TiedRows, uses_rows

BACKWARDS = (Kind.BACKWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT)

RECV_LOOKAHEAD = 2
"""A receive is posted this many forward/backward passes before the pass that consumes it."""


def receive_posting(actions: list[Action], lookahead: int = RECV_LOOKAHEAD) -> dict[int, list[Action]]:
    """index in ``actions`` -> the receives to post just before executing that action.

    A receive is consumed by the first pass (F, B, I) after it in the list (W passes count as passes too); it is posted
    before the pass ``lookahead`` passes earlier (at index 0 when there is none)."""
    return {at: [actions[j] for j in js] for at, js in _posting_indices(actions, lookahead).items()}


def _posting_indices(actions: list[Action], lookahead: int = RECV_LOOKAHEAD) -> dict[int, list[int]]:
    """:func:`receive_posting` with each receive named by its index in ``actions``."""
    passes = [i for i, a in enumerate(actions) if a.kind in PASSES]
    out: dict[int, list[int]] = {}
    seen = 0
    for i, a in enumerate(actions):
        if a.kind in PASSES:
            seen += 1
        elif a.is_recv:
            at = passes[seen - lookahead] if seen >= lookahead else 0
            out.setdefault(at, []).append(i)
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
    chunk_compute_s: dict[int, float] = field(default_factory=dict)
    """``compute_s`` by the chunk whose action it was (a rank holding several chunks splits it)."""
    chunk_wait_s: dict[int, float] = field(default_factory=dict)
    """``comm_wait_s`` by chunk."""


Key = tuple[int, int]
"""(chunk, micro-batch)."""


@dataclass(slots=True)
class _StepState:
    """What one step holds between its actions: posted receives, unfinished sends, received
    sample ranges, each (chunk, micro-batch)'s input, output, input gradient and kept weight
    pass, and the step's totals."""

    ids: torch.Tensor | None
    n_tokens: int | None
    grad_uses: dict[Key, int]
    """Per (chunk, micro-batch), consumers of its input gradient still to come (sends, local hand-off)."""
    pending: dict[int, Pending] = field(default_factory=dict)
    """Posted receives by their index in the list."""
    sends: list[Pending] = field(default_factory=list)
    """Sends a waiter thread waits on."""
    held: dict[int, Pending] = field(default_factory=dict)
    """Sends by their index in the list, waited on inline where they are known delivered."""
    parts: dict[tuple[int, int, int], list[tuple[int, torch.Tensor]]] = field(default_factory=dict)
    """(gradient?, chunk, micro-batch) -> received (first sample, tensor) parts."""
    inputs: dict[Key, torch.Tensor] = field(default_factory=dict)
    outputs: dict[Key, torch.Tensor] = field(default_factory=dict)
    in_grads: dict[Key, torch.Tensor] = field(default_factory=dict)
    weight_tasks: dict[Key, WeightTask] = field(default_factory=dict)
    losses: list[torch.Tensor] = field(default_factory=list)
    """The last stage's loss of each micro-batch, added up (in order, in float64) at the step's end."""
    compute_s: float = 0.0
    wait_s: float = 0.0
    sent: int = 0
    chunk_compute: dict[int, float] = field(default_factory=dict)
    chunk_wait: dict[int, float] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class _Chunk:
    """What the passes of one chunk of this rank read, worked out once per plan."""

    stage: Stage
    has_embed: bool
    has_tail: bool
    rows: tuple[int, int]
    """This rank's samples [a, b) of each micro-batch."""
    from_prev: tuple[int, int, int, int] | None
    """The activations handed over in-process by chunk c-1 of this rank: (c-1, lo, hi, c-1's first
    sample); None when none are."""
    from_next: tuple[int, int, int, int] | None
    """The same for the output gradient handed over by chunk c+1."""


class Executor:
    """One rank: its chunks (one :class:`Stage` each), its action list, its links and its optimizer.

    ``schedule``: every rank's list (``schedules.build``), from which the points where this rank's
    sends are known delivered are read (``runtime.delivery``); without it every send is left to a
    waiter thread."""

    def __init__(self, *, rank: int, plan: Plan, actions: list[Action], stage: Stage | StageSet, comm: Comm,
                 optimizer: torch.optim.Optimizer, schedule: dict[int, list[Action]] | None = None):
        self.rank, self.plan, self.actions, self.comm, self.optimizer = rank, plan, actions, comm, optimizer
        held = plan.stages_of_rank(rank)
        self.stages = stage if isinstance(stage, StageSet) else StageSet({held[0].index: stage})
        if sorted(self.stages.chunks) != [c.index for c in held]:
            raise ValueError(f"rank {rank}: built chunks {sorted(self.stages.chunks)}, the plan gives it "
                             f"{[c.index for c in held]}")
        if schedule is not None and list(schedule.get(rank, ())) != list(actions):
            raise ValueError(f"rank {rank}: its action list is not the schedule's list for rank {rank}")
        self.pstages = {c.index: c for c in held}
        self.first_chunk = held[0].index
        """The chunk that names the rank (in traces and statistics); actions of no chunk count here."""
        self.ranges = {c.index: sample_ranges(c)[rank] for c in held}
        self._locals: dict[tuple[int, int], tuple[int, int] | None] = {}
        self.params = {c: [p for _, p in self.stages.owned(c) if p.requires_grad] for c in self.stages.chunks}
        self.recompute_now = {c: _recomputed(st) for c, st in self.stages.chunks.items()}
        now = {c: {id(p) for p in ps} for c, ps in self.recompute_now.items()}
        self.weight_later = {c: [p for p in st.parameters() if p.requires_grad and id(p) not in now[c]]
                             for c, st in self.stages.chunks.items()}
        """Per chunk, the weights its ``W`` computes (a shared tied weight in both of its chunks)."""
        for c in {a.stage for a in actions if a.kind == Kind.BACKWARD_WEIGHT}:
            self.stages.chunks[c].defer_weight_gradients()
        ends = [c for c in self.pstages if self.pstages[c].has_embed or self.pstages[c].has_tail]
        self.tied = self.stages.chunks[ends[0]].tied_parameter() if ends else None
        self.tied_contributor = bool(ends) and self.pstages[ends[0]].devices[0].rank == rank
        self.observer: StepObserver | None = None
        self.posting = receive_posting(actions)
        self.delivered = delivery_points(schedule, rank) if schedule is not None else {}
        """Index in the list -> this rank's sends known delivered once that action has run."""
        self._recv_dtype = self.stages.dtype
        self._chunks = {c: self._chunk(c) for c in self.pstages}
        self._compile_actions()
        self._program = self._compile()
        self._grad_uses0 = self._grad_uses()
        self.step_index = 0
        """Steps done so far (set to the resumed step); with the micro-batch it seeds dropout."""
        self.before_backward: Callable[[], None] | None = None
        """Called once a step, before its first backward (a checkpoint writer holding the last
        step's gradients frees them there)."""
        self.forward_only = not any(a.kind in BACKWARDS for a in actions)
        """A forward-only list (``schedules.build_forward``, evaluation): no backward consumes the
        outputs and no optimizer action awaits the sends, so the step's end does both."""
        self.tied_rows = (TiedRows(plan, rank, self.tied, comm.groups[tied_group(plan)], comm.timeout_s)
                          if uses_rows(plan) and self.tied is not None and not self.forward_only else None)
        """The tied pair's ``rows`` sync (``runtime.tied_rows``) in place of its dense all-reduce."""

    @property
    def stage(self) -> Stage:
        """The rank's first chunk (one-chunk callers)."""
        return next(iter(self.stages.chunks.values()))

    def _local(self, src: int, dst: int) -> tuple[int, int] | None:
        """Samples both chunks ``src`` and ``dst`` of this rank hold: handed over without communication."""
        key = (src, dst)
        if key not in self._locals:
            self._locals[key] = self._overlap(src, dst)
        return self._locals[key]

    def _overlap(self, src: int, dst: int) -> tuple[int, int] | None:
        if src not in self.ranges or dst not in self.ranges:
            return None
        (a, b), (c, d) = self.ranges[src], self.ranges[dst]
        lo, hi = max(a, c), min(b, d)
        return (lo, hi) if lo < hi else None

    def _chunk(self, c: int) -> _Chunk:
        def handed(src: int) -> tuple[int, int, int, int] | None:
            local = self._local(src, c)
            return None if local is None else (src, *local, self.ranges[src][0])

        st = self.pstages[c]
        return _Chunk(stage=self.stages.chunks[c], has_embed=st.has_embed, has_tail=st.has_tail, rows=self.ranges[c],
                      from_prev=handed(c - 1), from_next=handed(c + 1))

    def _compile_actions(self) -> None:
        """Per action, what its handler reads that does not change between steps: message tags,
        the part of a chunk's output or input gradient a send takes (None: all of it), whether a
        waiter thread waits on the send, the key its received part is kept under, and the trace
        arguments of a pass."""
        n = len(self.actions)
        self._tags: list[int | None] = [None] * n
        self._cuts: list[slice | None] = [None] * n
        self._threaded = [True] * n
        self._part_keys: list[tuple[int, int, int] | None] = [None] * n
        self._args: list[dict] = [{}] * n
        delivered = {j for js in self.delivered.values() for j in js}
        for i, act in enumerate(self.actions):
            if act.is_send or act.is_recv:
                self._tags[i] = self.comm.tag(act)
            if act.is_send:
                a, b = self.ranges[act.stage]
                lo, hi = act.samples
                self._cuts[i] = None if (lo, hi) == (a, b) else slice(lo - a, hi - a)
                self._threaded[i] = i not in delivered
            elif act.is_recv:
                self._part_keys[i] = (int(act.kind == Kind.RECV_GRAD), act.stage, act.microbatch)
            elif act.kind in PASSES:
                self._args[i] = {"samples": list(act.samples or self.ranges[act.stage])}

    def _compile(self) -> list[tuple]:
        """The action list as the loop runs it, everything that does not change between steps
        worked out once: per action its handler, its index, the chunk its time counts to, whether
        it is a pass (F, B, I, W) and a backward, the receives to post before it (index, action,
        buffer shape) and the sends known delivered once it has run."""
        run = {Kind.FORWARD: self._forward, Kind.SEND_ACT: self._send_act, Kind.BACKWARD: self._backward,
               Kind.BACKWARD_INPUT: self._backward, Kind.BACKWARD_WEIGHT: self._backward_weight,
               Kind.SEND_GRAD: self._send_grad, Kind.ALLREDUCE: self._allreduce_action,
               Kind.OPTIMIZER: self._optimizer_action, Kind.RECV_ACT: self._receive, Kind.RECV_GRAD: self._receive}
        T, H = self.plan.seq_len, self.stages.hidden_size
        posting, acts = _posting_indices(self.actions), self.actions
        program = []
        for i, act in enumerate(acts):
            posts = tuple((j, acts[j], (acts[j].samples[1] - acts[j].samples[0], T, H)) for j in posting.get(i, ()))
            chunk = act.stage if act.stage in self.pstages else self.first_chunk
            program.append((run.get(act.kind, self._unknown), i, act, chunk, act.kind in PASSES,
                            act.kind in BACKWARDS, posts, self.delivered.get(i, ())))
        return program

    def _unknown(self, i: int, act: Action, s: "_StepState") -> None:  # pragma: no cover - build() only makes known kinds
        raise RuntimeError(f"rank {self.rank}: cannot execute {describe(act)}")

    def step(self, ids: torch.Tensor | None, n_tokens: int | None) -> StepResult:
        """One optimizer step over the global batch ``ids`` (None on ranks that need no tokens)."""
        comm = self.comm
        traced = comm.stamp = self.observer is not None
        s = _StepState(ids=ids, n_tokens=n_tokens, grad_uses=dict(self._grad_uses0))
        chunk_compute = s.chunk_compute = dict.fromkeys(self.pstages, 0.0)
        chunk_wait = s.chunk_wait = dict.fromkeys(self.pstages, 0.0)
        pending, held, tags, dtype, empty = s.pending, s.held, self._tags, self._recv_dtype, torch.empty
        waiting = self.before_backward
        if self.tied_rows is not None:
            t0 = time.perf_counter()
            self.tied_rows.begin(ids)
            s.wait_s += time.perf_counter() - t0
        for run, i, act, chunk, is_pass, backward, posts, delivered in self._program:
            for j, r, shape in posts:
                pending[j] = comm.irecv(r, empty(shape, dtype=dtype), tags[j])
            if waiting is not None and backward:
                waiting()
                waiting = None
            c0, w0 = s.compute_s, s.wait_s
            run(i, act, s)
            if delivered and not traced:  # traced steps hand every send to a waiter thread (its stamp)
                t0 = time.perf_counter()
                for j in delivered:
                    p = held.pop(j)
                    comm.wait(p)
                    s.sent += p.nbytes
                s.wait_s += time.perf_counter() - t0
            chunk_compute[chunk] += s.compute_s - c0
            chunk_wait[chunk] += s.wait_s - w0
            if is_pass and s.sends:
                s.sent += self._release_finished(s.sends)
        if self.forward_only:
            self._end_forward_only(s)
        left = (s.pending, s.parts, s.outputs, s.in_grads, s.weight_tasks, s.held)
        if any(left):
            raise RuntimeError(f"rank {self.rank}: step ended with unconsumed messages or activations "
                               f"({', '.join(str(len(x)) for x in left)} receives, parts, outputs, input "
                               "gradients, weight passes, unawaited sends)")
        self.step_index += 1
        loss = 0.0
        for x in torch.stack(s.losses).tolist() if s.losses else ():
            loss += x  # in micro-batch order, in float64: what adding them up as tensors gave
        return StepResult(loss=loss, compute_s=s.compute_s, comm_wait_s=s.wait_s, sent_bytes=s.sent,
                          chunk_compute_s=s.chunk_compute, chunk_wait_s=s.chunk_wait)

    def _end_forward_only(self, s: "_StepState") -> None:
        """Await the sends and drop the outputs of a forward-only step (nothing reads them later)."""
        self._await_sends(s)
        s.inputs.clear()
        s.outputs.clear()

    def _await_sends(self, s: "_StepState") -> None:
        """Wait for every send of the step still outstanding (the step's end)."""
        obs = self.observer
        for p in s.sends:
            self.comm.wait(p)
            if obs:
                obs.p2p(p, None)
        for p in s.held.values():
            self.comm.wait(p)
        s.sent += sum(p.nbytes for p in s.sends) + sum(p.nbytes for p in s.held.values())
        s.sends.clear()
        s.held.clear()

    def label_actions(self) -> None:
        """Run every action under ``torch.profiler.record_function`` named by its printable form
        (``1F0``, ``1SA0>2[0:4]``), so torch.profiler traces carry the schedule.

        The handlers are wrapped on this instance only, so an executor that is never labelled runs
        exactly as before, at no cost; labelling costs one context per action while it is on."""
        from torch.profiler import record_function

        def labelled(handler: Callable[[int, Action, "_StepState"], None]) -> Callable[[int, Action, "_StepState"], None]:
            def run(i: int, act: Action, s: "_StepState") -> None:
                with record_function(str(act)):
                    handler(i, act, s)
            return run

        for name in ("_forward", "_send_act", "_backward", "_backward_weight", "_send_grad", "_allreduce_action",
                     "_optimizer_action", "_receive"):
            setattr(self, name, labelled(getattr(type(self), name).__get__(self)))
        self._program = self._compile()  # the loop runs the handlers the program holds

    def _grad_uses(self) -> dict[Key, int]:
        """Per (chunk, micro-batch), who reads its input gradient: each send, and the earlier chunk
        of this rank when it holds some of the same samples (a local hand-off)."""
        out: dict[Key, int] = {}
        for act in self.actions:
            key = (act.stage, act.microbatch)
            if act.kind == Kind.SEND_GRAD:
                out[key] = out.get(key, 0) + 1
            elif act.kind in GRAD_OUT and self._local(act.stage - 1, act.stage):
                out[key] = out.get(key, 0) + 1
        return out

    def _receive(self, i: int, act: Action, s: "_StepState") -> None:
        t0 = time.perf_counter()
        p = s.pending.pop(i)
        tensor = self.comm.wait(p)
        s.wait_s += time.perf_counter() - t0
        if self.observer:
            self.observer.p2p(p, t0)
        key = self._part_keys[i]
        parts = s.parts.get(key)
        if parts is None:
            s.parts[key] = [(act.samples[0], tensor)]
        else:
            parts.append((act.samples[0], tensor))

    def _gather(self, grad: int, ch: _Chunk, c: int, mb: int, s: "_StepState") -> torch.Tensor:
        """This chunk's input (activations) or output gradient: received parts plus the local hand-off
        from the neighbouring chunk of this rank."""
        parts = s.parts.pop((grad, c, mb), None)
        local = ch.from_next if grad else ch.from_prev
        if local is not None:
            src, lo, hi, a = local
            if grad:
                part = self._use_in_grad((src, mb), s)[lo - a:hi - a]
            else:
                part = s.outputs[(src, mb)][lo - a:hi - a].detach()
            parts = [(lo, part)] if parts is None else [*parts, (lo, part)]
        return _joined(parts or [], *ch.rows)

    def _use_in_grad(self, key: Key, s: "_StepState") -> torch.Tensor:
        g = s.in_grads[key]
        s.grad_uses[key] -= 1
        if s.grad_uses[key] == 0:  # pending sends keep the tensor alive as long as they need it
            s.in_grads.pop(key)
        return g

    def _forward(self, i: int, act: Action, s: "_StepState") -> None:
        c, obs, mb = act.stage, self.observer, act.microbatch
        ch = self._chunks[c]
        if obs:
            obs.forward_microbatch(mb)
        t0 = time.perf_counter()
        if ch.has_embed or ch.has_tail:
            base = mb * self.plan.micro_batch_size
            rows = slice(base + ch.rows[0], base + ch.rows[1])
        x = s.ids[rows] if ch.has_embed else self._gather(0, ch, c, mb, s).requires_grad_(True)
        labels = s.ids[rows] if ch.has_tail else None
        stage = ch.stage
        stage.rng_key = (self.step_index, mb)
        out = stage.forward(x, labels, s.n_tokens)
        key = (c, mb)
        s.inputs[key] = x
        s.outputs[key] = out
        if ch.has_tail:
            s.losses.append(out.detach())
        t1 = time.perf_counter()
        s.compute_s += t1 - t0
        if obs:
            obs.compute(act, t0, t1, self._args[i])

    def _send(self, i: int, act: Action, tensor: torch.Tensor, s: "_StepState") -> None:
        p = self.comm.isend(act, tensor, self._tags[i], self._threaded[i])
        if p.threaded:
            s.sends.append(p)
        else:
            s.held[i] = p

    def _send_act(self, i: int, act: Action, s: "_StepState") -> None:
        out, cut = s.outputs[(act.stage, act.microbatch)], self._cuts[i]
        self._send(i, act, (out if cut is None else out[cut]).detach().contiguous(), s)

    def _backward(self, i: int, act: Action, s: "_StepState") -> None:
        """A full backward (``B``) or the input-gradient half (``I``) of one chunk's micro-batch."""
        c, obs, mb = act.stage, self.observer, act.microbatch
        key = (c, mb)
        t0 = time.perf_counter()
        if obs:
            obs.backward_begin(mb, t0)
        out, x = s.outputs.pop(key), s.inputs.pop(key)
        ch = self._chunks[c]
        grad = None if ch.has_tail else self._gather(1, ch, c, mb, s)
        if act.kind == Kind.BACKWARD:
            torch.autograd.backward(out, grad)
            dx = x.grad if x.requires_grad else None
        else:
            dx, s.weight_tasks[key] = backward_input(out, grad, x, self.weight_later[c], self.recompute_now[c])
        del out, x
        if dx is not None and s.grad_uses.get(key):
            s.in_grads[key] = dx
        self._timed(i, act, t0, s)

    def _backward_weight(self, i: int, act: Action, s: "_StepState") -> None:
        """The weight-gradient half (``W``): its kept graph is freed here."""
        t0 = time.perf_counter()
        backward_weight(s.weight_tasks.pop((act.stage, act.microbatch)))
        self._timed(i, act, t0, s)

    def _timed(self, i: int, act: Action, t0: float, s: "_StepState") -> None:
        obs, t1 = self.observer, time.perf_counter()
        s.compute_s += t1 - t0
        if obs:
            if act.kind != Kind.BACKWARD_WEIGHT:
                obs.backward_end(act.microbatch, t1)
            obs.compute(act, t0, t1, self._args[i])

    def _send_grad(self, i: int, act: Action, s: "_StepState") -> None:
        g, cut = self._use_in_grad((act.stage, act.microbatch), s), self._cuts[i]
        self._send(i, act, (g if cut is None else g[cut]).contiguous(), s)

    def _allreduce_action(self, i: int, act: Action, s: "_StepState") -> None:
        t0 = time.perf_counter()
        nbytes = self._all_reduce(act)
        t1 = time.perf_counter()
        s.wait_s += t1 - t0
        if self.observer:
            self.observer.collective(act, t0, t1, nbytes)

    def _optimizer_action(self, i: int, act: Action, s: "_StepState") -> None:
        """Wait for this step's sends, then step the optimizer (over every chunk of the rank)."""
        obs = self.observer
        t0 = time.perf_counter()
        self._await_sends(s)
        t1 = time.perf_counter()
        s.wait_s += t1 - t0
        s.inputs.clear()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        t2 = time.perf_counter()
        # a clipping optimizer first waits for every rank's gradient norm: a wait, not the update
        synced = t1 + min(getattr(self.optimizer, "sync_s", 0.0), t2 - t1)
        s.wait_s += synced - t1
        s.compute_s += t2 - synced
        if obs:
            obs.compute(act, synced, t2, {})

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
            if self.tied_rows is not None:
                return self.tied_rows.exchange()
            g = self.tied.grad if self.tied.grad is not None else torch.zeros_like(self.tied)
            buf = g if self.tied_contributor else torch.zeros_like(g)
            sent = self.comm.all_reduce(act, [buf])
            self.tied.grad = buf
            return buf.numel() * buf.element_size() if sent is None else sent
        grads = []
        for p in self.params[act.stage]:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
        sent = self.comm.all_reduce(act, grads)
        return sum(g.numel() * g.element_size() for g in grads) if sent is None else sent


def _recomputed(stage: Stage) -> list[torch.nn.Parameter]:
    """Parameters of the layers ``stage`` recomputes: their gradients are taken in the ``I`` pass
    (a checkpointed layer's saved tensors are recomputed for one backward pass only)."""
    a, b = stage.spec.layers
    flags = stage.spec.recompute or ()
    out: list[torch.nn.Parameter] = []
    for i, rec in zip(range(a, b), flags):
        if rec:
            out += [p for p in stage.layer_list[i].parameters() if p.requires_grad]
    return out


def _joined(parts: list[tuple[int, torch.Tensor]], a: int, b: int) -> torch.Tensor:
    """Concatenate received sample ranges (in sample order) into this rank's [a, b)."""
    if len(parts) == 1 and parts[0][0] == a and parts[0][1].shape[0] == b - a:
        return parts[0][1]
    parts = sorted(parts, key=lambda p: p[0])
    got = parts[0][0], parts[0][0] + sum(t.shape[0] for _, t in parts)
    if got != (a, b):
        raise RuntimeError(f"received samples {list(got)} do not cover this rank's range [{a}, {b})")
    return parts[0][1] if len(parts) == 1 else torch.cat([t for _, t in parts])


def failed_action(exc: BaseException) -> tuple[int, Action] | None:
    """(index in the rank's list, action) that ``exc`` escaped from inside ``Executor.step``; None
    when it did not come from there. Read off the traceback, so the loop pays nothing for it."""
    tb, found = exc.__traceback__, None
    while tb is not None:
        if tb.tb_frame.f_code is Executor.step.__code__:
            ex, act = tb.tb_frame.f_locals.get("self"), tb.tb_frame.f_locals.get("act")
            if isinstance(ex, Executor) and isinstance(act, Action):
                i = next((k for k, a in enumerate(ex.actions) if a is act), None)
                found = (i, act) if i is not None else found
        tb = tb.tb_next
    return found


def describe_failure(rank: int, step: int, exc: BaseException, schedule: dict[int, list[Action]]) -> str:
    """Rank, step and action an error escaped from, with the schedule grid (``*`` on the action)."""
    from ..schedules import format_schedule

    where = failed_action(exc)
    if where is None:
        return f"rank {rank} step {step}: {type(exc).__name__}: {exc} (outside the action list)"
    i, act = where
    return (f"rank {rank} step {step}: action {i} ({act}) failed: {type(exc).__name__}: {exc}\n"
            + format_schedule(schedule, {rank: i}))
