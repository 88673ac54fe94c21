"""Scale-out simulation: the time to price one training step over 64 … 8,192 devices, and the
predicted scaling (throughput and efficiency vs devices) of megatron-gpt-13b on Spectrum-X rails.

Weak scaling: pp 8 × tp 8 per replica, 32 micro-batches of 4 samples per replica, dp grows
with the devices. Efficiency = throughput per device / that of the smallest cluster.
Prints the simulation time (process CPU seconds, one core) for each size — the targets are
≤ 2 s at 1,024 devices and ≤ 30 s at 8,192 — and writes ``benchmarks/results/bench_scale/``.

    PYTHONPATH=. python benchmarks/bench_scale.py [--sizes 64,1024,8192] [--quick] [--out DIR]

``--quick`` (the test suite's: it must keep running) prices the smallest and the largest size
and writes nothing.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from torchpp.sim.scale import load_workload
from torchpp.planner.scale import layout_plan
from torchpp.sim.scale import Cluster, price_on_topology
from torchpp.topology import Network
from torchpp.topology.templates import spectrum_x

OUT = Path(__file__).resolve().parent / "results" / "bench_scale"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="64,128,256,512,1024,2048,4096,8192")
    ap.add_argument("--flops", type=float, default=125e12, help="FLOP/s of one GPU (A100 bf16 at ~40%%)")
    ap.add_argument("--quick", action="store_true", help="64 and 8,192 devices only; write no results")
    ap.add_argument("--out", type=Path, default=OUT, help="where the table and plot go (default benchmarks/results/bench_scale)")
    args = ap.parse_args()
    if args.quick:
        args.sizes = "64,8192"
    wl = load_workload("megatron-gpt-13b", 2048, "bfloat16")
    pp, tp, m, per_mb = 8, 8, 32, 4
    rows = []
    for n in [int(x) for x in args.sizes.split(",")]:
        dp = n // (pp * tp)
        t0 = time.process_time()
        net = Network(spectrum_x(n))
        plan = layout_plan(wl, pp, dp, per_mb * dp * m, m)
        step = price_on_topology(plan, wl, Cluster(net, args.flops, tp), spans=False).makespan
        sim_s = time.process_time() - t0
        rows.append({"devices": n, "pp": pp, "dp": dp, "tp": tp, "step_time_s": step,
                     "throughput_samples_per_s": plan.global_batch / step, "simulation_s": sim_s})
        print(f"{n:>5} devices (pp {pp} × dp {dp} × tp {tp}): step {step:.4f} s, "
              f"{plan.global_batch / step:9.1f} samples/s, simulated in {sim_s:.2f} s", flush=True)
    base = rows[0]["throughput_samples_per_s"] / rows[0]["devices"]
    for r in rows:
        r["efficiency"] = r["throughput_samples_per_s"] / r["devices"] / base
    if args.quick:
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "scale.json").write_text(json.dumps(rows, indent=1) + "\n")
    plot(rows, args.out / "scaling.png")
    print(f"wrote {args.out / 'scale.json'} and {args.out / 'scaling.png'}")
    return 0


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = [r["devices"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(n, [r["throughput_samples_per_s"] for r in rows], "o-", label="throughput (samples/s)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("devices")
    ax.set_ylabel("samples/s")
    ax2 = ax.twinx()
    ax2.plot(n, [r["efficiency"] for r in rows], "s--", color="tab:red", label="efficiency")
    ax2.set_ylim(0, 1.1)
    ax2.set_ylabel("efficiency vs smallest")
    ax.set_title("megatron-gpt-13b, pp 8 × tp 8, Spectrum-X rails (predicted)")
    fig.legend(loc="lower center", ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
