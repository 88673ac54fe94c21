"""How closely the emulation matches what it is configured to: CPU quotas and link rates.

    sudo python benchmarks/cluster_accuracy.py        # about 3 minutes
    sudo python benchmarks/cluster_accuracy.py --quick --out /tmp/accuracy

``--quick``: one quota (0.5 core) for 0.5 s, one link rate (50 Mbit/s), the profiles of qwen3-tiny with
one layer and 2 steps: the same measurements and outputs in seconds, not a measurement.

CPU: a CPU-bound loop's speed per wall-second inside a quota, over its speed per CPU-second
unthrottled (a whole core), measured back to back. Links: `torchpp bandwidth probe` (gloo
p2p) between two namespace hosts whose uplinks are shaped to each rate. Profiles: `torchpp
profile --host {host}` run by `torchpp cluster run` on every host of --profile-config (hetero4)
at once, as the planning loop does; each host's compute time per step (sum of its blocks'
forward and backward means) should scale with 1/quota, and so should the capacity the planner
derives (median over layers). Writes out/cluster_accuracy/{accuracy.csv, accuracy.png,
profiles.csv, layers_<host>.json} and prints the tables.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from torchpp.cluster import cgroups, cluster  # noqa: E402
from torchpp.cluster.config import ClusterConfig  # noqa: E402
from torchpp.cluster.units import parse_rate  # noqa: E402
from torchpp.formats import Bandwidth  # noqa: E402

LOOP = """
import sys, time
T = float(sys.argv[1]); n = 0; t0 = time.perf_counter(); c0 = time.process_time()
while time.perf_counter() - t0 < T:
    for _ in range(20000):
        n += 1
print(n, time.perf_counter() - t0, time.process_time() - c0)
"""


def loop(seconds: float, preexec=None) -> tuple[int, float, float]:
    out = subprocess.run([sys.executable, "-c", LOOP, str(seconds)], capture_output=True, text=True, check=True,
                         preexec_fn=preexec, timeout=120).stdout.split()
    return int(out[0]), float(out[1]), float(out[2])


def cpu_ratio(quota: float, seconds: float, rounds: int = 3) -> float:
    """Median over alternating rounds of (iterations per wall-second under the quota) over
    (iterations per CPU-second, the better of the two loops': a whole core's speed)."""
    ratios = []
    for _ in range(rounds):
        n0, _, c0 = loop(seconds / 2)
        with cgroups.limited(f"bench-{os.getpid()}", cpu=quota) as g:
            n1, w1, c1 = loop(seconds, g.preexec)
        ratios.append((n1 / w1) / max(n0 / c0, n1 / max(c1, 1e-9)))
    return sorted(ratios)[rounds // 2]


def probe_rate(rate: str, tmp: Path, sizes: str = "64K,512K,2M,8M", budget_s: float = 12) -> tuple[float, float]:
    cfg_path = tmp / "bench.json"
    cfg_path.write_text(json.dumps({"name": "tpbench", "subnet": "10.77.98.0/24",
                                    "hosts": [{"name": "a", "rate": rate}, {"name": "b", "rate": rate}]}))
    cfg = ClusterConfig.load(cfg_path)
    cluster.up(cfg, log=lambda *_: None)
    try:
        rc, res = cluster.run(cfg.name, [sys.executable, "-m", "torchpp", "bandwidth", "probe", "--out-dir",
                                         str(tmp / rate), "--sizes", sizes, "--pair-budget", f"{budget_s:g}"],
                              tmp / "logs", timeout=300, log=lambda *_: None)
        if rc != 0:
            raise RuntimeError(cluster.tail(res[0].log) + cluster.tail(res[1].log))
    finally:
        cluster.down(cfg.name, log=lambda *_: None)
    bw = Bandwidth.load(tmp / rate / "bandwidth.json")
    return bw.rate("a", "b") * 8, bw.rate("b", "a") * 8


def profile_hosts(config: Path, out: Path, model: str, layers: int, seq_len: int, batch: int,
                  iters: int, period_ms: float | None = None) -> list[dict]:
    """Profile every host of ``config`` concurrently under its quota; compare with 1/quota."""
    import dataclasses

    from torchpp.formats import LayersFile
    from torchpp.planner.capacities import compute_capacities

    cfg = ClusterConfig.load(config)
    if cluster.load_state(cfg.name) is not None or cluster.leftovers(cfg.name)["namespaces"]:
        cfg = dataclasses.replace(cfg, name="tpacc")  # the same hosts, under a name nobody else uses
        print(f"profiles: cluster {ClusterConfig.load(config).name} is in use; its hosts run as cluster {cfg.name}")
    out.mkdir(parents=True, exist_ok=True)
    cluster.up(cfg, skip_netem=True, log=lambda *_: None)  # delays do not matter here
    try:
        if period_ms:
            for i, h in enumerate(cfg.hosts):  # same quota, finer slices: throttling stalls get shorter
                g = cgroups.existing(cfg.cgroup_name(i))
                g.set_cpu(h.cpu, period_us=int(period_ms * 1000))
        rc, res = cluster.run(cfg.name, [sys.executable, "-m", "torchpp", "profile", "--model", model, "--layers",
                                         str(layers), "--seq-len", str(seq_len), "--batch", str(batch), "--iters",
                                         str(iters), "--warmup", "2", "--quiet", "--host", "{host}", "--out",
                                         str(out / "layers_{host}.json")],
                              out / "profile_logs", timeout=600, log=lambda *_: None)
        if rc != 0:
            raise RuntimeError("\n".join(cluster.tail(r.log) for r in res))
    finally:
        cluster.down(cfg.name, log=lambda *_: None)
    files = [LayersFile.load(out / f"layers_{h.name}.json") for h in cfg.hosts]
    quota = {h.name: h.cpu for h in cfg.hosts}
    ref = max(cfg.hosts, key=lambda h: h.cpu).name
    caps = compute_capacities(files, ref).capacity
    compute = {f.host: sum(b.forward_time_s + b.backward_time_s for b in (f.embed, *f.layers, f.tail)) for f in files}
    rows = []
    for f in files:
        want = quota[f.host] / quota[ref]
        speed = compute[ref] / compute[f.host]
        rows.append({"host": f.host, "quota_cores": quota[f.host], "compute_s_per_step": round(compute[f.host], 4),
                     "compute_x_quota": round(compute[f.host] * quota[f.host], 4),
                     "speed_vs_ref": round(speed, 4), "quota_vs_ref": round(want, 4),
                     "speed_over_quota_ratio": round(speed / want, 4), "capacity_median_layer": round(caps[f.host], 4),
                     "capacity_over_quota_ratio": round(caps[f.host] / want, 4)})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quotas", default="0.25,0.5,0.8")
    p.add_argument("--rates", default="10mbit,50mbit,200mbit,1gbit")
    p.add_argument("--skip-links", action="store_true")
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--out", type=Path, default=ROOT / "out" / "cluster_accuracy")
    p.add_argument("--profile-config", type=Path, default=ROOT / "configs" / "cluster" / "hetero4.json",
                   help="cluster whose hosts are profiled at once (--skip-profiles to leave out)")
    p.add_argument("--skip-profiles", action="store_true")
    p.add_argument("--profile-model", default="qwen3-small")
    p.add_argument("--profile-layers", type=int, default=4)
    p.add_argument("--profile-iters", type=int, default=6)
    p.add_argument("--cfs-period-ms", type=float, default=None,
                   help="CFS period of the profiled hosts (default: the kernel's 100 ms)")
    p.add_argument("--quick", action="store_true", help="one quota for 0.5 s, one link, qwen3-tiny profiles of one "
                   "layer and 2 steps: checks that it runs, no measurement")
    args = p.parse_args(argv)
    if args.quick:
        args.quotas, args.rates, args.seconds = "0.5", "50mbit", 0.5
        args.profile_model, args.profile_layers, args.profile_iters = "qwen3-tiny", 1, 2
    os.environ["PYTHONPATH"] = str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")
    rows = []
    for q in (float(x) for x in args.quotas.split(",") if x):
        r = cpu_ratio(q, args.seconds)
        rows.append({"what": "cpu quota (cores)", "configured": q, "measured": round(r, 4),
                     "measured_over_configured": round(r / q, 4)})
        print(f"cpu {q:5.2f} cores: runs at {r:.3f} of a full core ({r / q:.3f} of the quota)", flush=True)
    with tempfile.TemporaryDirectory(prefix="torchpp-bench-") as d:
        for rate in [] if args.skip_links else args.rates.split(","):
            ab, ba = probe_rate(rate, Path(d), *(("64K,512K", 2) if args.quick else ()))
            want = parse_rate(rate)
            for direction, got in (("a->b", ab), ("b->a", ba)):
                rows.append({"what": f"link {direction} (Mbit/s)", "configured": want / 1e6,
                             "measured": round(got / 1e6, 3), "measured_over_configured": round(got / want, 4)})
            print(f"link {rate:>8}: probe {ab / 1e6:8.2f} / {ba / 1e6:8.2f} Mbit/s "
                  f"({ab / want:.3f} / {ba / want:.3f} of configured)", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.skip_profiles:
        prof = profile_hosts(args.profile_config, args.out, args.profile_model, args.profile_layers, 64, 2,
                             args.profile_iters, args.cfs_period_ms)
        with open(args.out / "profiles.csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(prof[0]))
            w.writeheader()
            w.writerows(prof)
        print(f"profiles of {args.profile_config.stem} ({args.profile_model}, {args.profile_layers} layers, "
              f"batch 2 x seq 64, {args.profile_iters} iters), all hosts at once, CFS period "
              f"{args.cfs_period_ms or 100:g} ms; reference = largest quota:")
        print(f"{'host':<10} {'quota':>6} {'compute/step':>13} {'x quota':>8} {'speed/ref':>10} {'quota/ref':>10} "
              f"{'ratio':>6} {'capacity':>9} {'ratio':>6}")
        for r in prof:
            print(f"{r['host']:<10} {r['quota_cores']:6.2f} {r['compute_s_per_step'] * 1e3:11.1f}ms "
                  f"{r['compute_x_quota'] * 1e3:6.1f}ms {r['speed_vs_ref']:10.3f} {r['quota_vs_ref']:10.3f} "
                  f"{r['speed_over_quota_ratio']:6.3f} {r['capacity_median_layer']:9.3f} "
                  f"{r['capacity_over_quota_ratio']:6.3f}", flush=True)
        for r in prof:
            rows.append({"what": f"profile speed {r['host']} (vs ref)", "configured": r["quota_vs_ref"],
                         "measured": r["speed_vs_ref"], "measured_over_configured": r["speed_over_quota_ratio"]})
    if not rows:
        return 0
    with open(args.out / "accuracy.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 3.5))
    labels = [f"{r['what'].split(' (')[0].replace('cpu quota', 'cpu')} {r['configured']:g}" for r in rows]
    ax.bar(range(len(rows)), [r["measured_over_configured"] for r in rows])
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(range(len(rows)), labels, rotation=45, ha="right", fontsize=8)
    ax.set_ylabel("measured / configured")
    ax.set_title("emulation accuracy (cgroup CPU quota, htb link rate via gloo probe)")
    fig.tight_layout()
    fig.savefig(args.out / "accuracy.png", dpi=120)
    print(f"wrote {args.out / 'accuracy.csv'} and accuracy.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
