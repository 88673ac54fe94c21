"""`torchpp analyze`: the command line of :mod:`torchpp.trace.report`."""
from __future__ import annotations

import argparse
from pathlib import Path

from .. import argtypes as T
from ..formats import Plan
from .report import check_traces_of_plan, find_timelines, run_analyze, steal_line


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace_dir", type=T.existing_path, help="folder with timeline_step<N>_all.json (or one such file)")
    p.add_argument("--plan", type=T.existing_path, default=None, help="plan.json the run used (predicted step time and memory)")
    p.add_argument("--predicted", type=T.existing_path, default=None, help="predicted trace from `torchpp simulate plan`")
    p.add_argument("--out", type=T.out_dir, default=Path("report"))
    p.add_argument("--hta-dir", type=T.out_dir, default=None,
                   help="also write the reported step as per-rank Kineto-shaped files for Holistic Trace Analysis "
                        "(TraceAnalysis(trace_dir=...)); see torchpp.trace.hta")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    plan = Plan.load(args.plan) if args.plan else None
    if args.plan:
        check_traces_of_plan([p for _, p in find_timelines(args.trace_dir)]
                             + ([args.predicted] if args.predicted else []), args.plan)
    rep = run_analyze(args.trace_dir, args.out, plan, args.predicted, str(args.plan))
    b = rep["measured"]["bubble"]
    print(f"step time {rep['step_time_s']:.4f} s; bubble real {b['real']:.4f} = ideal {b['ideal']:.4f} + "
          f"imbalance {b['imbalance']:.4f} + communication {b['communication']:.4f} + recompute {b['recompute']:.4f}")
    if rep["step_time_error"] is not None:
        split = rep.get("compute_split")
        print(f"predicted {rep['predicted_step_time_s']:.4f} s ({100 * rep['step_time_error']:+.1f}%)"
              + (f"; {split['predicted_step_s']:.4f} s ({100 * split['step_error']:+.1f}%) with the critical path's "
                 f"compute as measured ({split['ratio']:.2f}x its prediction)" if split else ""))
    if (rep.get("cpu_steal") or {}).get("slowed"):
        print(steal_line(rep["cpu_steal"]))
    print(f"wrote {args.out}/report.md, report.json, gantt.png, stages.png")
    if args.hta_dir is not None:
        from .hta import export_step

        step_path = dict(find_timelines(args.trace_dir))[rep["measured_step"]]
        files = export_step(step_path.parent, rep["measured_step"], args.hta_dir)
        print(f"wrote {len(files)} HTA rank files of step {rep['measured_step']} to {args.hta_dir}")
    return 0
