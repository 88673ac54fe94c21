"""What a plan is predicted to do, and the files that show it (seed 000's outputs plus a Gantt).

``predict`` prices the plan's action lists (sim.measured.price) and derives, per stage, the forward,
backward, recompute, communication and all-reduce time and each device's memory against its
budget; the bubble split ``real = ideal + imbalance + communication + recompute`` (seconds per
rank on average) is :func:`torchpp.trace.analyze.analyze` of the replayed timeline — the same
function ``torchpp analyze`` runs on measured traces and on ``simulate plan``'s predicted trace
— and the lower bound of :mod:`.bound` (every sample's forward and backward and every weight's
optimizer update on some device, weights within each device's memory; without memory limits or
an optimizer rate it is G / Σ_d (1 / τ_d), τ_d being device d's time per sample for the whole
model: total work over total capacity).
"""
from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any, Mapping, Sequence

from ..formats import Plan, Predicted, file_hash, write_json
from ..schedules import Kind
from ..sim.replay import Timeline
from ..cost import Links, MemoryEstimator, Profiles, device_memory, stage_time
from ..schedules import SPLIT_BACKWARD
from ..sim.measured import price
from ..sim.trace import recompute_of, timeline_events
from ..trace.analyze import analyze
from .bound import lower_bound
from .gap import Gap, gap_to_bound
from .types import fmt_bytes


def predict(plan: Plan, profiles: Profiles, links: Links, memory: MemoryEstimator, budget: Mapping[str, float],
            optimizer_s_per_byte=None, replayed: tuple[float, Timeline] | None = None) -> tuple[Predicted, Timeline]:
    """The plan's prediction and its replayed timeline; ``replayed``: the (step, timeline) the search
    already priced it with (it is replayed here only without one)."""
    step, tl = replayed if replayed is not None else price(plan, profiles, links, optimizer_s_per_byte)
    mem = device_memory(plan, profiles, memory)
    stages = []
    for s in plan.stages:
        times = [(d.samples, stage_time(profiles, d.host, s)) for d in s.devices]
        fwd = max(st.forward(n) for n, st in times)
        rec = max(st.recompute(n) for n, st in times)
        bwd = max(st.backward(n) for n, st in times) - rec
        comm = max(sum(sp.end - sp.start for sp in tl.spans[d.rank] if sp.action.is_send
                       and sp.action.stage == s.index) for d in s.devices)
        ar = max(sum(sp.end - sp.ready for sp in tl.spans[d.rank] if sp.action.kind == Kind.ALLREDUCE
                     and sp.action.stage == s.index) for d in s.devices)
        stages.append({
            "index": s.index, "layers": list(s.layers), "has_embed": s.has_embed, "has_tail": s.has_tail,
            "forward_s": fwd, "backward_s": bwd, "recompute_s": rec, "comm_s": comm, "allreduce_s": ar,
            "recomputed_layers": sum(s.recompute),
            "devices": [{"host": d.host, "rank": d.rank, "samples": d.samples, "memory_bytes": int(mem[d.rank]),
                         "budget_bytes": int(budget.get(d.host, 0)) if d.host in budget else None}
                        for d in s.devices],
        })
    bubble = analyze(timeline_events(plan, tl, recompute_of=recompute_of(plan, profiles))).bubble
    hosts = list(budget) or sorted({d.host for s in plan.stages for d in s.devices})
    lb = lower_bound(profiles, hosts, {h: budget.get(h, math.inf) for h in hosts}, memory, plan.global_batch,
                     optimizer_s_per_byte)
    pred = Predicted(
        step_time_s=step, throughput_samples_per_s=plan.global_batch / step,
        lower_bound_s=lb, ratio_to_lower_bound=step / lb,
        gap_to_bound=gap_to_bound(plan, profiles, links, lb, optimizer_s_per_byte, step_s=step).as_dict()
        if math.isfinite(lb) else None,
        bubble=bubble, memory_model=memory.source,
        memory_bytes_per_rank={str(r): int(v) for r, v in sorted(mem.items())}, stages=stages)
    if plan.schedule in SPLIT_BACKWARD:
        pred.backward_split = profiles.backward_split([d.host for s in plan.stages for d in s.devices])
    return pred, tl


def write_outputs(out_dir: Path, plan: Plan, tl: Timeline, meta: dict[str, Any], compare: Sequence[dict] = ()) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    plan.save(out_dir / "plan.json")
    pred = plan.predicted or {}
    with open(out_dir / "stages.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["stage", "layer_start", "layer_end", "has_embed", "has_tail", "hosts", "ranks", "samples",
                    "recomputed_layers", "forward_s", "backward_s", "recompute_s", "comm_s", "allreduce_s",
                    "max_memory_bytes", "min_budget_bytes"])
        for s, ps in zip(plan.stages, pred.get("stages", [])):
            budgets = [d["budget_bytes"] for d in ps["devices"] if d["budget_bytes"] is not None]
            w.writerow([s.index, s.layers[0], s.layers[1], s.has_embed, s.has_tail,
                        ";".join(d.host for d in s.devices), ";".join(str(d.rank) for d in s.devices),
                        ";".join(str(d.samples) for d in s.devices), sum(s.recompute),
                        f"{ps['forward_s']:.6g}", f"{ps['backward_s']:.6g}", f"{ps['recompute_s']:.6g}",
                        f"{ps['comm_s']:.6g}", f"{ps['allreduce_s']:.6g}",
                        max(d["memory_bytes"] for d in ps["devices"]), min(budgets) if budgets else ""])
    with open(out_dir / "steps.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["rank", "host", "stage", "action", "kind", "microbatch", "start_s", "end_s"])
        for r in sorted(tl.spans):
            host = plan.device_of_rank(r).host
            for sp in tl.spans[r]:
                a = sp.action
                w.writerow([r, host, a.stage, str(a), a.kind.name, "" if a.microbatch is None else a.microbatch,
                            f"{sp.start:.6f}", f"{sp.end:.6f}"])
    write_json(out_dir / "plan_meta.json", meta)
    (out_dir / "summary.txt").write_text(summary_text(plan, meta, compare))
    from ..trace.gantt import bars_from_events, save_gantt

    names = {r: f"rank {r} · s{','.join(str(s.index) for s in plan.stages_of_rank(r))} · "
                f"{plan.device_of_rank(r).host}" for r in tl.spans}
    save_gantt(out_dir / "gantt.png", [(f"predicted step: {tl.makespan:.4g} s",
                                        bars_from_events(timeline_events(plan, tl)))],
               names=names, xlabel="seconds (predicted)")


def summary_text(plan: Plan, meta: dict[str, Any], compare: Sequence[dict] = ()) -> str:
    p = plan.predicted or {}
    b = p.get("bubble", {})
    lines = [
        f"plan: {plan.num_stages} stage(s) on {plan.world_size} device(s), {plan.num_microbatches} micro-batch(es) of "
        f"{plan.micro_batch_size} (global batch {plan.global_batch}), {plan.schedule}",
        f"predicted step time {p.get('step_time_s', float('nan')):.4g} s "
        f"({p.get('throughput_samples_per_s', float('nan')):.4g} samples/s), priced by replaying the action lists",
        f"lower bound (all work over all capacity, weights within memory) {p.get('lower_bound_s', float('nan')):.4g} s, "
        f"ratio {p.get('ratio_to_lower_bound', float('nan')):.3f}",
        *([f"gap to the bound (each part taken out of the same replay in turn): {Gap(**p['gap_to_bound']).line()}"]
          if p.get("gap_to_bound") else []),
        f"memory: {p.get('memory_model', '')}",
        *([f"optimizer step: {p['optimizer']}"] if p.get("optimizer") else []),
        "",
        "stage  layers      hosts (samples)                  fwd/mb    bwd/mb   recomp   comm/step  allreduce  memory / budget",
    ]
    for s, ps in zip(plan.stages, p.get("stages", [])):
        hosts = ", ".join(f"{d.host}({d.samples})" for d in s.devices)
        mem = "; ".join(f"{fmt_bytes(d['memory_bytes'])}/"
                        f"{fmt_bytes(d['budget_bytes']) if d['budget_bytes'] is not None else '?'}"
                        for d in ps["devices"])
        extra = ("E" if s.has_embed else "") + ("T" if s.has_tail else "")
        lines.append(f"{s.index:>5}  [{s.layers[0]:>3},{s.layers[1]:>3}){extra:<3} {hosts:<32} "
                     f"{ps['forward_s']:>8.4g} {ps['backward_s']:>8.4g} {ps['recompute_s']:>8.4g} "
                     f"{ps['comm_s']:>10.4g} {ps['allreduce_s']:>10.4g}  {mem}"
                     + (f"  recompute {ps['recomputed_layers']} layer(s)" if ps["recomputed_layers"] else ""))
    lines += ["", "bubble (seconds per rank on average, measured on the predicted timeline as `torchpp analyze` does):",
              "    real    =   ideal   + imbalance + communication + recompute",
              f"  {b.get('real', 0):8.4f}  = {b.get('ideal', 0):8.4f}  + {b.get('imbalance', 0):8.4f}  + "
              f"{b.get('communication', 0):8.4f}      + {b.get('recompute', 0):8.4f}"]
    if compare:
        lines += ["", "comparison (same devices and cost model; each strategy at its own best micro-batching):",
                  f"  {'strategy':<24} {'step time s':>12} {'vs chosen':>10}  {'micro-batches':>13}  "
                  f"{'max memory / budget':>22}"]
        for c in compare:
            step = f"{c['step_time_s']:>12.4g} {c['ratio']:>10.3f}" if not c["oom"] else f"{'does not fit':>23}"
            mb = f"{c.get('num_microbatches', '?')} x {c.get('micro_batch_size', '?')}"
            lines.append(f"  {c['name']:<24} {step}  {mb:>13}  {c['memory']:>22}"
                         + ("  OUT OF MEMORY (nearest to fitting shown)" if c["oom"] else ""))
    lines += wire_lines(meta.get("wire"))
    s = meta.get("search", {})
    if s:
        lines += ["", f"search: {s.get('mode', '')}; {s.get('dp_candidates', 0)} DP candidates, "
                      f"{s.get('priced', 0)} priced, {s.get('planning_time_s', 0):.3f} s"]
    return "\n".join(lines) + "\n"


def wire_lines(wire: dict[str, Any] | None) -> list[str]:
    """The summary's account of the lossy choices (plan_meta.json's ``wire``, written only with
    ``--allow-lossy``): each candidate split, the format its search priced the links as, its step
    before and after the wire pass, and why the chosen one won."""
    if not wire:
        return []
    lines = ["", f"wire formats (--allow-lossy {','.join(wire['allowed'])}): candidates, each refined per link "
                 "by the wire pass:",
             f"  {'split':<10} {'searched as':<11} {'schedule':<14} {'stages':>6} {'mb':>4} {'fp32 s':>10} "
             f"{'lossy s':>10}  choices"]
    for c in wire["candidates"]:
        mark = "  <- chosen" if c["chosen"] else "" if c["fits"] else "  does not fit"
        lines.append(f"  {c['split']:<10} {c['searched_under']:<11} {c['schedule']:<14} {c['stages']:>6} "
                     f"{c['micro_batch_size']:>4} {c['fp32_step_time_s']:>10.4g} {c['step_time_s']:>10.4g}  "
                     f"{', '.join(c['lossy'] + c.get('exact', [])) or 'fp32'}{mark}")
    lines += [f"  {f}: {why}" for f, why in wire.get("not_searched", {}).items()]
    return lines + [f"  why: {wire['why']}"]


def input_hashes(paths: Mapping[str, Sequence[Path] | Path | None]) -> dict[str, str]:
    out = {}
    for key, val in paths.items():
        if val is None:
            continue
        for p in ([val] if isinstance(val, Path) else list(val)):
            out[f"{key}:{Path(p).name}"] = file_hash(p)
    return out


def json_ready(d: Any) -> Any:
    """Plain JSON types; a figure that could not be measured (NaN, e.g. a link no message crossed
    in a one-device run) becomes null, since JSON has no NaN and torchpp writes none."""
    def clean(x: Any) -> Any:
        if isinstance(x, float):
            return x if math.isfinite(x) else None
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        if isinstance(x, list):
            return [clean(v) for v in x]
        return x

    return clean(json.loads(json.dumps(d, default=float)))
