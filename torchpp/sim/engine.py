"""Event-driven pricing of torchpp's action lists: the stepping core with a pluggable comm model.

Each rank runs its list in order (the runtime's order, from :func:`torchpp.schedules.build`):
compute actions occupy the rank's exclusive compute channel, sends and all-reduces are
posted without blocking, a receive waits for its message, the optimizer step waits for the
rank's outstanding all-reduces (:mod:`.core`). Communication runs in one of two models:

- ``links`` (:mod:`.links`): every directed link is its own FIFO and every transfer runs at
  full speed (a link with a measured burst is a token bucket; a host whose interface is
  shared queues its transfers on it); all-reduces of a rank run one after another. This is
  exactly :func:`replay`'s pricing.
- ``shared`` (:mod:`.shared`): each rank has one comm channel that its outgoing transfers
  and its all-reduces share by priority (:mod:`.tiers`); all-reduces slow compute
  (interference) and receivers can be congested (:mod:`.congestion`).

Rates are piecewise constant between events, so a task's finish time is exact: a heap holds
the predicted finish of every task, invalidated whenever its rate changes. A task whose
rate never changes finishes at ``start + duration`` exactly.
"""
from __future__ import annotations

from ..schedules import Schedule
from .compiled import AR, SA, SG, Compiled, bursts, check_finished, durations, durations_generic, nics, timeline
from .core import Run, step
from .links import links_hooks, replay_links
from .shared import shared_hooks
from .types import CostModel, SimOptions, SimResult, Timeline

__all__ = ["Compiled", "SimOptions", "SimResult", "simulate", "durations", "durations_generic"]


def simulate(sched: Schedule | Compiled, cost: CostModel, options: SimOptions | None = None, *,
             record_rates: bool = False, spans: bool = True, events: bool = False) -> SimResult:
    """Price the action lists with ``cost`` under ``options`` (see the module docstring).

    ``spans=False`` keeps only the makespan (a sweep needs nothing else); ``record_rates``
    logs every rate change of a transfer or all-reduce (``SimResult.rate_log``). The ``links``
    model is walked list by list (``links.replay_links``, the same numbers without the event
    heap); ``events=True`` runs it on the event core instead (what the tests compare it with),
    as does a cost model whose hosts share interfaces (``nic_s``: their queues need time order)."""
    c = sched if isinstance(sched, Compiled) else Compiled(sched)
    o = options or SimOptions()
    dur = durations(c, cost)
    shared_nics = nics(c, cost) if o.comm == "links" else None
    if o.comm == "links" and not events and shared_nics is None:
        start, end, ready, pc = replay_links(c, dur, bursts(c, cost))
        return _result(c, pc, start, end, ready, spans)
    run = Run(c, dur)
    if o.comm == "links":
        step(run, links_hooks(run, bursts(c, cost), shared_nics))
        return _result(c, run.pc, run.start, run.end, run.ready, spans)
    hooks, ch = shared_hooks(run, o, record_rates)
    step(run, hooks)
    res = _result(c, run.pc, run.start, run.end, run.ready, spans)
    res.events = run.events
    if spans:
        owner, code, ranks, st = c.owner, c.code, c.ranks, c.step
        res.throttled = {(ranks[owner[m]], st[m]) for m in ch.throttled}
        if ch.log is not None:
            res.rate_log = [(t, ranks[owner[k]], st[k], v) for t, k, v in ch.log if code[k] in (SA, SG, AR)]
    return res


def _result(c: Compiled, pc: list[int], start: list[float], end: list[float], ready: list[float],
            spans: bool) -> SimResult:
    """A finished run's result (a deadlock raises): its spans, or only its makespan."""
    check_finished(c, pc)
    if not spans:
        return SimResult(timeline=Timeline({r: [] for r in c.ranks}), completion=max(end, default=0.0))
    return SimResult(timeline=timeline(c, start, end, ready))
