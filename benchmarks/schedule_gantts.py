"""Predicted Gantt charts of every schedule kind on seed 000's 4-host instance.

    PYTHONPATH=. python benchmarks/schedule_gantts.py [--out benchmarks/results/schedules]
    PYTHONPATH=. python benchmarks/schedule_gantts.py --quick --out /tmp/gantts   # 1f1b and zbv only

For each kind the planner searches that kind alone (micro-batches of 4, global batch 20, the
instance's memory), prices the plan by replaying its action lists and draws the replayed timeline
with the one Gantt renderer (`planner/report.write_outputs` draws the same for `torchpp plan`).
It also prices seed 000's own plan the same way; every figure is printed next to it.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from torchpp.cost import Links, Profiles
from torchpp.planner.report import predict
from torchpp.planner.types import InfeasibleError, Problem
from torchpp.planner.search import search
from torchpp.planner.synthetic import seed000_instance, seed000_plan
from torchpp.formats import PLAN_SCHEDULES
from torchpp.sim.measured import price
from torchpp.sim.trace import timeline_events
from torchpp.trace.gantt import bars_from_events, save_gantt


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/schedules"))
    ap.add_argument("--quick", action="store_true", help="1f1b and zbv only (one flat kind, one chunked): checks that "
                    "it runs")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    files, bw, mem, memory = seed000_instance()
    prof, links = Profiles.from_layers(files), Links(bw)
    hosts = [f.host for f in files]
    theirs = price(seed000_plan(prof.model), prof, links)[0]
    print(f"seed 000's own plan (1F1B, [0,12) host0 | [12,20) host1 | [20,25) host2 | [25,28) host3): {theirs:.2f} s")
    for kind in ("1f1b", "zbv") if a.quick else PLAN_SCHEDULES:
        pb = Problem(profiles=prof, links=links, hosts=hosts, budget=memory.budgets(mem), memory=memory,
                     global_batch=20, micro_batch_sizes=[4], schedule=kind)
        try:
            res = search(pb)
        except InfeasibleError as e:
            print(f"  {kind:<15} no plan fits: {str(e).splitlines()[0]}")
            continue
        _, tl = predict(res.plan, prof, links, memory, pb.budget)
        bars = bars_from_events(timeline_events(res.plan, tl))
        path = a.out / f"{kind}.png"
        save_gantt(path, [(f"{kind}: predicted step {tl.makespan:.4g} s", bars)])
        layout = " | ".join(f"[{s.layers[0]},{s.layers[1]}) " + ",".join(d.host for d in s.devices)
                            for s in res.plan.stages)
        print(f"  {kind:<15} {res.step_time_s:8.2f} s  ({res.step_time_s / theirs:.3f}x seed 000's)  {layout}  -> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
