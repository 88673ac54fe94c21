"""`torchpp analyze`: where a step's time went, measured against predicted.

Reads the runtime's merged timelines (``timeline_step<N>_all.json``) and, optionally, the
simulator's predicted trace and the plan; writes ``report.md``, ``report.json`` (with
``step_time_error`` = (predicted − measured) / measured), ``gantt.png`` (measured over
predicted) and ``stages.png`` (per-stage forward/backward, measured vs predicted).
"""
from __future__ import annotations

import re
import statistics
from pathlib import Path
from typing import Any

from ..errors import UsageError
from ..formats import Plan, file_hash, trace_plan_hashes, write_json
from .analyze import COMPUTE_KINDS, StepAnalysis, analyze, events_from_trace
from .chrome import load_trace
from .cpu_steal import describe, slowed
from .of_plan import check_trace_alone, check_trace_of_plan

_STEP = re.compile(r"timeline_step(\d+)_all\.json$")


def find_timelines(trace_dir: Path) -> list[tuple[int, Path]]:
    if trace_dir.is_file():
        m = _STEP.search(trace_dir.name)
        return [(int(m.group(1)) if m else 0, trace_dir)]
    found = sorted((int(m.group(1)), p) for p in trace_dir.glob("timeline_step*_all.json")
                   if (m := _STEP.search(p.name)))
    if not found:
        raise FileNotFoundError(f"{trace_dir}: no merged timelines (timeline_step<N>_all.json); "
                                "train with --trace-dir to write them")
    return found


def rank_memory(trace: dict[str, Any]) -> dict[int, int]:
    """Per rank, the peak RSS the stage added over the process before it was built (what the
    planner's memory model predicts), or the whole peak where the trace has no base."""
    ranks = (trace.get("metadata") or {}).get("ranks") or {}
    return {int(r): int(v["peak_rss_bytes"]) - int(v.get("base_rss_bytes") or 0)
            for r, v in ranks.items() if v.get("peak_rss_bytes")}


def cpu_steal(traces: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Per host, the cores its machine lost to other guests (steal) on average over the traced steps
    and in the worst one, from each rank's metadata; ``slowed`` names the hosts where that was
    enough to slow the measurement (``cpu_steal.slowed``). None where no trace recorded it."""
    seen: dict[str, list[float]] = {}
    cpus: dict[str, int] = {}
    for tr in traces:
        for r, v in ((tr.get("metadata") or {}).get("ranks") or {}).items():
            if v.get("cpu_steal_cores") is not None:
                host = str(v.get("host") or f"rank {r}")
                seen.setdefault(host, []).append(float(v["cpu_steal_cores"]))
                cpus[host] = int(v.get("cpus") or 1)
    if not seen:
        return None
    hosts = {h: {"cores": statistics.fmean(xs), "worst_step_cores": max(xs), "cpus": cpus[h]}
             for h, xs in sorted(seen.items())}
    return {"hosts": hosts, "slowed": [h for h, v in hosts.items() if slowed(v["cores"], v["cpus"])]}


def steal_line(steal: dict[str, Any] | None) -> str | None:
    """The report's one line on steal, or None where the traces did not record it."""
    if not steal:
        return None
    said: dict[str, list[str]] = {}  # hosts of one machine (an emulated cluster) read the same
    for h, v in steal["hosts"].items():
        said.setdefault(describe(v["cores"], v["cpus"]), []).append(h)
    parts = "; ".join(f"{', '.join(hs)} {d}" for d, hs in said.items())
    line = f"CPU taken by other guests of the virtual machine (steal), mean over the traced steps: {parts}"
    if steal["slowed"]:
        line += (f"; the measured times on {', '.join(steal['slowed'])} include it (every process there waited), "
                 "the prediction assumes none")
    return line


PATH_COMPUTE = (*COMPUTE_KINDS, "optimizer")
"""Kinds of the critical path that are a host's own work (recomputation runs inside B and I)."""


def compute_split(measured: StepAnalysis, predicted: StepAnalysis, step_s: float) -> dict[str, float] | None:
    """The step's error taken apart: how fast the hosts ran the compute on the critical path against
    their profiles, and the prediction with that compute as measured (the predicted path's compute
    replaced by the measured path's), whose error is what the rest of the model (the order, the
    links, the waiting) missed. On a virtual machine whose speed moves by tens of percent from one
    run to the next, the first is the machine and the second the cost model. ``step_s``: the measured
    step the error is taken against (the median traced step; ``measured`` is the step nearest it)."""
    m = sum(measured.critical_path.get(k, 0.0) for k in PATH_COMPUTE)
    p = sum(predicted.critical_path.get(k, 0.0) for k in PATH_COMPUTE)
    if m <= 0.0 or p <= 0.0 or step_s <= 0.0:
        return None
    at = predicted.step_time_s + m - p
    return {"measured_s": m, "predicted_s": p, "ratio": m / p, "predicted_step_s": at, "step_error": (at - step_s) / step_s}


def compute_line(split: dict[str, float] | None) -> str | None:
    if not split:
        return None
    return (f"Critical path's compute: measured {split['measured_s']:.4f} s against {split['predicted_s']:.4f} s "
            f"predicted ({split['ratio']:.2f}x: the hosts' speed against their profiles); with it as measured, the "
            f"step is predicted at {split['predicted_step_s']:.4f} s ({100 * split['step_error']:+.1f}%: what the "
            "order, the links and the waiting missed)")


def predicted_memory(plan: Plan | None) -> dict[int, int]:
    """Per rank, the planner's predicted peak (plan.json ``predicted.stages[].devices[]``): the whole
    rank's, every chunk it holds included, repeated under each of its chunks."""
    if plan is None or not plan.predicted:
        return {}
    out = {int(r): int(v) for r, v in (plan.predicted.get("memory_bytes_per_rank") or {}).items()}
    for s in plan.predicted.get("stages") or []:
        for d in s.get("devices") or []:
            if "rank" in d and d.get("memory_bytes") is not None:
                out[int(d["rank"])] = int(d["memory_bytes"])
    return out


def _rel(pred: float, meas: float) -> float | None:
    return (pred - meas) / meas if meas > 0 else None


def build_report(trace_dir: Path, plan: Plan | None = None, predicted: Path | None = None,
                 plan_src: str = "plan.json") -> dict[str, Any]:
    """Each traced step analysed; the timelines are first held to ``plan`` (its ranks, chunks, layer
    ranges and micro-batches) or, without one, to themselves: a wrong pid or micro-batch is refused,
    never reported as a rank or micro-batch of its own."""
    steps = find_timelines(trace_dir)
    analyses: list[tuple[int, StepAnalysis, dict[str, Any]]] = []
    for n, path in steps:
        tr = load_trace(path)
        evs = events_from_trace(tr)
        if plan is None:
            check_trace_alone(str(path), tr, evs)
        else:
            check_trace_of_plan(str(path), tr, evs, plan, plan_src)
        analyses.append((n, analyze(evs), tr))
    # the first traced step still warms caches; report the median step and keep every step's time
    times = [a.step_time_s for _, a, _ in analyses]
    med = statistics.median(times)
    n_rep, rep, rep_trace = min(analyses, key=lambda x: abs(x[1].step_time_s - med))
    out: dict[str, Any] = {"format": "torchpp.report/1", "trace_dir": str(trace_dir),
                           "steps": {str(n): a.step_time_s for n, a, _ in analyses},
                           "measured_step": n_rep, "measured": rep.to_json(), "step_time_s": med}
    pred_step = None
    if predicted is not None:
        pa = analyze(events_from_trace(load_trace(predicted)))
        out["predicted"] = pa.to_json()
        pred_step = pa.step_time_s
        out["compute_split"] = compute_split(rep, pa, med)
        out["stage_errors"] = [
            {"stage": s, "forward_error": _rel(pa.stage_forward_s[s], rep.stage_forward_s[s]),
             "backward_error": _rel(pa.stage_backward_s[s], rep.stage_backward_s[s])}
            for s in range(min(pa.num_stages, rep.num_stages))]
    elif plan is not None and plan.predicted and "step_time_s" in plan.predicted:
        pred_step = float(plan.predicted["step_time_s"])
    out["predicted_step_time_s"] = pred_step
    out["step_time_error"] = _rel(pred_step, med) if pred_step is not None else None
    meas_mem, pred_mem = rank_memory(rep_trace), predicted_memory(plan)
    out["cpu_steal"] = cpu_steal([tr for _, _, tr in analyses])
    out["memory"] = {str(r): {"measured_peak_bytes": meas_mem.get(r), "predicted_peak_bytes": pred_mem.get(r),
                              "error": _rel(pred_mem[r], meas_mem[r]) if r in pred_mem and r in meas_mem else None}
                     for r in sorted(set(meas_mem) | set(pred_mem))}
    return out


def _chunks(rank: dict[str, Any]) -> str:
    """A rank's chunks as the report names them: ``2``, or ``0,5`` for a rank holding several."""
    held = sorted(int(c) for c in rank.get("chunk_compute_s") or {})
    return ",".join(map(str, held)) if held else str(rank["stage"])


def write_markdown(rep: dict[str, Any], path: Path) -> None:
    m = rep["measured"]
    lines = [f"# Timeline report: {rep['trace_dir']}", "",
             f"Measured step time (median of {len(rep['steps'])} traced step(s)): **{rep['step_time_s']:.4f} s**"]
    if rep["predicted_step_time_s"] is not None:
        lines.append(f"Predicted: {rep['predicted_step_time_s']:.4f} s, error "
                     f"{100 * rep['step_time_error']:+.1f}%")
    for extra in (compute_line(rep.get("compute_split")), steal_line(rep.get("cpu_steal"))):
        if extra is not None:
            lines.append(extra)
    lines += ["", "## Per rank (seconds)", "",
              "| rank | stage(s) | compute | forward | backward | recompute | recv wait | all-reduce | optimizer | idle |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for r, s in m["ranks"].items():
        lines.append(f"| {r} | {_chunks(s)} | {s['compute_s']:.4f} | {s['forward_s']:.4f} | {s['backward_s']:.4f} | "
                     f"{s['recompute_s']:.4f} | {s['recv_wait_s']:.4f} | {s['allreduce_s']:.4f} | "
                     f"{s['optimizer_s']:.4f} | {s['idle_s']:.4f} |")
    b = m["bubble"]
    lines += ["", "## Bubble (seconds per rank on average): real = ideal + imbalance + communication + recompute",
              "", "Every term is measured from the events (see `torchpp.trace.analyze`); none is a remainder.", "",
              "| real | ideal | imbalance | communication | recompute |", "|---|---|---|---|---|",
              f"| {b['real']:.4f} | {b['ideal']:.4f} | {b['imbalance']:.4f} | {b['communication']:.4f} | "
              f"{b['recompute']:.4f} |", "", "## Per stage (seconds per micro-batch)", "",
              "| stage | forward | backward | predicted forward | predicted backward |", "|---|---|---|---|---|"]
    pred = rep.get("predicted")
    for s in range(m["num_stages"]):
        pf = f"{pred['stage_forward_s'][s]:.4f}" if pred and s < pred["num_stages"] else "–"
        pb = f"{pred['stage_backward_s'][s]:.4f}" if pred and s < pred["num_stages"] else "–"
        lines.append(f"| {s} | {m['stage_forward_s'][s]:.4f} | {m['stage_backward_s'][s]:.4f} | {pf} | {pb} |")
    lines += ["", "## Critical path (seconds by kind)", "",
              ", ".join(f"{k}: {v:.4f}" for k, v in sorted(m["critical_path"].items(), key=lambda kv: -kv[1]))]
    if rep["memory"]:
        lines += ["", "## Peak memory per rank (MiB)", "",
                  "The peak RSS each rank's stage added over its process before the stage was built "
                  "(the torch runtime, data and process group come on top).", "",
                  "| rank | measured | predicted | error |", "|---|---|---|---|"]
        for r, v in rep["memory"].items():
            mm = f"{v['measured_peak_bytes'] / 2**20:.1f}" if v["measured_peak_bytes"] else "–"
            pm = f"{v['predicted_peak_bytes'] / 2**20:.1f}" if v["predicted_peak_bytes"] else "–"
            er = f"{100 * v['error']:+.1f}%" if v["error"] is not None else "–"
            lines.append(f"| {r} | {mm} | {pm} | {er} |")
    from ..validate import open_output

    with open_output(path, "w", "--out") as f:
        f.write("\n".join(lines) + "\n")


def write_stage_chart(rep: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    m, pred = rep["measured"], rep.get("predicted")
    x = np.arange(m["num_stages"])
    fig, ax = plt.subplots(figsize=(max(4, 1.2 * m["num_stages"] + 2), 3.2))
    w = 0.38 if pred else 0.6
    ax.bar(x - (w / 2 if pred else 0), m["stage_forward_s"], w, label="measured forward", color="#4c72b0")
    ax.bar(x - (w / 2 if pred else 0), m["stage_backward_s"], w, bottom=m["stage_forward_s"],
           label="measured backward", color="#55a868")
    if pred:
        n = min(pred["num_stages"], m["num_stages"])
        ax.bar(x[:n] + w / 2, pred["stage_forward_s"][:n], w, label="predicted forward", color="#4c72b0", alpha=0.45)
        ax.bar(x[:n] + w / 2, pred["stage_backward_s"][:n], w, bottom=pred["stage_forward_s"][:n],
               label="predicted backward", color="#55a868", alpha=0.45)
    ax.set_xticks(x, [f"stage {i}" for i in x])
    ax.set_ylabel("seconds per micro-batch")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_analyze(trace_dir: Path, out: Path, plan: Plan | None = None, predicted: Path | None = None,
                plan_src: str = "plan.json") -> dict[str, Any]:
    from .gantt import bars_from_events, rank_names, save_gantt

    from ..validate import output_file

    for name in ("report.json", "report.md", "gantt.png", "stages.png"):  # before any work: no link written through
        output_file(out / name, "--out")
    rep = build_report(trace_dir, plan, predicted, plan_src)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "report.json", rep)
    write_markdown(rep, out / "report.md")
    step_path = dict(find_timelines(trace_dir))[rep["measured_step"]]
    panels = [(f"measured (step {rep['measured_step']})", events_from_trace(load_trace(step_path)))]
    if predicted is not None:
        panels.append(("predicted", events_from_trace(load_trace(predicted))))
    save_gantt(out / "gantt.png", [(title, bars_from_events(evs)) for title, evs in panels],
               names=rank_names(e for _, evs in panels for e in evs))
    write_stage_chart(rep, out / "stages.png")
    return rep


def check_traces_of_plan(traces: list[Path], plan: Path) -> None:
    """Refuse timelines recorded (or predicted) for another plan than ``plan``.

    Traces name the hash of the plan file they ran (``metadata.plan_hash``, per rank in merged
    timelines); comparing a run with another plan's prediction gives confident, wrong numbers.
    Traces that name no plan (older runs) are accepted.
    """
    want = file_hash(plan)
    for path in traces:
        got = trace_plan_hashes(load_trace(path))
        if got and want not in got:
            raise UsageError(f"{path}: recorded for plan {', '.join(sorted(got))}, not for --plan {plan} ({want}); "
                             "pass the plan.json the run used")
