"""Does the loop keep its promises? Predicted vs measured step time and memory, plan vs baselines.

On the emulated ``hetero4`` cluster (root; else local processes with ``--local``): measure the
hosts, plan, then train and time several plans — the planner's, an even pipeline split, pure
data parallelism, and a deliberately unbalanced pipeline (the tail on the slowest host) — and
re-plan from the unbalanced run's timelines and train that. Prints, for every run, predicted
and measured step time (and their mean absolute percentage error), predicted and measured peak
memory per rank, the planner's plan against the even split and DP, and the re-plan against the
planner's best. Writes ``results.json``, ``results.md`` and ``predicted_vs_measured.png``.

    sudo .venv/bin/python benchmarks/bench_loop.py [--out out/bench_loop] [--local] [--steps 6]
    python benchmarks/bench_loop.py --quick --local --out /tmp/loop   # the smallest sizes: checks that it runs
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from torchpp.demo import Demo, DemoConfig, DemoError, demo_hosts, price_fixed  # noqa: E402


def run(demo: Demo) -> dict:
    hosts = demo.hosts.names
    meas = demo.measure_and_plan()
    planned, cap = meas.plan, meas.capacities
    from torchpp.formats import Plan
    from torchpp.planner.simple import dp_plan, pp_plan
    from torchpp.schedules import build

    searched = Plan.load(planned)
    plans = {"plan": planned, "even": demo.even_plan(planned, meas)}
    # the two baselines `torchpp plan --strategy dp|pp` would write, made here from the searched plan's model
    # (a fresh `torchpp plan --model` process imports the model's code to check it: ~10 s of CPU each)
    kw = dict(seq_len=demo.cfg.seq_len, global_batch=demo.cfg.global_batch, schedule="1f1b")
    order = sorted(hosts, key=lambda h: -json.loads(cap.read_text())["capacity"][h])  # slowest host last (tail)
    for name, plan in (("dp", dp_plan(searched.model, devices=len(hosts), hosts=hosts, num_microbatches=1, **kw)),
                       ("unbalanced", pp_plan(searched.model, stages=len(hosts), hosts=order,
                                              num_microbatches=searched.num_microbatches, **kw))):
        build(plan)  # its action lists are consistent, as `torchpp plan` proves before writing
        plans[name] = demo.path(name, "plan.json")
        plans[name].parent.mkdir(parents=True, exist_ok=True)
        plan.save(plans[name])
        price_fixed(plans[name], meas)
    results = {name: demo.train(name, p, meas) for name, p in plans.items()}
    replanned = demo.replan(results["unbalanced"], meas)
    results["replan"] = demo.train("replan", replanned, meas)

    rows, errs = [], []
    for name, r in results.items():
        rows.append({"run": name, "plan": r.plan, "predicted_s": r.predicted_step_s, "measured_s": r.measured_step_s,
                     "error": r.error, "steps_s": r.steps_s,
                     "memory_mib": r.memory_mib})
        errs.append(abs(r.error))
    meas = {r["run"]: r["measured_s"] for r in rows}
    best = min(meas["plan"], meas["replan"])
    mem_err = [abs(x["error"]) for r in rows for x in r["memory_mib"]]
    summary = {
        "mode": demo.hosts.mode, "hosts": hosts, "runs": rows,
        "step_time_mape": statistics.fmean(errs),
        "memory_max_abs_error": max(mem_err) if mem_err else None,
        "memory_mean_abs_error": statistics.fmean(mem_err) if mem_err else None,
        "plan_vs_even": meas["plan"] / meas["even"], "plan_vs_dp": meas["plan"] / meas["dp"],
        "replan_vs_best_plan": meas["replan"] / best, "unbalanced_vs_plan": meas["unbalanced"] / meas["plan"],
    }
    return summary


def report(summary: dict, out: Path) -> str:
    lines = [f"# Loop benchmark on {summary['mode']} ({', '.join(summary['hosts'])})", "",
             "| run | predicted step (s) | measured step (s) | error | peak memory per rank, predicted/measured MiB |",
             "|---|---|---|---|---|"]
    for r in summary["runs"]:
        mem = ", ".join(f"r{x['rank']} {x['predicted']:.0f}/{x['measured']:.0f} ({100 * x['error']:+.0f}%)"
                        for x in r["memory_mib"]) or "–"
        lines.append(f"| {r['run']} | {r['predicted_s']:.4f} | {r['measured_s']:.4f} | {100 * r['error']:+.1f}% | {mem} |")
    me = summary["memory_max_abs_error"]
    lines += ["", f"- step time MAPE over {len(summary['runs'])} plans: {100 * summary['step_time_mape']:.1f}% "
                  "(target ≤ 10%)",
              f"- memory: mean |error| {100 * summary['memory_mean_abs_error']:.1f}%, max {100 * me:.1f}% "
              "(target ≤ 15%)" if me is not None else "- memory: no per-rank prediction",
              f"- measured plan / even split: {summary['plan_vs_even']:.3f}; plan / DP: {summary['plan_vs_dp']:.3f} "
              "(target < 1)",
              f"- re-plan from the unbalanced run / best of plan and re-plan: {summary['replan_vs_best_plan']:.3f} "
              f"(target ≤ 1.05); unbalanced / plan: {summary['unbalanced_vs_plan']:.3f}"]
    text = "\n".join(lines)
    (out / "results.md").write_text(text + "\n")
    (out / "results.json").write_text(json.dumps(summary, indent=1) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 5))
    xs = [r["measured_s"] for r in summary["runs"]]
    ys = [r["predicted_s"] for r in summary["runs"]]
    ax.scatter(xs, ys)
    for r in summary["runs"]:
        ax.annotate(r["run"], (r["measured_s"], r["predicted_s"]), textcoords="offset points", xytext=(4, 4))
    hi = max(xs + ys) * 1.1
    ax.plot([0, hi], [0, hi], "k--", lw=0.8, label="predicted = measured")
    ax.fill_between([0, hi], [0, 0.9 * hi], [0, 1.1 * hi], color="grey", alpha=0.15, label="±10%")
    ax.set_xlim(0, hi)
    ax.set_ylim(0, hi)
    ax.set_xlabel("measured step time (s)")
    ax.set_ylabel("predicted step time (s)")
    ax.set_title(f"torchpp predictions on {summary['mode']}")
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(out / "predicted_vs_measured.png", dpi=120)
    return text


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("out/bench_loop"))
    ap.add_argument("--local", action="store_true", help="local processes instead of the emulated cluster")
    ap.add_argument("--hosts", type=int, default=2, help="local processes (with --local)")
    ap.add_argument("--steps", type=int, default=None,
                    help=f"default {DemoConfig.steps}; --quick {DemoConfig.smoke().steps}")
    ap.add_argument("--scenario", default="hetero4", help="the demo's scenario (default hetero4; bench_prove "
                    "covers homelab)")
    ap.add_argument("--model", default=None, help="default: the scenario's")
    ap.add_argument("--quick", action="store_true", help="the demo's quick sizes (qwen3-tiny) with the fewest "
                    "measurements (DemoConfig.smoke: 2 steps) on the scenario's hosts: checks that it runs, no "
                    "measurement")
    a = ap.parse_args()
    cfg = DemoConfig.scenario(a.scenario)
    if a.quick:
        cfg = dataclasses.replace(DemoConfig.smoke(), cluster=cfg.cluster)
    cfg.steps = a.steps if a.steps is not None else cfg.steps
    if a.model:
        cfg.model = a.model
    a.out.mkdir(parents=True, exist_ok=True)
    try:
        with demo_hosts(cfg, a.out, a.local, a.hosts, extra_steps=6) as demo:
            summary = run(demo)
    except DemoError as e:
        print(f"bench_loop: {e}", file=sys.stderr)
        return 1
    print("\n" + report(summary, a.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
