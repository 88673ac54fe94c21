"""The planning API: inputs and options as dataclasses -> a plan, its prediction and its files.

`torchpp plan` (planner/cli.py), `torchpp replan` and the demo all plan through here, so they
search, price, compare and write the same way; none of them builds another's arguments.

    costs = load(PlanInputs(layers=[...], bandwidth=bw, devices=dv, capacities=cap))
    result = plan(costs, PlanOptions(global_batch=32, compare=["even", "dp"]))
    write(result, Path("out"))        # plan.json, stages.csv, steps.csv, plan_meta.json, summary.txt, gantt.png

Library code: it raises (``UsageError``/``FormatError``/``InfeasibleError``) and reports
progress through a callback, never prints.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

from ..errors import UsageError
from ..formats import (KIND_NAMES, ONE_CHUNK, OPTIMIZERS, Bandwidth, Capacities, Devices, FormatError, LayersFile,
                       MemoryModel, Plan, parse_kinds)

if TYPE_CHECKING:
    from ..cost import Profiles

Progress = Callable[[str], None] | None
OUTPUTS = ("plan.json", "stages.csv", "steps.csv", "plan_meta.json", "summary.txt", "gantt.png")
SCHEDULES = ("auto", *KIND_NAMES)
META_CANDIDATES = 5
"""plan_meta.json lists this many of the best priced plans of each schedule kind (``search.priced``
counts them all): enough to see the runners-up, small enough to keep the file small."""
STRATEGIES = ("even", "dp", "pp")
"""Fixed strategies `plan --strategy` writes (the comparison also prices ``single``)."""


# ----------------------------------------------------------------------------- inputs
@dataclass(kw_only=True)
class Estimate:
    """No measurements: block costs from a model's config, device speeds and links from a spec."""
    model: str
    """Preset name or local HF checkpoint directory."""
    device_spec: Path
    """``{"devices": {host: {flops, memory_gb}}, "link_gbps", "latency_ms", "links"}`` (planner/estimate.py)."""
    dtype: str = "float32"


@dataclass(kw_only=True)
class PlanInputs:
    """The files a plan is made from: measured layers files, or an :class:`Estimate`."""
    layers: list[Path] = field(default_factory=list)
    """layers_<host>.json, one per measured host."""
    estimate: Estimate | None = None
    capacities: Path | None = None
    """capacities.json: prices hosts without a layers file."""
    bandwidth: Path | None = None
    """bandwidth.json (measured mode; the estimate's links come from its spec)."""
    devices: Path | None = None
    """devices.json: the devices to plan for and their memory (estimate mode: a subset of the spec's)."""
    memory_model: Path | None = None
    """memory_model.json from calibrate-memory; None: the analytic model."""
    activation_factor: float | None = None
    """Analytic memory: bytes kept per byte of block output (None: the model's default)."""
    tied_embed: bool | None = None
    """Override the model's tied embeddings."""
    seq_len: int | None = None
    """Estimate: tokens per sample (default 128); measured: must equal the layers files'."""
    optimizer_s_per_gb: float | None = None
    """Optimizer step seconds per GB of parameters on every host; None: each host's rate measured
    by ``torchpp profile`` (its layers file, capacities.json, or the reference's over capacity)."""
    dtype: str | None = None
    """Measured: the precision to plan for; it must be the layers files' (they price it). None: theirs."""

    def __post_init__(self) -> None:
        if (self.estimate is None) == (not self.layers):
            raise ValueError("PlanInputs: give layers files or an estimate, not both or neither")
        if self.estimate is None and (self.bandwidth is None or self.devices is None):
            raise ValueError(f"PlanInputs: measured layers need bandwidth and devices files, got "
                             f"bandwidth={self.bandwidth}, devices={self.devices}")


@dataclass(kw_only=True)
class Costs:
    """Loaded inputs, what the search prices with (``replan`` builds one from corrected costs)."""
    profiles: Any
    """cost.Profiles: per-host block times."""
    links: Any
    """cost.Links: per-link rate and latency."""
    hosts: list[str]
    budget: dict[str, float]
    """Memory per host in bytes that the plan may use."""
    memory: Any
    """cost.MemoryEstimator (None only while :func:`load` reads the files)."""
    devices: Devices | None = None
    """devices.json: its ranks are kept when every planned host has one."""
    optimizer_s_per_byte: float | dict[str, float] | None = None
    optimizer_source: str = ""
    """Where the optimizer rate came from, for the plan's output ("" : given by the caller)."""
    sources: dict[str, Path | list[Path]] = field(default_factory=dict)
    """Input files, hashed into plan.json's ``inputs``."""


# ----------------------------------------------------------------------------- options
@dataclass(kw_only=True)
class PlanOptions:
    """How to search: the batch, the schedule and the limits of the plan space."""
    global_batch: int = 8
    schedule: str = "auto"
    """``auto`` (the best over every kind, chunked placements included), one kind, or a comma-separated list."""
    max_stages: int | None = None
    micro_batch_sizes: list[int] | None = None
    """Only these micro-batch sizes (None: every divisor of the global batch)."""
    recompute: bool = True
    """Allow recomputing activations."""
    exact_devices: int = 5
    """Search every device order up to this many devices."""
    max_group: int = 8
    """Largest group beyond ``exact_devices``."""
    compare: list[str] = field(default_factory=list)
    """Also price these on the same devices and costs: ``even``, ``dp``, ``pp``, ``single`` (each at
    its own best micro-batching) or plan.json files."""
    certify: bool = False
    """Prove how far the chosen plan can be from the optimum of the space searched (planner/certify.py;
    at most 8 devices): the line "within X% of optimal in this space" and plan_meta's ``certificate``."""
    allow_lossy: frozenset[str] = frozenset()
    """Lossy choices the planner may make (``bf16``, ``fp16``, ``int8``, ``powersgd``, ``diloco``;
    planner/wire.py); empty: fp32 everywhere, every plan as without the option."""
    tied_rows: int = 0
    """Distinct token ids a step is expected to touch, for pricing the exact ``rows`` tied-weight sync
    the wire pass also offers (0: every token of the step, at most the vocabulary)."""
    optimizer: str = "adamw"
    """The optimizer the plan will be trained with (``torchpp.train --optimizer``; adamw, its default, or
    sgd): with ``allow_lossy`` the PowerSGD rank offered depends on it (``wire.powersgd_rank``), and the
    plan records it (``Plan.optimizer``)."""

    def __post_init__(self) -> None:
        try:
            parse_kinds(self.schedule)
        except ValueError as e:
            raise ValueError(f"PlanOptions.{e}") from None
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"PlanOptions.optimizer: expected one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}")


@dataclass(kw_only=True)
class Strategy:
    """A fixed split, no search: ``even`` (S stages of equal layer counts, optionally groups),
    ``dp`` (one stage over N devices) or ``pp`` (one device per stage)."""
    name: str = "even"
    model: str = "qwen3-tiny"
    num_layers: int | None = None
    """Keep only the first N decoder layers."""
    stages: int = 2
    group_sizes: list[int] | None = None
    devices: int | None = None
    """dp: the device count."""
    hosts: list[str] | None = None
    """Host names, one per device in rank order."""
    microbatches: int = 4
    seq_len: int = 128
    recompute: bool = False
    dtype: str = "float32"
    """Precision: float32, or bfloat16 (mixed: fp32 master weights, bf16 autocast)."""

    def __post_init__(self) -> None:
        if self.name not in STRATEGIES:
            raise ValueError(f"Strategy.name: expected one of {', '.join(STRATEGIES)}, got {self.name!r}")


# ----------------------------------------------------------------------------- result
@dataclass(kw_only=True)
class PlanResult:
    plan: Plan
    """The chosen plan with ``predicted`` and ``inputs`` filled in."""
    problem: Any
    """planner.types.Problem it was searched on."""
    timeline: Any
    """sim.replay.Timeline of its predicted step."""
    meta: dict[str, Any]
    """plan_meta.json: the search, the choice, the prediction, the comparison."""
    compare: list[dict[str, Any]]
    """One row per compared plan (the chosen one first); empty without ``compare``."""


# ----------------------------------------------------------------------------- loading
def load(inputs: PlanInputs) -> Costs:
    """Read and check the input files; every device must be priceable."""
    from ..cost import ANALYTIC_KP, MemoryEstimator

    if inputs.estimate is not None:
        costs = _load_estimate(inputs, inputs.estimate)
    else:
        costs = _load_measured(inputs)
    if inputs.tied_embed is not None:
        costs.profiles.model.tied_embeddings = inputs.tied_embed
    if inputs.memory_model:
        memory = MemoryEstimator.fitted(MemoryModel.load(inputs.memory_model), str(inputs.memory_model))
        costs.sources["memory_model"] = inputs.memory_model
    else:
        memory = MemoryEstimator.analytic(inputs.activation_factor or ANALYTIC_KP)
    costs.memory = memory
    costs.budget = memory.budgets(costs.budget)
    if inputs.optimizer_s_per_gb is not None:
        costs.optimizer_s_per_byte = inputs.optimizer_s_per_gb / 1e9
        costs.optimizer_source = f"given: {inputs.optimizer_s_per_gb:g} s/GB on every host (--optimizer-s-per-gb)"
    elif not costs.optimizer_source:
        costs.optimizer_source = "none: not measured (profile the hosts again, or pass --optimizer-s-per-gb)"
    return costs


def _load_estimate(inputs: PlanInputs, est: Estimate) -> Costs:
    """Costs without a memory model yet (:func:`load` adds it, after every file is read)."""
    from ..cost import Links
    from .estimate import estimate_profiles

    prof, bw, budget = estimate_profiles(est.model, str(est.device_spec), inputs.seq_len or 128, est.dtype)
    hosts, devices = list(budget), None
    if inputs.devices:
        devices = Devices.load(inputs.devices)
        unknown = [h for h in devices.hosts if h not in budget]
        if unknown:
            raise FormatError(str(inputs.devices), unknown[0], f"a device of {est.device_spec}")
        hosts = devices.hosts
        budget = {h: devices.memory_bytes(h) for h in hosts}
    return Costs(profiles=prof, links=Links(bw, str(est.device_spec)), hosts=hosts, budget=budget, memory=None,
                 devices=devices, sources={"device_spec": est.device_spec})


def _load_measured(inputs: PlanInputs) -> Costs:
    """Costs without a memory model yet (:func:`load` adds it, after every file is read)."""
    from ..cost import Links, Profiles

    paths = [Path(x) for x in inputs.layers]
    files = [LayersFile.load(x) for x in paths]
    cap = Capacities.load(inputs.capacities) if inputs.capacities else None
    prof = Profiles.from_layers(files, cap, [str(x) for x in paths], str(inputs.capacities or "capacities.json"))
    if inputs.dtype and inputs.dtype != prof.model.precision:
        raise UsageError(f"--dtype {inputs.dtype}: the layers files were measured at {prof.model.precision}; "
                         f"re-profile with torchpp profile --dtype {inputs.dtype} to plan for it")
    if inputs.seq_len and inputs.seq_len != prof.seq_len:
        raise UsageError(f"--seq-len: the layers files were measured at {prof.seq_len}; re-profile to plan "
                         f"for {inputs.seq_len}")
    dv = Devices.load(inputs.devices)
    for h in dv.hosts:  # every device must be priceable: its own layers file or a capacity
        if h not in prof.fwd and (cap is None or h not in cap.capacity):
            raise FormatError(str(inputs.devices), h, "a host with a layers file or an entry in capacities.json "
                              f"(measured: {', '.join(sorted(prof.fwd))})")
    bw = Bandwidth.load(inputs.bandwidth)
    opt, opt_source = measured_optimizer(prof, dv.hosts)
    return Costs(profiles=prof, links=Links(bw, str(inputs.bandwidth)), hosts=dv.hosts,
                 budget={h: min(dv.memory_bytes(h), prof.memory_limit.get(h, math.inf)) for h in dv.hosts},
                 memory=None, devices=dv, optimizer_s_per_byte=opt, optimizer_source=opt_source,
                 sources=dict(layers=paths, capacities=inputs.capacities, bandwidth=inputs.bandwidth,
                              devices=Path(inputs.devices)))


def measured_optimizer(prof: Profiles, hosts: Sequence[str]) -> tuple[dict[str, float] | None, str]:
    """Each host's optimizer seconds per parameter byte as ``torchpp profile`` measured it
    (``Profiles.optimizer_rate``), and a line saying where each came from. Hosts with none are
    priced at 0; (None, "") when none has one."""
    rates = {h: prof.optimizer_rate(h) for h in hosts}
    if not any(v for v, _ in rates.values()):
        return None, ""
    parts = [f"{h} {v * 1e9:.3g} s/GB ({src})" if v else f"{h} 0 (not measured)" for h, (v, src) in rates.items()]
    return {h: v for h, (v, _) in rates.items() if v}, "measured per host by profile: " + ", ".join(parts)


# ----------------------------------------------------------------------------- planning
def plan(inputs: PlanInputs | Costs, options: PlanOptions, *, progress: Progress = None,
         extra_meta: dict[str, Any] | None = None) -> PlanResult:
    """Search the plan space, price the best plan (and the comparisons) and describe the search."""
    from .report import input_hashes, predict
    from .search import search
    from .types import Problem

    costs = load(inputs) if isinstance(inputs, PlanInputs) else inputs
    prof, hosts, opt = costs.profiles, costs.hosts, costs.optimizer_s_per_byte
    pb = Problem(profiles=prof, links=costs.links, hosts=hosts, budget=costs.budget, memory=costs.memory,
                 global_batch=options.global_batch, schedule=options.schedule, max_stages=options.max_stages,
                 micro_batch_sizes=options.micro_batch_sizes, allow_recompute=options.recompute,
                 exact_devices=options.exact_devices, max_group=options.max_group, optimizer_s_per_byte=opt)
    if options.certify and len(hosts) > 8:
        raise UsageError(f"--certify: at most 8 devices (planner/certify.py), got {len(hosts)}")
    say = progress or (lambda _: None)
    say(f"planning {prof.model.name} ({prof.model.num_layers} layers) on {len(hosts)} device(s), "
        f"global batch {options.global_batch}; memory: {costs.memory.source}")
    opt_source = optimizer_origin(costs)
    say(f"optimizer step: {opt_source}")
    res = search(pb, progress=progress)
    chosen = res.plan
    if options.certify:
        from .certify import certify

        cert = certify(pb, res.step_time_s)
        say(cert.line())
        extra_meta = {**(extra_meta or {}), "certificate": cert.as_dict()}
    replayed = (res.step_time_s, res.timeline) if res.timeline is not None else None
    if options.certify and cert.plan is not None:  # the enumeration found a faster plan of the same space
        from .search import validated

        chosen, replayed = validated(cert.plan), None
    ranks = [d.rank for s in chosen.stages for d in s.devices]
    if costs.devices is not None and apply_fixed_ranks(chosen, costs.devices) and \
            ranks != [d.rank for s in chosen.stages for d in s.devices]:
        replayed = None  # renumbered: the search's replay names the old ranks
    fp32_step = None
    if options.allow_lossy:
        chosen, fp32_step, wire_record = _choose_wire(chosen, costs, pb, options, say)
        chosen.optimizer = options.optimizer
        extra_meta = {**(extra_meta or {}), "wire": wire_record}
        replayed = None  # the search priced fp32 links: the plan the wire pass chose is priced anew
    pred, tl = predict(chosen, prof, costs.links, costs.memory, costs.budget, opt, replayed=replayed)
    pred.optimizer = opt_source
    if options.allow_lossy:
        pred["wire"] = {"allowed": sorted(options.allow_lossy), "lossy": chosen.lossy,
                        "fp32_step_time_s": fp32_step}
    chosen.predicted = pred
    chosen.inputs = input_hashes(costs.sources)
    compare = compare_plans(options.compare, chosen, pb, costs.budget, say) if options.compare else []
    meta = _meta(res, chosen, pb, options, compare, extra_meta)
    return PlanResult(plan=chosen, problem=pb, timeline=tl, meta=meta, compare=compare)


def _choose_wire(chosen: Plan, costs: Costs, pb: Any, options: PlanOptions,
                 say: Callable[[str], None]) -> tuple[Plan, float, dict[str, Any]]:
    """The lossy choices (planner/wire.py) over candidate splits: the searched (fp32) plan, the plan the
    search finds with every pipeline link priced as each allowed format (a split that only pays once
    its links are compressed), and the pipeline and data-parallel plans at their fastest micro-batchings.
    The wire pass refines each candidate per link; the fastest that fits memory and beats the
    searched fp32 plan by the pass's margins wins. Returns it, the searched plan's fp32 step time,
    and the record plan_meta.json keeps (each candidate, what it was searched under, why the winner won)."""
    from .wire import DILOCO_GAIN, MIN_GAIN, changes_optimisation, choose, powersgd_note

    allow = options.allow_lossy
    cands: list[tuple[str, str, Plan]] = [("fp32", "searched", chosen)]
    searched, skipped = _searched_as_formats(pb, costs, allow, say)
    cands += searched
    for name in ("pp", "dp"):
        cands += [("fp32", name, p) for p in _fixed_for_wire(name, chosen, pb, costs, options)]
    price_of = lambda p: predict_plan(p, costs)["step_time_s"]  # noqa: E731
    fp32 = price_of(chosen)
    rows, best, notes = [], None, []
    for i, (under, split, p) in enumerate(cands):
        c = choose(p, price_of, allow, tied_rows=options.tied_rows, optimizer=options.optimizer)
        notes += [n for n in c.notes if n not in notes]
        margin = DILOCO_GAIN if changes_optimisation(c.plan.lossy) else MIN_GAIN
        fits = price(copy.deepcopy(c.plan), pb, costs.budget).fits
        # a lossy plan must beat the searched fp32 plan by the pass's own margins (planner/wire.py)
        pays = bool(c.decisions) and fits and c.step_s < fp32 * (1 - margin)
        rows.append({"searched_under": under, "split": split, "stages": p.num_stages,
                     "micro_batch_size": p.micro_batch_size, "schedule": p.schedule,
                     "fp32_step_time_s": c.fp32_step_s, "step_time_s": c.step_s, "lossy": c.plan.lossy,
                     "exact": ["tied_sync=rows"] if c.plan.tied_sync is not None and c.plan.tied_sync.kind == "rows"
                     else [],
                     "fits": fits, "pays": pays})
        if pays and (best is None or c.step_s < best[1].step_s):
            best = (i, c)
    i, got = best if best else (0, None)
    for j, r in enumerate(rows):
        r["chosen"] = j == i and got is not None
    label = (f"the split searched with links priced as {rows[i]['searched_under']}" if rows[i]["split"] == "searched"
             else f"the {rows[i]['split']} split")
    need = 1 - (DILOCO_GAIN if got and changes_optimisation(got.plan.lossy) else MIN_GAIN)
    why = (f"{label}: {got.step_s:.4g} s, the fastest candidate that fits memory and is under {need:.2f} x the "
           f"searched fp32 plan's {fp32:.4g} s" if got else
           "fp32 everywhere: no candidate's lossy choices shorten the searched fp32 plan's predicted step enough")
    say(f"wire formats (--allow-lossy {','.join(sorted(allow))}): "
        + ("; ".join(got.decisions) if got else "fp32 everywhere (no lossy choice shortens the predicted step enough)")
        + f"; predicted step {fp32:.4g} s (searched, fp32) -> {got.step_s if got else fp32:.4g} s"
        + (f" on {label}" if got and i else ""))
    if "powersgd" in allow:
        notes.insert(0, powersgd_note(options.optimizer, chosen.model.hidden_size))
    for n in notes:
        say(f"wire formats: note: {n}")
    record = {"allowed": sorted(allow), "optimizer": options.optimizer, "fp32_step_time_s": fp32, "candidates": rows,
              "not_searched": skipped, "why": why, **({"notes": notes} if notes else {})}
    return (got.plan if got else chosen), fp32, record


WIRE_SIZES = 4
"""Micro-batchings of the pp and dp splits the wire pass refines (the fastest in fp32 that fit)."""


def _fixed_for_wire(name: str, chosen: Plan, pb: Any, costs: Costs, options: PlanOptions) -> list[Plan]:
    """The ``name`` split at its :data:`WIRE_SIZES` fastest fitting micro-batchings, not only its
    fp32 best: compressing the links or syncing the tied weight by its rows changes which size is
    best (on seed 003's cluster at 100 Mbit/s the int8 + rows pipeline was fastest at 3 x 2, the fp32
    pipeline at 6 x 1; refining only the latter missed a plan priced 9% faster than the one chosen)."""
    got = priced_fixed(name, chosen.model, pb, costs.budget, seq_len=chosen.seq_len, global_batch=options.global_batch)
    out = [c.plan for c in got if c.fits][:WIRE_SIZES]
    if costs.devices is not None:
        for p in out:
            apply_fixed_ranks(p, costs.devices)
    return out


def _searched_as_formats(pb: Any, costs: Costs, allow: frozenset[str], say: Callable[[str], None]
                         ) -> tuple[list[tuple[str, str, Plan]], dict[str, str]]:
    """The search's best plan with every pipeline link priced as each allowed link format
    (``cost.FormatLinks``: the one cost model's price of a link in that format, bytes and codec CPU),
    returned without wire fields: the wire pass sets them, per link, on each. A format that costs at
    least as much as another allowed one per byte on every link is not searched (every plan is at
    least as fast with the other's links, and the wire pass tries every format on each link); the
    second value says which and why."""
    import dataclasses
    import time

    from ..cost import FormatLinks
    from .search import search
    from .wire import LINK_FORMATS

    fmts = [f for f in LINK_FORMATS if f in allow]
    links = {f: FormatLinks(pb.links, f, pb.profiles.model.hidden_size,
                            lambda a, b, f=f: pb.profiles.link_codec(a, b, f)) for f in fmts}
    pairs = [(a, b) for a in pb.hosts for b in pb.hosts if a != b and pb.links.bw.has(a, b)]
    if not pairs:  # one host: no plan has a link to compress
        return [], {}
    per_byte = {f: [x.time(a, b, 1.0) - x.time(a, b, 0.0) for a, b in pairs] for f, x in links.items()}
    skipped = {}
    for i, f in enumerate(fmts):
        by = next((g for j, g in enumerate(fmts) if g != f and all(x <= y for x, y in zip(per_byte[g], per_byte[f]))
                   and (j < i or per_byte[g] != per_byte[f])), None)
        if by is not None:
            skipped[f] = f"not searched: {by} costs no more per byte on every link"
    out = []
    for fmt in (f for f in fmts if f not in skipped):
        t0 = time.process_time()
        res = search(dataclasses.replace(pb, links=links[fmt]))
        if res.plan is None:
            continue
        if costs.devices is not None:
            apply_fixed_ranks(res.plan, costs.devices)
        say(f"  searched with every link priced as {fmt}: {res.plan.num_stages} stage(s), {res.plan.schedule}, "
            f"{res.plan.num_microbatches} x {res.plan.micro_batch_size}, {res.step_time_s:.4g} s as {fmt} "
            f"({time.process_time() - t0:.2f} s CPU)")
        out.append((fmt, "searched", res.plan))
    for f, why in skipped.items():
        say(f"  {f}: {why}")
    return out, skipped


def optimizer_origin(costs: Costs) -> str:
    """Where ``costs``' optimizer rate came from (``Costs.optimizer_source``, else the rates given)."""
    if costs.optimizer_source:
        return costs.optimizer_source
    opt = costs.optimizer_s_per_byte
    if isinstance(opt, dict) and opt:
        return "per host: " + ", ".join(f"{h} {v * 1e9:.3g} s/GB" for h, v in opt.items())
    if opt:
        return f"given: {opt * 1e9:g} s/GB on every host"
    return "none (priced at 0)"


def _meta(res: Any, chosen: Plan, pb: Any, options: PlanOptions, compare: list[dict],
          extra: dict[str, Any] | None) -> dict[str, Any]:
    """plan_meta.json: what was searched, what was chosen and what it is predicted to do."""
    hosts = pb.hosts
    return {
        "format": "torchpp.plan_meta/1",
        "model": pb.profiles.model.name, "hosts": hosts, "global_batch": options.global_batch,
        "schedule": options.schedule, "host_tables": dict(pb.profiles.origin),
        "search": {"mode": res.mode, "dp_candidates": res.dp_candidates, "priced": res.candidates_priced,
                   "planning_time_s": res.planning_time_s, "refined": res.refined, "max_stages": options.max_stages,
                   "best_per_schedule": res.kinds,
                   "micro_batch_sizes": options.micro_batch_sizes, "recompute": options.recompute,
                   "candidates": [{"step_time_s": s, "schedule": p.schedule, "stages": p.num_stages,
                                   "micro_batch_size": p.micro_batch_size, "devices": p.world_size}
                                  for s, p in best_per_kind(res.priced, META_CANDIDATES)]},
        **chosen_meta(chosen, hosts), "compare": compare, **(extra or {}),
    }


def chosen_meta(chosen: Plan, hosts: Sequence[str]) -> dict[str, Any]:
    """plan_meta.json's part about the plan written: its shape, its prediction, its inputs."""
    return {
        "chosen_schedule": chosen.schedule,
        "chosen": {"stages": chosen.num_stages, "micro_batch_size": chosen.micro_batch_size,
                   "num_microbatches": chosen.num_microbatches, "devices": chosen.world_size,
                   "idle": [h for h in hosts if h not in {d.host for s in chosen.stages for d in s.devices}]},
        "predicted": {k: chosen.predicted[k] for k in ("step_time_s", "throughput_samples_per_s", "lower_bound_s",
                                                       "ratio_to_lower_bound", "gap_to_bound", "bubble",
                                                       "optimizer") if k in chosen.predicted},
        "inputs": chosen.inputs,
    }


def best_per_kind(priced: Sequence[tuple[float, Plan]], n: int) -> list[tuple[float, Plan]]:
    """The ``n`` best priced plans of each schedule kind, best first."""
    from .types import best_per

    return best_per(priced, n, lambda p: p.schedule)


def write(result: PlanResult, out_dir: Path) -> list[Path]:
    """Write :data:`OUTPUTS` into ``out_dir``; returns their paths."""
    from .report import write_outputs

    write_outputs(out_dir, result.plan, result.timeline, result.meta, result.compare)
    return [out_dir / name for name in OUTPUTS]


def written_text(result: PlanResult, out_dir: Path) -> str:
    """What `plan` and `replan` show after :func:`write`: the summary (the text of summary.txt,
    made from the result, not read back from disk) and the files written."""
    from .report import summary_text

    return summary_text(result.plan, result.meta, result.compare) + f"wrote {out_dir}/{', '.join(OUTPUTS)}\n"


def compare_names(text: str | None) -> list[str]:
    """``"even,dp,other_plan.json"`` (the ``--compare`` flag) -> :attr:`PlanOptions.compare`."""
    return [x.strip() for x in (text or "").split(",") if x.strip()]


def predict_plan(p: Plan, costs: Costs) -> dict[str, Any]:
    """The planner's prediction (step time, bubble, per-device memory) of a given plan."""
    from .report import predict

    return predict(p, costs.profiles, costs.links, costs.memory, costs.budget, costs.optimizer_s_per_byte)[0]


def fixed_plan(strategy: Strategy, options: PlanOptions) -> Plan:
    """A fixed-strategy plan whose action lists are proven consistent (no search, no costs)."""
    from ..models.presets import ModelSpecError, is_preset, load_config, model_info, precision_fields, preset_info
    from ..schedules import build
    from .simple import dp_plan, even_plan, pp_plan

    try:
        if is_preset(strategy.model):  # read off the preset's table: no model built, neither torch nor transformers
            info = preset_info(strategy.model, strategy.num_layers, **precision_fields(strategy.dtype))
        else:
            info = model_info(load_config(strategy.model, strategy.num_layers), strategy.model,
                              **precision_fields(strategy.dtype))
    except ModelSpecError as e:
        raise UsageError(str(e)) from None
    kw = dict(seq_len=strategy.seq_len, global_batch=options.global_batch, num_microbatches=strategy.microbatches,
              schedule="1f1b" if options.schedule == "auto" else options.schedule, recompute=strategy.recompute,
              hosts=strategy.hosts)
    if strategy.name == "dp":
        if not strategy.devices or strategy.devices < 1:
            raise UsageError("--devices: expected a positive device count with --strategy dp")
        out = dp_plan(info, devices=strategy.devices, **kw)
    elif strategy.name == "pp":
        out = pp_plan(info, stages=strategy.stages, **kw)
    else:
        out = even_plan(info, stages=strategy.stages, group_sizes=strategy.group_sizes, **kw)
    build(out)  # proves the schedule is consistent before anyone runs it
    return out


def apply_fixed_ranks(p: Plan, devices: Devices) -> bool:
    """Use devices.json's ranks when every planned host has one and they number 0..W−1."""
    want = {d.host: devices.devices[d.host].rank for s in p.stages for d in s.devices}
    if any(r is None for r in want.values()) or sorted(want.values()) != list(range(p.world_size)):
        return False
    for s in p.stages:
        for d in s.devices:
            d.rank = want[d.host]
    return True


# ----------------------------------------------------------------------------- comparisons
@dataclass(kw_only=True)
class Priced:
    """A plan with the planner's prediction and whether every device's stage fits its memory."""
    plan: Plan
    predicted: dict[str, Any]
    fits: bool

    @property
    def step_time_s(self) -> float:
        return float(self.predicted["step_time_s"])


def price(p: Plan, pb: Any, budget: dict[str, float]) -> Priced:
    """Price one plan on the search problem's costs and check it against the memory budgets."""
    from .report import predict

    pred, _ = predict(p, pb.profiles, pb.links, pb.memory, budget, pb.optimizer_s_per_byte)
    devs = [d for s in pred["stages"] for d in s["devices"]]
    fits = not any(d["budget_bytes"] is not None and d["memory_bytes"] > d["budget_bytes"] for d in devs)
    p.predicted = pred
    return Priced(plan=p, predicted=pred, fits=fits)


def priced_fixed(name: str, model: Any, pb: Any, budget: dict[str, float], *, seq_len: int, global_batch: int,
                 schedule: str = "1f1b", sizes: list[int] | None = None) -> list[Priced]:
    """Every micro-batching (and device, for ``single``) of a fixed strategy, priced, fastest first."""
    from .simple import fixed_candidates

    return sorted((price(p, pb, budget) for p in fixed_candidates(name, model, pb.hosts, seq_len=seq_len,
                                                                 global_batch=global_batch, schedule=schedule,
                                                                 sizes=sizes)), key=lambda c: c.step_time_s)


def best_fixed(name: str, model: Any, pb: Any, budget: dict[str, float], *, seq_len: int, global_batch: int,
               schedule: str = "1f1b", sizes: list[int] | None = None) -> Priced | None:
    """A fixed strategy (``even``, ``pp``, ``dp``, ``single``) at its own best: the fastest of its
    micro-batchings (and devices, for ``single``) that fits memory; when none fits, the one that
    overruns its budget least, with ``fits`` False. None when the batch allows no candidate."""
    cands = priced_fixed(name, model, pb, budget, seq_len=seq_len, global_batch=global_batch, schedule=schedule,
                         sizes=sizes)
    if not cands:
        return None
    fitting = [c for c in cands if c.fits]
    if fitting:
        return fitting[0]
    return min(cands, key=lambda c: max(_overrun(d) for s in c.predicted["stages"] for d in s["devices"]))


def _overrun(d: dict) -> float:
    return d["memory_bytes"] / d["budget_bytes"] if d["budget_bytes"] else 0.0


def compare_plans(names: Sequence[str], chosen: Plan, pb: Any, budget: dict[str, float],
                  progress: Progress = None) -> list[dict]:
    """Price fixed strategies, each at its own best micro-batching, and plan files, on the same
    devices and costs as the chosen plan."""
    from .simple import FIXED

    rows = [_row("chosen (optimal)", Priced(plan=chosen, predicted=chosen.predicted, fits=True), chosen)]
    for name in names:
        if name in FIXED:
            one_chunk = chosen.schedule if chosen.schedule in ONE_CHUNK else "1f1b"
            got = best_fixed(name, chosen.model, pb, budget, seq_len=chosen.seq_len, global_batch=chosen.global_batch,
                             schedule=one_chunk, sizes=pb.micro_batch_sizes)
            if got is None:
                if progress:
                    progress(f"  compare {name}: global batch {chosen.global_batch} too small for {len(pb.hosts)} "
                             "devices")
                continue
        else:
            try:
                got = price(Plan.load(name), pb, budget)
            except ValueError as e:
                raise UsageError(f"--compare {name}: {e}") from None
        rows.append(_row(name, got, chosen))
    return rows


def _row(name: str, got: Priced, chosen: Plan) -> dict[str, Any]:
    """One line of the comparison: step time, ratio to the chosen plan, worst memory, micro-batching."""
    from .types import fmt_bytes

    devs = [d for s in got.predicted["stages"] for d in s["devices"]]
    worst = max(((d["memory_bytes"], d["budget_bytes"] or 0, d["host"]) for d in devs),
                key=lambda x: x[0] / max(x[1], 1))
    p = got.plan
    return {"name": name, "step_time_s": got.step_time_s, "ratio": got.step_time_s / chosen.predicted["step_time_s"],
            "memory": f"{fmt_bytes(worst[0])}/{fmt_bytes(worst[1])} ({worst[2]})", "oom": not got.fits,
            "num_microbatches": p.num_microbatches, "micro_batch_size": p.micro_batch_size,
            "hosts": [d.host for s in p.stages for d in s.devices]}
