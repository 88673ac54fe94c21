"""The tied weight synced by its touched rows against the dense all-reduce, on local gloo ranks.

Seed 003's pipeline (qwen3-small cut to 3 layers, 3 stages of one rank each, 3 micro-batches of
2 x 64 byte tokens of the vim manual; ``bench_wire_cluster``'s plans) runs four ways, one after another,
on one machine over loopback: fp32 links with the dense tied all-reduce (``pp_fp32``) or the rows
(``pp_rows``), int8 links with the int8 tied all-reduce (``pp_int8``) or the rows
(``pp_int8_rows``). Printed per run: every loss equal to its baseline's or not, the tied sync's
bytes and all bytes one traced step moved (every rank's sends and collectives as the trace
records them), and the median step. Loopback moves 4 MB in milliseconds, so the times here show
the rows' CPU cost, not the link time they save: that is the cluster's (``bench_wire.py
--cluster --runs pp_fp32,pp_int8,pp_rows,pp_int8_rows``).

    python benchmarks/bench_tied_rows.py [--steps 40] [--out benchmarks/results/bench_tied_rows]
    python benchmarks/bench_tied_rows.py --quick --out /tmp/tied_rows   # 4 steps each
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNS = ("pp_fp32", "pp_rows", "pp_int8", "pp_int8_rows")


def _rank(rank: int, world: int, case: dict) -> None:
    from torchpp.runtime.trainer import TrainConfig, train

    s = train(TrainConfig(**case["config"]))
    if rank == 0:
        Path(case["result"]).write_text(json.dumps({"losses": s.losses, "step_times_s": s.step_times_s}))


def traced_bytes(trace_dir: Path) -> tuple[int, int]:
    """(the tied sync's bytes, every send's and collective's bytes) of one traced step, all ranks."""
    tied = total = 0
    for f in sorted(trace_dir.rglob("*.json")):
        if "_all" in f.name:
            continue
        for e in json.loads(f.read_text()).get("traceEvents", []):
            if e.get("ph") == "X" and e.get("name") in ("send_act", "send_grad", "allreduce"):
                total += int(e["args"]["bytes"])
                tied += int(e["args"]["bytes"]) if e["args"].get("tied") else 0
    return tied, total


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "bench_tied_rows"))
    ap.add_argument("--quick", action="store_true", help="4 steps each: checks that it runs")
    args = ap.parse_args(argv)
    if args.quick:
        args.steps = 4
    sys.path.insert(0, str(Path(__file__).parent))
    from bench_wire import _text
    from bench_wire_cluster import distinct_per_step, make_plans

    from torchpp.runtime.launch import RankPool

    tmp = Path(tempfile.mkdtemp(prefix="bench_tied_rows_"))
    text = _text(None, False, tmp)
    rows = distinct_per_step(text)
    plans = make_plans(tmp, [8], 0.7, 0.5, rows)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res: dict[str, dict] = {}
    with RankPool(3, threads=1) as pool:
        for name in RUNS:
            cfg = dict(plan=plans[name], layers=3, steps=args.steps, data=str(text), tokenizer="bytes", lr=1e-3,
                       warmup_steps=min(20, args.steps // 10), seed=0, threads=1, timeout_s=300.0,
                       trace_dir=tmp / f"tr_{name}", trace_steps=(3,), data_cache=tmp / "cache")
            pool.run(_rank, {"config": cfg, "result": str(tmp / f"{name}.result.json")}, world=3, timeout_s=3000,
                     pg_timeout_s=300)
            r = json.loads((tmp / f"{name}.result.json").read_text())
            r["tied_bytes"], r["bytes_per_step"] = traced_bytes(tmp / f"tr_{name}")
            r["median_step_s"] = statistics.median(r["step_times_s"][1:])
            res[name] = r
    lines = [f"Seed 003's pipeline on 3 local gloo ranks (loopback), {args.steps} steps each, {rows} distinct "
             "byte tokens a step on average (the rows plans' pricing).", "",
             "| run | losses vs baseline | tied sync bytes/step | all bytes/step | median step |",
             "|---|---|---|---|---|"]
    for name, r in res.items():
        base = res["pp_fp32" if "int8" not in name else "pp_int8"]
        same = "baseline" if r is base else ("bit-identical" if r["losses"] == base["losses"] else
                                             f"last {r['losses'][-1]:.4f} vs {base['losses'][-1]:.4f}")
        lines.append(f"| {name} | {same} | {r['tied_bytes'] / 1e3:.1f} kB | {r['bytes_per_step'] / 1e3:.1f} kB | "
                     f"{r['median_step_s'] * 1e3:.1f} ms |")
    (out / "results.json").write_text(json.dumps({"steps": args.steps, "rows": rows, "runs": res}, indent=1))
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
