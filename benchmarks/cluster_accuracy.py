"""How closely the emulation matches what it is configured to: CPU quotas and link rates.

    sudo python benchmarks/cluster_accuracy.py        # about 2 minutes

CPU: a CPU-bound loop's speed per wall-second inside a quota, over its speed per CPU-second
unthrottled (a whole core), measured back to back. Links: `torchpp bandwidth probe` (gloo
p2p) between two namespace hosts whose uplinks are shaped to each rate. Writes
out/cluster_accuracy/{accuracy.csv, accuracy.png} and prints the table.
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


def probe_rate(rate: str, tmp: Path) -> tuple[float, float]:
    cfg_path = tmp / "bench.json"
    cfg_path.write_text(json.dumps({"name": "tpbench", "subnet": "10.77.98.0/24",
                                    "hosts": [{"name": "a", "rate": rate}, {"name": "b", "rate": rate}]}))
    cfg = ClusterConfig.load(cfg_path)
    cluster.up(cfg, log=lambda *_: None)
    try:
        rc, res = cluster.run(cfg.name, [sys.executable, "-m", "torchpp", "bandwidth", "probe", "--out-dir",
                                         str(tmp / rate), "--sizes", "64K,512K,2M,8M", "--pair-budget", "12"],
                              tmp / "logs", timeout=300, log=lambda *_: None)
        if rc != 0:
            raise RuntimeError(cluster.tail(res[0].log) + cluster.tail(res[1].log))
    finally:
        cluster.down(cfg.name, log=lambda *_: None)
    bw = Bandwidth.load(tmp / rate / "bandwidth.json")
    return bw.rate("a", "b") * 8, bw.rate("b", "a") * 8


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quotas", default="0.25,0.5,0.8")
    p.add_argument("--rates", default="10mbit,50mbit,200mbit,1gbit")
    p.add_argument("--skip-links", action="store_true")
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--out", type=Path, default=ROOT / "out" / "cluster_accuracy")
    args = p.parse_args(argv)
    os.environ["PYTHONPATH"] = str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")
    rows = []
    for q in (float(x) for x in args.quotas.split(",")):
        r = cpu_ratio(q, args.seconds)
        rows.append({"what": "cpu quota (cores)", "configured": q, "measured": round(r, 4),
                     "measured_over_configured": round(r / q, 4)})
        print(f"cpu {q:5.2f} cores: runs at {r:.3f} of a full core ({r / q:.3f} of the quota)", flush=True)
    with tempfile.TemporaryDirectory(prefix="torchpp-bench-") as d:
        for rate in [] if args.skip_links else args.rates.split(","):
            ab, ba = probe_rate(rate, Path(d))
            want = parse_rate(rate)
            for direction, got in (("a->b", ab), ("b->a", ba)):
                rows.append({"what": f"link {direction} (Mbit/s)", "configured": want / 1e6,
                             "measured": round(got / 1e6, 3), "measured_over_configured": round(got / want, 4)})
            print(f"link {rate:>8}: probe {ab / 1e6:8.2f} / {ba / 1e6:8.2f} Mbit/s "
                  f"({ab / want:.3f} / {ba / want:.3f} of configured)", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
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
