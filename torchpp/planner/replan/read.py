"""Reading a traced run for re-planning: the old cost model's inputs and what the timelines measured.

Compute times come with the plan's own prediction for each (:class:`~torchpp.cost.MeasuredCost`);
transfers are matched send/receive pairs; the optimizer's time and each rank's peak RSS are kept.
"""
from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

from ...formats import Bandwidth, Capacities, Devices, FormatError, LayersFile, MemoryModel, Plan
from ...schedules import Kind, build
from ...trace.analyze import COMPUTE_KINDS, Event, analyze, events_from_trace, message_key
from ...trace.call_gaps import call_gaps
from ...trace.chrome import load_trace
from ...trace.of_plan import check_trace_of_plan
from ...cost import ANALYTIC_KP, Links, MeasuredCost, MemoryEstimator, Profiles
from .write import template_from_model

_PASSES = (Kind.FORWARD, Kind.BACKWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT)

STALLED_STEP = 0.25
"""A traced step slower than the median step by more than this share was stalled (the run's first
steps fault their pages in and fill the allocator; another process took the CPU), and is left out of
the fits: its passes, messages, optimizer and gaps would carry that slowness into every host's
factor, while the step time the re-plan compares against is the median. On the demo's homelab
runs step 2 was 37-49% slower than steps 3-6 (which agree within 5%) and raised the mean-fitted
compute by 4-11%; steps of a few tens of milliseconds jitter by 10-20%, so the bar sits above that."""


# ----------------------------------------------------------------------------- reading the run
@dataclass
class Compute:
    """One measured compute pass of one micro-batch of one chunk on one rank, with its prediction."""

    rank: int
    step: int
    kind: str            # "F", "B", or a zero-bubble schedule's "I" (input gradient) / "W" (weight gradient)
    microbatch: int
    seconds: float
    predicted_s: float
    stage: int = 0
    """The chunk (``args.stage``) the pass belongs to."""


@dataclass
class Transfer:
    src: int
    dst: int
    nbytes: int
    seconds: float
    clock_s: float = 0.0
    """Uncertainty of the two ranks' clock alignment (half their ping-pong round trips)."""
    censored: bool = False
    """The later of the two slice starts was set by the previous message on its row, not by the
    message being posted: the transfer may have begun earlier, so its time is a lower bound."""
    step: int = 0
    start_s: float = 0.0
    """When both ends had posted it, on the merged clock (s)."""
    end_s: float = 0.0
    """When it arrived, on the merged clock (s)."""


@dataclass
class Measurements:
    steps: dict[int, float] = field(default_factory=dict)
    """Traced step -> measured step time (s), every traced step."""
    stalled: dict[int, float] = field(default_factory=dict)
    """Traced steps left out of the fits (:data:`STALLED_STEP`) -> their step time (s)."""
    compute: list[Compute] = field(default_factory=list)
    transfers: list[Transfer] = field(default_factory=list)
    optimizer: dict[int, list[float]] = field(default_factory=lambda: defaultdict(list))
    peak_rss: dict[int, int] = field(default_factory=dict)
    """rank -> largest peak RSS over the traced steps (bytes)."""
    files: list[str] = field(default_factory=list)
    trace_hosts: dict[int, str] = field(default_factory=dict)
    gaps: dict[int, dict[int, list[float]]] = field(default_factory=lambda: defaultdict(dict))
    """rank -> traced step -> runtime seconds between consecutive compute calls beyond waiting
    (see call_gaps); per step, so the per-call time can be the median step's as the step time is."""

    @property
    def step_time_s(self) -> float:
        return statistics.median(self.steps.values())


def find_merged(trace_dir: Path) -> list[tuple[int, Path]]:
    """The merged timelines of a trace folder, with an error that says what is there instead."""
    from ...trace.report import find_timelines

    if not trace_dir.exists():
        raise FileNotFoundError(f"{trace_dir}: no such trace folder")
    try:
        return find_timelines(trace_dir)
    except FileNotFoundError:
        per_rank = sorted(p.name for p in trace_dir.glob("timeline_step*_rank*.json"))
        hint = (f"; it holds per-rank files ({', '.join(per_rank[:3])}{'…' if len(per_rank) > 3 else ''}) but rank 0 "
                "did not write the merged one (did the run finish its traced steps?)" if per_rank else
                "; run `torchrun -m torchpp.train --plan P --trace-dir DIR --trace-steps 2,3` to write them")
        raise FileNotFoundError(f"{trace_dir}: no merged timelines (timeline_step<N>_all.json){hint}") from None


def read_run(trace_dir: Path, plan: Plan, profiles: Profiles, plan_src: str = "plan.json",
             steps: Sequence[int] | None = None) -> Measurements:
    """Measured compute (with the plan's predictions), transfers, optimizer time and peaks."""
    from ...trace.report import rank_memory

    found = find_merged(trace_dir)
    if steps:
        have = dict(found)
        missing = [s for s in steps if s not in have]
        if missing:
            raise FileNotFoundError(f"{trace_dir}: no timeline_step{missing[0]}_all.json "
                                    f"(traced steps: {', '.join(str(n) for n, _ in found)})")
        found = [(s, have[s]) for s in steps]
    cost = MeasuredCost(plan, profiles, Links(Bandwidth(bytes_per_sec={}), "-"))
    pred = {}
    for r, acts in build(plan).items():
        for a in acts:
            if a.kind in _PASSES:
                pred[(r, a.stage, a.kind.value, a.microbatch)] = cost.compute_s(r, a)
    out = Measurements()
    opt_steps: dict[int, list[tuple[int, float]]] = defaultdict(list)
    for n, path in found:
        tr = load_trace(path)
        evs = events_from_trace(tr)
        if not evs:
            raise FormatError(str(path), "traceEvents", "pipeline events (F<mb>/B<mb>/send/recv with args.stage)")
        check_trace_of_plan(str(path), tr, evs, plan, plan_src)
        out.files.append(str(path))
        out.steps[n] = analyze(evs).step_time_s
        for r, v in rank_memory(tr).items():
            out.peak_rss[r] = max(out.peak_rss.get(r, 0), v)
        rtt: dict[int, float] = {}
        for r, info in ((tr.get("metadata") or {}).get("ranks") or {}).items():
            if isinstance(info, Mapping) and info.get("host"):
                out.trace_hosts[int(r)] = str(info["host"])
            if isinstance(info, Mapping):
                rtt[int(r)] = float(info.get("clock_rtt_s") or 0.0)
        sends: dict[tuple, Event] = {}
        recvs: list[Event] = []
        for e in evs:
            if e.kind in COMPUTE_KINDS:
                key = (e.rank, e.stage, e.kind, int(e.microbatch))
                if key not in pred:
                    raise FormatError(str(path), f"traceEvents ({e.kind}{e.microbatch} of rank {e.rank}, stage "
                                      f"{e.stage})", f"a compute pass of {plan_src}'s schedule {plan.schedule!r}")
                out.compute.append(Compute(e.rank, n, e.kind, int(e.microbatch), e.dur, pred[key], e.stage))
            elif e.kind == "optimizer":
                opt_steps[e.rank].append((n, e.dur))
            elif e.kind.startswith("send"):
                sends[message_key(e)] = e
            elif e.kind.startswith("recv"):
                recvs.append(e)
        for r, g in call_gaps(evs).items():
            out.gaps[r][n] = g
        clipped = _row_clipped(list(sends.values()) + recvs)
        for rv in recvs:
            sd = sends.get(message_key(rv))  # chunks of one rank sending to one peer told apart
            if sd is None or not rv.bytes:
                continue
            # the message can move only once both ends have posted it; it is done when it arrived
            first = sd if sd.start >= rv.start else rv
            secs = rv.end - first.start
            unc = (rtt.get(sd.rank, 0.0) + rtt.get(rv.rank, 0.0)) / 2
            out.transfers.append(Transfer(int(sd.rank), int(rv.rank), int(rv.bytes), secs, unc, id(first) in clipped, n,
                                          first.start, rv.end))
    _leave_out_stalled(out, opt_steps)
    return out


def _leave_out_stalled(m: Measurements, opt_steps: Mapping[int, list[tuple[int, float]]]) -> None:
    """Drop what the stalled steps measured (peaks stay: a peak is a peak whenever it came);
    ``opt_steps``: rank -> [(step, optimizer seconds)]."""
    med = m.step_time_s
    m.stalled = {n: t for n, t in m.steps.items() if t > (1 + STALLED_STEP) * med}
    for r, got in opt_steps.items():
        m.optimizer[r] = [d for n, d in got if n not in m.stalled]
    if not m.stalled:
        return
    m.compute = [c for c in m.compute if c.step not in m.stalled]
    m.transfers = [t for t in m.transfers if t.step not in m.stalled]
    for r in m.gaps:
        m.gaps[r] = {n: g for n, g in m.gaps[r].items() if n not in m.stalled}


def _row_clipped(p2p: list[Event], eps: float = 2e-6) -> set[int]:
    """ids of send/recv slices that start where the previous slice of their row ended.

    A rank's send (and recv) row is laid out one message after another: a slice starts when its
    message was posted or when the previous one finished, whichever is later. Where it starts at
    the previous end, the message may have been moving before (to another peer) already.
    """
    rows: dict[tuple[int, str], list[Event]] = defaultdict(list)
    for e in p2p:
        rows[(e.rank, e.kind[:4])].append(e)
    out = set()
    for evs in rows.values():
        evs.sort(key=lambda e: (e.start, e.end))  # a row's slices do not overlap; starts order them
        for prev, cur in zip(evs, evs[1:]):
            if abs(cur.start - prev.end) <= eps:
                out.add(id(cur))
    return out


# ----------------------------------------------------------------------------- the old cost model
@dataclass
class OldCosts:
    """What the plan was priced with: its profiles, bandwidth, memory model and devices."""

    profiles: Profiles
    files: list[LayersFile]
    """The layers files given (none: the model's FLOPs shaped one table for every host)."""
    capacities: Capacities | None
    templates: dict[str, LayersFile]
    """Per measured host, its layers file (the corrected file keeps its bytes and run)."""
    default_template: LayersFile
    origin: dict[str, str]
    bandwidth: Bandwidth
    memory: MemoryEstimator
    memory_model: MemoryModel | None
    """The calibration file ``memory`` was read from (None: the analytic model)."""
    hosts: list[str]
    """The devices to plan for (devices.json, or the plan's own)."""
    budget: dict[str, float]
    devices: Devices | None
    planned: list[str]
    """Hosts the plan used."""

    @property
    def all_hosts(self) -> list[str]:
        return sorted(set(self.hosts) | set(self.planned))


def read_old_costs(plan: Plan, plan_src: str, layers: Sequence[Path] | None, capacities: Path | None,
                   devices: Path | None, bandwidth: Path | None, memory_model: Path | None) -> OldCosts:
    """The inputs the plan was made from; missing layers files: the model's per-block FLOPs."""
    files = [LayersFile.load(p) for p in layers or []]
    cap = Capacities.load(capacities) if capacities else None
    if files:
        prof = Profiles.from_layers(files, cap, [str(p) for p in layers], str(capacities or "capacities.json"))
        if prof.model.num_layers != plan.model.num_layers:
            raise FormatError(plan_src, "model.num_layers", f"{prof.model.num_layers} (the layers files' model)",
                              plan.model.num_layers)
        if prof.seq_len != plan.seq_len:
            raise FormatError(plan_src, "seq_len", f"{prof.seq_len} (the layers files' run.seq_len)", plan.seq_len)
        templates = {lf.host: lf for lf in files}
        default_template = files[0]
    else:
        default_template = template_from_model(plan)
        prof = Profiles.from_layers([default_template], None, ["model FLOPs"])
        templates = {}
    hosts, budget, dv = read_budgets(devices, plan, plan_src)
    planned = sorted({d.host for s in plan.stages for d in s.devices})
    if not files:
        f0, b0 = prof.table(default_template.host)
        for x in (prof.fwd, prof.bwd, prof.fwd0, prof.bwd0, prof.origin):
            del x[default_template.host]
        for h in sorted(set(hosts) | set(planned)):
            prof.set_table(h, f0, b0, 1, "model FLOPs at a nominal 1 GFLOP/s")
    prof.ensure(sorted(set(hosts) | set(planned)), str(devices or plan_src))
    old_origin = dict(prof.origin)
    old_bw = Bandwidth.load(bandwidth) if bandwidth else Bandwidth(bytes_per_sec={}, source="none")
    mm = MemoryModel.load(memory_model) if memory_model else None
    old_mem = MemoryEstimator.fitted(mm, str(memory_model)) if mm else MemoryEstimator.analytic(ANALYTIC_KP)
    return OldCosts(profiles=prof, files=files, capacities=cap, templates=templates,
                    default_template=default_template, origin=old_origin, bandwidth=old_bw, memory=old_mem,
                    memory_model=mm, hosts=hosts, budget=budget, devices=dv, planned=planned)


def read_budgets(devices: Path | None, plan: Plan, plan_src: str
                 ) -> tuple[list[str], dict[str, float], Devices | None]:
    """Hosts and memory budgets: devices.json, else the budgets in the plan's prediction."""
    if devices is not None:
        dv = Devices.load(devices)
        return dv.hosts, {h: dv.memory_bytes(h) for h in dv.hosts}, dv
    hosts, budget = [], {}
    stages = (plan.predicted or {}).get("stages") or []
    for s in plan.stages:
        for d in s.devices:
            got = next((x.get("budget_bytes") for ps in stages for x in ps.get("devices", [])
                        if x.get("rank") == d.rank), None)
            if got is None:
                raise FormatError(plan_src, f"predicted.stages[{s.index}].devices (rank {d.rank}).budget_bytes",
                                  "a memory budget per device; pass --devices devices.json")
            if d.host not in budget:
                hosts.append(d.host)
            budget[d.host] = float(got)
    return hosts, budget, None
