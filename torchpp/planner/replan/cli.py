"""`torchpp replan`: correct the cost model from a run's timelines, then plan again.

The steps are the package's modules in order: read the old inputs and the run, fit corrected
costs, write the corrected files, re-price the old plan, plan again, summarise.
"""
from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

from ...formats import KIND_NAMES, LayersFile, Plan, write_json
from ..report import json_ready
from ...cost import Links, MemoryEstimator, Profiles
from ...sim.measured import price
from .fit import corrected_bandwidth, fit_hosts, fit_links, fit_memory, optimizer_rates
from .read import OldCosts, read_old_costs, read_run
from .summary import add_new_plan, build_summary, summary_text
from .write import write_corrected


def configure(p: argparse.ArgumentParser) -> None:
    from ... import argtypes as T, validate as V
    from ..cli import schedule_arg

    p.add_argument("--plan", type=T.existing_path, required=True, help="plan.json the traced run used")
    p.add_argument("--traces", type=T.existing_path, required=True, help="folder with the run's timeline_step<N>_all.json")
    p.add_argument("--steps", type=T.int_list(1), default=None, help="traced steps to use, e.g. 2,3 (default: all)")
    p.add_argument("--layers", nargs="+", type=Path, default=None,
                   help="layers_<host>.json the plan was made from (default: the model's per-block FLOPs, scaled "
                        "to the measured times)")
    p.add_argument("--capacities", type=T.existing_path, default=None, help="capacities.json the plan was made from")
    p.add_argument("--bandwidth", type=Path, default=None,
                   help="bandwidth.json the plan was made from (links the run did not use keep these rates)")
    p.add_argument("--memory-model", type=T.existing_path, default=None, help="memory_model.json (default: analytic)")
    p.add_argument("--devices", type=T.existing_path, default=None,
                   help="devices.json (default: the plan's devices with the budgets in its prediction)")
    p.add_argument("--out-dir", type=T.out_dir, required=True)
    p.add_argument("--global-batch", type=T.int_in(1, V.MAX_GLOBAL_BATCH), default=None, help="default: the plan's")
    p.add_argument("--schedule", type=schedule_arg, default="auto",
                   help=f"as `torchpp plan --schedule`: auto (default: the best over {', '.join(KIND_NAMES)}), one "
                        "kind or a comma-separated list")
    p.add_argument("--max-stages", type=T.int_in(1, V.MAX_STAGES), default=None)
    p.add_argument("--micro-batch-sizes", type=T.int_list(1, V.MAX_GLOBAL_BATCH), default=None)
    p.add_argument("--no-recompute", action="store_true")
    p.add_argument("--exact-devices", type=T.int_in(1, 8), default=5)
    p.add_argument("--max-group", type=T.int_in(1, V.MAX_STAGES), default=8)
    p.add_argument("--compare", default=None, help="e.g. even,dp,pp: price these too (corrected costs)")
    p.add_argument("--no-memory-refit", action="store_true", help="keep the memory model even if peaks were traced")
    p.add_argument("--any-size", action="store_true",
                   help="let the micro-batch size change for any predicted gain (default: only for a gain beyond "
                        "the corrected costs' error on the traced run, which they were fitted at)")
    p.add_argument("--any-gain", action="store_true",
                   help="take the best plan found for any predicted gain (default: keep the traced plan unless the "
                        "new one is predicted faster by more than the corrected costs' error on the traced run)")
    p.set_defaults(func=run)



def run(args: argparse.Namespace) -> int:
    from ...errors import UsageError
    from .. import api

    from ...trace.report import check_traces_of_plan
    from .read import find_merged

    plan_src = str(args.plan)
    plan = Plan.load(args.plan)
    check_traces_of_plan([p for _, p in find_merged(args.traces)], args.plan)
    old = read_old_costs(plan, plan_src, args.layers, args.capacities, args.devices, args.bandwidth,
                         args.memory_model)
    meas = read_run(args.traces, plan, old.profiles, plan_src, args.steps)
    print(f"read {len(meas.files)} timeline(s) from {args.traces}: steps {', '.join(map(str, meas.steps))}, "
          f"measured step time {meas.step_time_s:.4g} s (median)")
    if len(meas.steps) < 3:
        print(f"  note: {len(meas.steps)} traced step(s): a median of fewer than three is their mean, so a step the "
              f"machine stalled in counts in full; trace three or more after the first two")
    if meas.stalled:
        from .summary import stalled_line
        print("  " + stalled_line({str(n): t for n, t in meas.stalled.items()}, meas.step_time_s))
    fit = fit_hosts(plan, old, meas)
    for h, f in fit.fits.items():
        print(f"  {h}: measured/predicted {f.factor:.3f} (forward {f.forward:.3f}, backward {f.backward:.3f}) "
              f"over {f.points} timings, capacity {fit.old_capacity[h]:.3g} -> {fit.new_capacity[h]:.3g}, runtime "
              f"{1e3 * fit.profiles.call[h]:.2f} ms per call")
    links = fit_links(plan, meas, old.bandwidth)
    bw = corrected_bandwidth(old.bandwidth, links, str(args.traces))
    missing = bw.missing_links(old.all_hosts)
    if missing:
        raise UsageError(f"--bandwidth: links {', '.join(missing[:6])}{' …' if len(missing) > 6 else ''} were not "
                         f"used by the traced run and have no rate; pass the bandwidth.json the plan was made from")
    opt, opt_measured = optimizer_rates(plan, old.profiles, fit.profiles, meas, old.all_hosts)
    memory = fit_memory(plan, old.profiles, meas.peak_rss, old.memory, not args.no_memory_refit,
                        calibrated=old.memory_model is not None)
    # the model the new plan is priced with goes beside the corrected files, refitted or kept
    model = memory.model or old.memory_model
    written = write_corrected(args.out_dir, old.all_hosts, old.templates, old.default_template, fit.profiles, bw,
                              fit.ref, model, old.devices, opt)
    if written.memory_model is not None:
        memory.estimator = MemoryEstimator.fitted(model, str(written.memory_model))
    # the new plan is priced from the files just written, as `torchpp plan` would read them
    new_files = [LayersFile.load(p) for p in written.layers]
    # devices.json holds whole devices: the runtime's own RSS is reserved as `torchpp plan` does (a
    # plan's predicted budgets already are what was left)
    budget = memory.estimator.budgets(old.budget) if old.devices is not None else old.budget
    costs = api.Costs(profiles=Profiles.from_layers(new_files, None, [str(p) for p in written.layers]),
                      links=Links(bw, str(written.bandwidth)), hosts=old.hosts, budget=budget,
                      memory=memory.estimator, devices=old.devices, optimizer_s_per_byte=opt or None,
                      sources=written.sources)
    old_pred, old_pred_src = _old_prediction(plan, old, args.bandwidth)
    repriced, _ = price(plan, costs.profiles, costs.links, opt or None)
    summary = build_summary(plan, plan_src, str(args.traces), meas, old, fit, links, opt, opt_measured, memory,
                            written, old_pred, old_pred_src, repriced)
    print(f"old plan: measured {meas.step_time_s:.4g} s, predicted "
          + (f"{old_pred:.4g} s" if old_pred is not None else "(none)")
          + f", re-priced with corrected costs {repriced:.4g} s")
    meta = {"replan": {"from_plan": plan_src, "traces": str(args.traces)}}
    result = api.plan(costs, _options(args, plan), progress=print, extra_meta=meta)
    batch = args.global_batch or plan.global_batch
    if (not args.any_size and args.micro_batch_sizes is None and batch % plan.micro_batch_size == 0
            and result.plan.micro_batch_size != plan.micro_batch_size):
        result = _size_on_evidence(args, plan, costs, result, meas.step_time_s, repriced, meta)
    if not args.any_gain:
        result = _plan_on_evidence(args, costs, result, meas.step_time_s, repriced, meta)
    api.write(result, args.out_dir)
    print(api.written_text(result, args.out_dir), end="")
    add_new_plan(summary, plan, result.plan, old.all_hosts)
    summary["size_choice"] = meta["replan"].get("size_choice")
    summary["plan_choice"] = meta["replan"].get("plan_choice")
    _write_summary(args.out_dir, summary)
    return 0


def _size_on_evidence(args: argparse.Namespace, plan: Plan, costs, result, measured_s: float, repriced_s: float,
                      meta: dict):
    """The free search's plan, or the best at the run's micro-batch size where the other size's
    predicted gain is inside the corrected costs' error on the run (:mod:`.size`)."""

    from .. import api
    from ..types import InfeasibleError
    from .size import choose_size

    try:
        kept = api.plan(costs, replace(_options(args, plan), micro_batch_sizes=[plan.micro_batch_size]),
                        extra_meta=meta)
    except InfeasibleError:
        kept = None
    choice = choose_size(plan.micro_batch_size, measured_s, repriced_s, float(result.plan.predicted["step_time_s"]),
                         None if kept is None else float(kept.plan.predicted["step_time_s"]))
    meta["replan"]["size_choice"] = choice.line(result.plan.micro_batch_size)
    print(meta["replan"]["size_choice"])
    if kept is None or not choice.kept:
        return result
    kept.meta.setdefault("replan", {})["size"] = {"kept": plan.micro_batch_size, "other": result.plan.micro_batch_size,
                                                  "other_gain": choice.gain, "margin": choice.margin}
    return kept


def _plan_on_evidence(args: argparse.Namespace, costs, result, measured_s: float, repriced_s: float, meta: dict):
    """The searched plan, or the traced plan itself (predicted with the corrected costs) where the
    searched one's gain is inside the corrected costs' error on the run (:func:`.size.choose_plan`)."""
    from ...formats import Plan
    from .. import api
    from ..report import input_hashes, predict
    from .size import choose_plan

    choice = choose_plan(measured_s, repriced_s, float(result.plan.predicted["step_time_s"]))
    meta["replan"]["plan_choice"] = choice.line()
    print(choice.line())
    if not choice.kept:
        return result
    kept = Plan.load(args.plan)
    pred, tl = predict(kept, costs.profiles, costs.links, costs.memory, costs.budget, costs.optimizer_s_per_byte)
    kept.predicted, kept.inputs = pred, input_hashes(costs.sources)
    found = result.plan
    meta = {**result.meta, **api.chosen_meta(kept, result.meta["hosts"]),
            "replan": {**meta["replan"], "kept": True, "searched_best": {
                "step_time_s": found.predicted["step_time_s"], "schedule": found.schedule,
                "stages": found.num_stages, "micro_batch_size": found.micro_batch_size}}}
    return replace(result, plan=kept, timeline=tl, meta=meta, compare=[])


def _old_prediction(plan: Plan, old: OldCosts, bandwidth: Path | None) -> tuple[float | None, str]:
    """The old plan's own prediction, else (layers files and every link given) its price with the old inputs."""
    pred = (plan.predicted or {}).get("step_time_s")
    if pred is None and old.files and not old.bandwidth.missing_links(old.planned):
        return price(plan, old.profiles, Links(old.bandwidth, str(bandwidth)))[0], "priced with the input files"
    return pred, "plan.json predicted.step_time_s"


def _options(args: argparse.Namespace, plan: Plan):
    from .. import api

    return api.PlanOptions(
        global_batch=args.global_batch or plan.global_batch, schedule=args.schedule,
        max_stages=args.max_stages, micro_batch_sizes=args.micro_batch_sizes, recompute=not args.no_recompute,
        exact_devices=args.exact_devices, max_group=args.max_group, compare=api.compare_names(args.compare))


def _write_summary(out: Path, summary: dict) -> None:
    write_json(out / "replan_summary.json", json_ready(summary))  # an unmeasurable figure is null
    text = summary_text(summary)
    (out / "replan_summary.txt").write_text(text)
    print(text, end="")
    print(f"wrote {out}/replan_summary.txt, replan_summary.json and the corrected inputs")
