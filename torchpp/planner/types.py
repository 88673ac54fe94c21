"""The planner's shared types, at the bottom of planner/: the problem, a stage choice, a search's
result, and the plan space's limits every search step reads (micro-batch sizes, stage counts).

Everything else in planner/ imports this module; it imports nothing of planner/.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Mapping, Sequence

import numpy as np

from ..cost import Links, MemoryEstimator, Profiles
from ..formats import Plan

INF = float("inf")


class InfeasibleError(ValueError):
    """No plan fits in memory; the message names devices and the bytes they lack."""


@dataclass
class Ledger:
    """What a search keeps across its kinds: the lowest priced plan so far and how to replay it with
    its spans (done once, for the plan the search returns: the chosen plan's prediction reuses that
    replay instead of replaying the plan again), and the action lists already built and flattened,
    by :func:`planner.pricing.schedule_key`."""

    step_time_s: float = float("inf")
    plan: Plan | None = None
    replay: Callable[[], Any] | None = None
    """Replays ``plan`` with its spans: its ``sim.replay.Timeline`` (:attr:`timeline`)."""
    schedules: dict = field(default_factory=dict)
    stage_times: dict = field(default_factory=dict)
    """Each (host, span)'s compute time, worked out once per search (``cost.MeasuredCost``'s memo)."""
    kinds: frozenset[str] | None = None
    """The kinds searched (None: any): a plan of another kind, priced only to seed them (the stage
    DP's 1F1B layouts under ``--schedule interleaved``), is neither kept nor a bar to prune at."""
    _timeline: Any = field(default=None, init=False, repr=False)

    def wants(self, step: float, plan: Plan) -> bool:
        """Whether ``plan`` priced ``step`` would be kept."""
        return (self.kinds is None or plan.schedule in self.kinds) and step < self.step_time_s

    def offer(self, step: float, plan: Plan, replay: Callable[[], Any]) -> None:
        if self.wants(step, plan):
            self.step_time_s, self.plan, self.replay, self._timeline = step, plan, replay, None

    @property
    def timeline(self) -> Any:
        """``sim.replay.Timeline`` of ``plan``'s step (None without a plan), replayed on first use."""
        if self._timeline is None and self.replay is not None:
            self._timeline = self.replay()
        return self._timeline


@dataclass(kw_only=True)
class Problem:
    profiles: Profiles
    links: Links
    hosts: list[str]
    budget: Mapping[str, float]
    """Memory budget per host, bytes."""
    memory: MemoryEstimator
    global_batch: int
    schedule: str = "1f1b"
    """A schedule kind, a comma-separated list of kinds, or ``auto`` (every kind, chunks included)."""
    max_stages: int | None = None
    micro_batch_sizes: Sequence[int] | None = None
    """Micro-batch sizes to consider (default: every divisor of the global batch)."""
    allow_recompute: bool = True
    exact_devices: int = 5
    max_group: int = 8
    top_k: int = 12
    optimizer_s_per_byte: Mapping[str, float] | float | None = None
    ledger: Ledger = field(default_factory=Ledger, compare=False, repr=False)
    """The search's best priced plan and its replay, shared by the problems ``dataclasses.replace``
    derives from this one (one per schedule kind): :func:`planner.search.search` starts it afresh."""
    refine_evals: int | None = None
    """Plans priced by the local search after the DP (default: 300 with exact device orders, 8 up to 16
    devices, none beyond, where one pricing costs more than it tends to gain)."""


@dataclass
class StageChoice:
    cut: tuple[int, int]
    hosts: tuple[int, ...]
    recompute_all: bool
    cost: float


@dataclass
class SearchResult:
    plan: Plan | None
    """The best priced plan; None only from a one-kind search inside ``search_kinds`` whose every
    candidate was beaten by an earlier kind's plan before it was priced (planner/prune.py)."""
    step_time_s: float
    candidates_priced: int
    dp_candidates: int
    planning_time_s: float
    priced: list[tuple[float, Plan]] = field(default_factory=list)
    mode: str = ""
    refined: int = 0
    """Plans priced by the local search (included in ``candidates_priced``)."""
    around: list[tuple[float, Plan]] = field(default_factory=list)
    """Those of ``priced`` the searches around the DP's candidates found (device orders, local search)."""
    skipped: list[tuple[int, tuple[tuple[int, ...], ...]]] = field(default_factory=list)
    """(micro-batch size, device groups in pipeline order) of the DP's candidates the bound skipped
    (planner/prune.py): they cannot win under this kind, but may under another."""
    unpicked: list[tuple[int, tuple[tuple[int, ...], ...]]] = field(default_factory=list)
    """(micro-batch size, device groups) of the DP's best candidates beyond those it priced, best
    estimate first: more device groups for the other kinds to start from."""
    tables: Any = None
    """The search's ``planner.tables.Tables`` (the kinds search reuses them)."""
    kinds: dict[str, float] = field(default_factory=dict)
    """Best priced step time per schedule kind searched."""
    timeline: Any = None
    """``sim.replay.Timeline`` of ``plan``: the replay that priced it (the prediction reuses it)."""


Layout = list[tuple[tuple[int, int], tuple[int, ...]]]
"""A plan's shape: per stage its layer cut [c, c2) and its group (host indices)."""


def stage_layout(order: Sequence[int], stages: Sequence[StageChoice]) -> Layout:
    """The layout of the DP's stage choices over a device order."""
    return [(st.cut, tuple(order[x] for x in range(*st.hosts))) for st in stages]


def layout_choices(layout: Layout) -> tuple[list[int], list[StageChoice]]:
    """A layout as a device order and the DP's stage choices over it (what ``build_plan`` takes):
    the inverse of :func:`stage_layout`."""
    order: list[int] = []
    stages = []
    for cut, group in layout:
        stages.append(StageChoice(cut=tuple(cut), hosts=(len(order), len(order) + len(group)), recompute_all=False,
                                  cost=0.0))
        order += group
    return order, stages


# ----------------------------------------------------------------------------- from DP to plans
REFINE_HEURISTIC = 8
"""Local-search pricings beyond ``exact_devices`` devices (up to 16 devices)."""
HEURISTIC_MAX_STAGES = 16
"""Beyond ``exact_devices`` devices, at most this many stages unless max_stages says otherwise."""
HEURISTIC_MICRO_BATCH_SIZES = 4
"""Beyond ``exact_devices`` devices, at most this many micro-batch sizes (spread geometrically)."""


def micro_batch_sizes(pb: Problem, exact: bool = True) -> list[int]:
    G = pb.global_batch
    if pb.micro_batch_sizes:
        bad = [b for b in pb.micro_batch_sizes if b < 1 or G % b]
        if bad:
            raise ValueError(f"micro-batch sizes {bad} do not divide the global batch {G}")
        return sorted(set(pb.micro_batch_sizes))
    divs = [b for b in range(1, G + 1) if G % b == 0]
    if exact or len(divs) <= HEURISTIC_MICRO_BATCH_SIZES:
        return divs
    # keep micro-batch counts m = G / b that leave room for a pipeline: the smallest b values,
    # spread over the divisors with m >= 2
    usable = [b for b in divs if G // b >= 2] or divs
    idx = np.unique(np.round(np.linspace(0, len(usable) - 1, HEURISTIC_MICRO_BATCH_SIZES)).astype(int))
    return [usable[i] for i in idx]



def max_stages_of(pb: Problem) -> int:
    """Most stages the search considers: every device up to ``exact_devices``, else
    :data:`HEURISTIC_MAX_STAGES` (``max_stages`` overrides both)."""
    exact = len(pb.hosts) <= pb.exact_devices
    return pb.max_stages or (len(pb.hosts) if exact else min(len(pb.hosts), HEURISTIC_MAX_STAGES))


def fmt_bytes(n: float) -> str:
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n:.0f} B"


def best_per(priced: Sequence[tuple[float, Plan]], n: int, key: Callable[[Plan], Hashable]) -> list[tuple[float, Plan]]:
    """The ``n`` best priced plans of each ``key`` (schedule kind, micro-batch size), best first."""
    per: dict[Hashable, int] = {}
    out = []
    for s, p in sorted(priced, key=lambda x: x[0]):
        k = key(p)
        if per.get(k, 0) < n:
            per[k] = per.get(k, 0) + 1
            out.append((s, p))
    return out
