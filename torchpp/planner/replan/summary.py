"""What a re-plan changed, as ``replan_summary.json`` and its text form."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping, Sequence

from ...formats import Bandwidth, Plan
from ...cost import MemoryEstimator, Profiles

if TYPE_CHECKING:
    from .fit import CostFit, LinkFit, MemoryFit
    from .read import Measurements, OldCosts
    from .write import Written

LINK_CHANGE = 0.10
"""A link whose measured rate differs from the old one by more than this is reported as changed."""


def _mem_pred(plan: Plan, profiles: Profiles, memory: MemoryEstimator) -> dict[int, float]:
    """Predicted peak bytes per rank, every chunk it holds included (the planner's own report)."""
    from ...cost import device_memory

    return device_memory(plan, profiles, memory)


def _layers_of(plan: Plan, host: str) -> int:
    """Decoder layers on the host's chunks (0 when it is idle)."""
    return sum(s.num_layers for s in plan.stages if any(d.host == host for d in s.devices))


def _work_share(plan: Plan, host: str) -> float:
    """Fraction of the step's decoder-layer work (layers x samples) the host computes."""
    return sum(s.num_layers * d.samples for s in plan.stages for d in s.devices if d.host == host) / (
        plan.model.num_layers * plan.micro_batch_size)


def _fmt_rate(x: float | None) -> str:
    if x is None:
        return "–"
    return f"{x / 1e6:.3g} MB/s"


def stalled_line(stalled: Mapping[str, float], median_s: float) -> str:
    from .read import STALLED_STEP

    steps = ", ".join(f"{n} ({t:.4g} s, {100 * (t / median_s - 1):+.0f}%)" for n, t in stalled.items())
    return (f"left out of every fit: step(s) {steps}, slower than the median step by more than "
            f"{100 * STALLED_STEP:.0f}% (stalled: a first step's page faults, another process)")


def summary_text(s: dict[str, Any]) -> str:
    o = s["old_plan"]
    pred = o["predicted_step_time_s"]
    lines = [f"replan of {s['plan']} from {len(s['timelines'])} timeline(s) in {s['traces']}", "",
             f"old plan: measured step {o['measured_step_time_s']:.4g} s (median of steps "
             f"{', '.join(s['measured_steps'])}); predicted "
             + (f"{pred:.4g} s ({100 * o['prediction_error']:+.1f}%)" if pred is not None else "– (no prediction)"),
             f"old plan re-priced with the corrected costs: {o['repriced_step_time_s']:.4g} s "
             f"({100 * o['repriced_error']:+.1f}% vs measured)",
             *([stalled_line(s["stalled_steps"], o["measured_step_time_s"])] if s.get("stalled_steps") else []),
             f"new plan predicted: {s['new_plan']['predicted_step_time_s']:.4g} s; predicted gain "
             f"{100 * s['predicted_gain']:+.1f}% throughput over the old plan (both with the corrected costs)",
             *([s["size_choice"]] if s.get("size_choice") else []),
             *([s["plan_choice"]] if s.get("plan_choice") else []), "",
             f"per host (measured / predicted compute; capacity relative to {s['capacity_ref_host']}):",
             f"  {'host':<14} {'layers':<12} {'timings':>7} {'factor':>7} {'fwd':>6} {'bwd':>6} {'fit rms':>8} "
             f"{'capacity old -> new':>20}  {'ms/call':>7}  layers old -> new  work share old -> new"]
    for h, v in s["hosts"].items():
        rng = ",".join(f"[{a},{b})" for a, b in v["layers"])
        lay, work = s["layers_per_host"].get(h, {}), s["work_share"].get(h, {})
        lines.append(f"  {h:<14} {rng:<12} {v['timings']:>7} {v['factor']:>7.3f} {v['forward_factor']:>6.3f} "
                     f"{v['backward_factor']:>6.3f} {100 * v['fit_rms_rel']:>7.1f}% "
                     f"{v['old_capacity']:>9.3g} -> {v['new_capacity']:<8.3g}  {1e3 * v['call_overhead_s']:>7.2f}  "
                     f"{lay.get('old', 0):>6} -> {lay.get('new', 0):<6}  "
                     f"{100 * work.get('old', 0):>7.1f}% -> {100 * work.get('new', 0):.1f}%")
        if len(v["groups"]) > 1:
            lines.append("      per block group: " + ", ".join(
                f"blocks [{g['blocks'][0]},{g['blocks'][1]}) fwd {g['forward']:.3f} bwd {g['backward']:.3f}"
                for g in v["groups"]))
    for h, v in s["unmeasured_hosts"].items():
        lay, work = s["layers_per_host"].get(h, {}), s["work_share"].get(h, {})
        lines.append(f"  {h:<14} {'(idle)':<12} {0:>7} {'–':>7} {'–':>6} {'–':>6} {'–':>8} "
                     f"{v['capacity']:>9.3g} (kept)    {'–':>7}  {lay.get('old', 0):>6} -> {lay.get('new', 0):<6}  "
                     f"{100 * work.get('old', 0):>7.1f}% -> {100 * work.get('new', 0):.1f}%")
    lines += ["  (ms/call: the runtime's own time between two compute calls beyond waiting, added to every "
              "forward and backward)"]
    for h, v in s["hosts"].items():
        if v.get("held_from"):
            m = v["held_from"]
            lines.append(f"  {h}: ran faster than its profile (forward {m['forward']:.3f}, backward {m['backward']:.3f}) "
                         f"while busy {100 * v['busy']:.0f}% of the step: kept at its profile's speed (a host that "
                         f"waits can run its next pass faster out of what it rested, and a busier plan takes that away)")
    lines += ["", "links (measured from matched send/recv pairs, waiting for the sender excluded):"]
    if not s["links"]:
        lines.append("  none between different hosts")
    for lk in s["links"]:
        ratio = f"x{lk['ratio']:.2f}" if lk["ratio"] is not None else "new"
        lines.append(f"  {lk['link']:<24} {lk['messages']:>4} msgs  {_fmt_rate(lk['old_bytes_per_sec']):>12} -> "
                     f"{_fmt_rate(lk['new_bytes_per_sec']):>12} ({ratio}){'  changed' if lk['changed'] else ''}"
                     + (f"  [{lk['at_clock_resolution']} at clock resolution]" if lk["at_clock_resolution"] else "")
                     + (f"  [fitted {_fmt_rate(lk['capped_from'])}, above the probe's: kept at the probe's]"
                        if lk.get("capped_from") else "")
                     + ("  [kept: every message overlapped another on its row]" if lk["kept_old"] else
                        f"  [{lk['overlapped']} overlapped, left out]" if lk["overlapped"] else ""))
    if s["optimizer_s_per_gb"]:
        lines += ["", "optimizer step (s per GB of parameters): " + ", ".join(
            f"{h} {v:.3g}{'' if h in s['optimizer_measured_hosts'] else ' (scaled)'}"
            for h, v in sorted(s["optimizer_s_per_gb"].items()))]
    m = s["memory"]
    lines += ["", f"memory: {m['how']}"]
    if m["new"]:
        lines.append(f"  base {m['new']['base'] / 2**20:.1f} MiB, alpha {m['new']['alpha']:.3g}, "
                     f"Kp {m['new']['Kp']:.3g}"
                     f" (was {m['old']})")
    for r, v in m["ranks"].items():
        lines.append(f"  rank {r}: measured {v['measured_peak_bytes'] / 2**20:.1f} MiB, predicted before "
                     f"{v['old_predicted_bytes'] / 2**20:.1f} MiB, now {v['new_predicted_bytes'] / 2**20:.1f} MiB")
    def layout(stages):
        return " | ".join(f"[{st['layers'][0]},{st['layers'][1]}) "
                          + "+".join(f"{h}({n})" for h, n in zip(st["hosts"], st["samples"])) for st in stages)

    lines += ["", f"old plan: {layout(o['stages'])}", f"new plan: {layout(s['new_plan']['stages'])}"
              f"   (layers [start,end), host(samples per micro-batch))"]
    return "\n".join(lines) + "\n"


def build_summary(plan: Plan, plan_src: str, traces: str, meas: "Measurements", old: "OldCosts", fit: "CostFit",
                  links: Sequence["LinkFit"], opt: Mapping[str, float], opt_measured: Mapping[str, float],
                  memory: "MemoryFit", written: "Written", old_pred: float | None, old_pred_src: str,
                  repriced: float) -> dict[str, Any]:
    """``replan_summary.json`` up to the new plan (:func:`add_new_plan` adds it)."""
    mem_model = memory.model
    mem_old, mem_new = _mem_pred(plan, old.profiles, old.memory), _mem_pred(plan, old.profiles, memory.estimator)
    return {
        "format": "torchpp.replan_summary/1",
        "plan": plan_src, "traces": traces, "timelines": meas.files,
        "measured_steps": {str(k): v for k, v in meas.steps.items()},
        "stalled_steps": {str(k): v for k, v in meas.stalled.items()},
        "old_plan": {"measured_step_time_s": meas.step_time_s, "predicted_step_time_s": old_pred,
                     "predicted_source": old_pred_src if old_pred is not None else None,
                     "prediction_error": (old_pred - meas.step_time_s) / meas.step_time_s if old_pred else None,
                     "repriced_step_time_s": repriced,
                     "repriced_error": (repriced - meas.step_time_s) / meas.step_time_s},
        "hosts": {h: {"ranks": f.ranks, "layers": [list(r) for r in f.ranges], "timings": f.points,
                      "factor": f.factor, "forward_factor": f.forward, "backward_factor": f.backward,
                      "groups": f.groups, "fit_rms_rel": f.rms_rel, "busy": f.busy, "held_from": f.held_from,
                      "measured_s_per_microbatch": f.measured_s, "predicted_s_per_microbatch": f.predicted_s,
                      "old_capacity": fit.old_capacity[h], "new_capacity": fit.new_capacity[h],
                      "old_table": old.origin[h], "old_call_overhead_s": old.profiles.call.get(h, 0.0),
                      "call_overhead_s": fit.profiles.call[h],
                      "trace_host": sorted({meas.trace_hosts[r] for r in f.ranks if r in meas.trace_hosts})}
                  for h, f in fit.fits.items()},
        "unmeasured_hosts": {h: {"capacity": fit.old_capacity[h], "table": old.origin[h]}
                             for h in old.all_hosts if h not in fit.fits},
        "capacity_ref_host": fit.ref,
        "links": [{"link": Bandwidth.key(lk.src, lk.dst), "messages": lk.messages,
                   "old_bytes_per_sec": lk.old_bytes_per_sec, "new_bytes_per_sec": lk.bytes_per_sec,
                   "old_latency_s": lk.old_latency_s, "new_latency_s": lk.latency_s, "ratio": lk.change,
                   "at_clock_resolution": lk.at_clock_resolution, "overlapped": lk.censored,
                   "kept_old": lk.censored == lk.messages, "capped_from": lk.capped_from,
                   "changed": lk.change is None or abs(lk.change - 1) > LINK_CHANGE} for lk in links],
        "optimizer_s_per_gb": {h: v * 1e9 for h, v in opt.items()},
        "optimizer_measured_hosts": sorted(opt_measured),
        "memory": {"how": memory.how, "old": old.memory.source,
                   "new": ({"base": mem_model.base, "alpha": mem_model.alpha, "Kp": mem_model.Kp, "r2": mem_model.r2}
                           if mem_model else None),
                   "ranks": {str(r): {"measured_peak_bytes": v,
                                      "old_predicted_bytes": mem_old[r], "new_predicted_bytes": mem_new[r]}
                             for r, v in sorted(meas.peak_rss.items())}},
        "written": [str(p) for p in written.files],
    }


def add_new_plan(summary: dict[str, Any], plan: Plan, new_plan: Plan, hosts: Sequence[str]) -> None:
    """The new plan, both plans' layouts, the predicted gain and per-host layers and work shares."""
    new_step = float(new_plan.predicted["step_time_s"])
    summary["new_plan"] = {"predicted_step_time_s": new_step, "stages": [
        {"layers": list(s.layers), "hosts": [d.host for d in s.devices], "samples": [d.samples for d in s.devices],
         "recompute": sum(s.recompute)} for s in new_plan.stages],
        "num_microbatches": new_plan.num_microbatches, "micro_batch_size": new_plan.micro_batch_size}
    summary["old_plan"]["stages"] = [{"layers": list(s.layers), "hosts": [d.host for d in s.devices],
                                      "samples": [d.samples for d in s.devices]} for s in plan.stages]
    summary["predicted_gain"] = summary["old_plan"]["repriced_step_time_s"] / new_step - 1.0
    summary["layers_per_host"] = {h: {"old": _layers_of(plan, h), "new": _layers_of(new_plan, h)} for h in hosts}
    summary["work_share"] = {h: {"old": _work_share(plan, h), "new": _work_share(new_plan, h)} for h in hosts}
