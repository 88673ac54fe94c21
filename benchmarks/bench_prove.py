"""Prove it where it matters: a cluster that must collaborate, against fair baselines, in one run.

On the emulated ``homelab`` cluster (configs/cluster/homelab.json: an old laptop and three
Raspberry Pis; root) with ``qwen3-homelab``, which no single host can train with AdamW, this
measures in the same run, each strategy at its own best micro-batching:

* ``single``: the best single device, priced by the planner and run for real on its host, where
  the kernel's OOM killer stops it (one line says so);
* ``even``: torchpp's 1F1B on an even split (hosts in the cluster's order), at the micro-batch
  count the planner prices fastest for it;
* ``peer``: ``torch.distributed.pipelining`` on the same even split (bench_pipelining's peer
  runner, one process per host), every schedule in ``--peer-schedules`` at every micro-batch
  count in ``--peer-microbatches``; the fastest is its best;
* ``fsdp``: data parallelism with sharded state, torch's ``fully_shard`` (FSDP2) over gloo on CPU,
  one process per host, each decoder layer and the root sharded, the batch split evenly, each
  host's share in every micro-batch count of ``--fsdp-microbatches`` (a run that does not fit
  its host's memory says so);
* ``plan``: the torchpp plan; ``unbalanced``: the plan's stages with its fastest and slowest hosts
  swapped; ``replan``: re-planned from the unbalanced run's timelines;
* the lower bound: all work (forward, backward, optimizer) over all capacity, weights within
  memory (the planner's LP, torchpp/planner/bound.py).

Every trained plan is trained ``--repeats`` times (default 5), one run of each per round (the
machine's speed drifts over the bench's minutes; rounds spread that over every plan alike), each a
fresh run of 1 + 3 x ``--window`` steps: the first is warm-up, the rest three windows; a run's
step time is the median of its window medians, a plan's the median over its runs, whose range gives the spread (a
baseline run once: over its windows). Predicted vs measured step time (MAPE over the torchpp-run
plans), per stage (forward/backward, from ``torchpp analyze``, the first run) and peak memory per
rank (the median over the runs: one run's peak RSS moves by 10-30 MiB with the heap's layout).
Then each trained plan predicted again after one calibration run: from the files ``torchpp
replan`` corrects with each *other* plan's timelines (every ordered pair; a plan's own run never
predicts it). The load average is recorded next to every figure: the machine is shared; so is
how long a fixed workload took on it before each plan's runs against before the profile
(:class:`MachineSpeed`), a run whose every host went slower than profiled then shows why.
Writes ``results.json``, ``results.md`` and ``step_times.png`` into ``--out`` (default
benchmarks/results/bench_prove).

    sudo .venv/bin/python benchmarks/bench_prove.py [--window 2] [--peer-schedules 1F1B,GPipe]
    .venv/bin/python benchmarks/bench_prove.py --quick --local --out /tmp/prove --work /tmp/prove/work

``--quick``: the demo's quick sizes (qwen3-tiny, global batch 8) with its fewest measurements
(``DemoConfig.smoke``), every strategy once with one step per window, the peer's 1F1B and FSDP2 at
one micro-batching each, the cross-calibration on one run: checks that it runs, no measurement.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from torchpp.demo import (PY, Demo, DemoConfig, DemoError, RunResult, demo_hosts, price_fixed,  # noqa: E402
                          window_medians)

TARGETS = {"plan_vs_even": 1.5, "plan_vs_peer": 1.3, "plan_vs_bound": 1.5, "mape": 0.05, "memory": 0.10,
           "replan": 1.05}


def load() -> str:
    """The 1, 5 and 15 minute load averages, noted next to every figure."""
    return "load {:.2f} {:.2f} {:.2f}".format(*os.getloadavg())


class MachineSpeed:
    """Seconds per step of a fixed workload (the model cut to two layers: forward, backward and
    loss at ``batch`` × seq, one thread), timed in this process, outside every host's quota, while
    no host runs: before the profile and before each training run. The hosts share this machine
    with whatever else it runs; a run whose every host went faster or slower than profiled shows
    it here, and the report prints each run's speed beside its error."""

    def __init__(self, model: str, seq_len: int, batch: int = 4, seconds: float = 3.0):
        import torch

        from torchpp.models.presets import build_model

        self.torch, self.seconds = torch, seconds
        self.model = build_model(model, num_layers=2)
        vocab = int(self.model.config.vocab_size)
        self.ids = torch.randint(0, vocab, (batch, seq_len), generator=torch.Generator().manual_seed(0))
        self.at_profile: float | None = None

    def __call__(self) -> float:
        torch = self.torch
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        times: list[float] = []
        try:
            end = time.monotonic() + self.seconds
            while time.monotonic() < end or len(times) < 5:
                t = time.perf_counter()
                self.model(input_ids=self.ids, labels=self.ids).loss.backward()
                times.append(time.perf_counter() - t)
                self.model.zero_grad(set_to_none=True)
        finally:
            torch.set_num_threads(threads)
        return statistics.median(times[1:])


@dataclass
class Row:
    """One strategy's figures: measured windows (or why it did not run) and the prediction."""

    name: str
    detail: str
    windows_s: list[float] = field(default_factory=list)
    predicted_s: float | None = None
    note: str = ""
    load: str = ""
    memory_mib: list[dict] = field(default_factory=list)
    stage_errors: list[dict] = field(default_factory=list)
    peak_rss_mib: list[float] = field(default_factory=list)
    runs_s: list[float] = field(default_factory=list)
    """Each run's step time (the median of its window medians) where the plan ran several times."""
    machine_s: list[float] = field(default_factory=list)
    """:class:`MachineSpeed` before each of its runs."""
    now_errors: list[float] = field(default_factory=list)
    """Each run's error when predicted at the speed its hosts' speed checks read just before it."""
    speed_now: list[dict] = field(default_factory=list)
    """Each run's speed checks: per host, measured / profiled seconds per layer."""

    @property
    def median_s(self) -> float | None:
        xs = self.runs_s or self.windows_s
        return statistics.median(xs) if xs else None

    @property
    def spread(self) -> float | None:
        m, xs = self.median_s, self.runs_s if len(self.runs_s) > 1 else self.windows_s
        return (max(xs) - min(xs)) / m if m and len(xs) > 1 else None

    @property
    def error(self) -> float | None:
        m = self.median_s
        return (self.predicted_s - m) / m if m and self.predicted_s is not None else None

    @property
    def error_now(self) -> float | None:
        """The median over the runs of each run's error at launch (its own speed checks)."""
        return statistics.median(self.now_errors) if self.now_errors else None


# ----------------------------------------------------------------------------- workers (inside a host)
def worker(kind: str, setup: dict[str, Any], result_dir: Path, tag: str) -> None:
    """One rank of a peer or FSDP2 run, started on every host; rank and world from the environment."""
    import datetime
    import resource

    import torch.distributed as dist

    from bench_pipelining import PeerSteps, RssSampler, Setup

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    s = Setup(**setup)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=s.timeout_s))
    with RssSampler() as rss:
        runner = PeerSteps(s, rank, world) if kind == "peer" else FsdpSteps(s, rank, world)
        got = [runner.step(i) for i in range(s.warmup + s.steps)]
    hwm = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    out = {"rank": rank, "step_times_s": [t for t, _ in got], "losses": [x for _, x in got],
           "peak_rss_bytes": max(rss.peak, hwm), "host": os.environ.get("HOST", "")}
    (result_dir / f"{tag}_rank{rank}.json").write_text(json.dumps(out) + "\n")
    dist.destroy_process_group()


class FsdpSteps:
    """Sharded data parallelism: torch's ``fully_shard`` (FSDP2) on every decoder layer and the
    root, the global batch split evenly by rank, the same AdamW (torch's) and data as the others.
    Each rank's share runs as ``microbatches`` micro-batches, gradients reduce-scattered after
    each (so no rank ever holds unsharded gradients): fewer is faster, more needs less memory."""

    def __init__(self, s: Any, rank: int, world: int):
        import torch
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        from torchpp.data import SyntheticTokens
        from torchpp.models.presets import _causal_lm_class, load_config

        torch.set_num_threads(1)
        cfg = load_config(s.model, s.layers)
        with torch.device("meta"):  # FSDP2's way: no rank ever holds the whole model
            self.model = _causal_lm_class(cfg)(cfg)
        mesh = init_device_mesh("cpu", (world,))
        for layer in self.model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
        materialize(self.model, cfg, s.seed)
        self.model.train()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=s.lr, weight_decay=0.0)
        self.data = SyntheticTokens(vocab_size=int(cfg.vocab_size), seq_len=s.seq_len, global_batch=s.batch,
                                    seed=s.seed)
        per = s.batch // world
        self.rows, self.k = slice(rank * per, (rank + 1) * per), s.microbatches

    def step(self, index: int) -> tuple[float, float]:
        import torch
        import torch.distributed as dist

        ids = self.data.batch(index)[self.rows]
        t0 = time.perf_counter()
        total = 0.0
        for part in ids.chunk(self.k):
            loss = self.model(input_ids=part, labels=part).loss / self.k
            loss.backward()
            total += float(loss.detach())
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        v = torch.tensor([total], dtype=torch.float64)
        dist.all_reduce(v)
        return time.perf_counter() - t0, float(v[0]) / dist.get_world_size()


def materialize(model: Any, cfg: Any, seed: int) -> None:
    """Give a sharded meta-device model the preset's weights (the same per-name seeded init as
    ``build_model``, so every system trains from the same weights): each full tensor is made
    once and only this rank's shard kept; buffers (rotary frequencies) are rebuilt."""
    import torch
    from torch.distributed.tensor import distribute_tensor

    from torchpp.models.presets import _param_seed

    model.to_empty(device="cpu")
    std = float(getattr(cfg, "initializer_range", 0.02))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.rsplit(".", 1)[-1] == "bias":
                full = torch.zeros(p.shape)
            elif p.dim() == 1:
                full = torch.ones(p.shape)
            else:
                g = torch.Generator().manual_seed(_param_seed(seed, name))
                full = torch.randn(p.shape, generator=g, dtype=torch.float32) * std
            p.copy_(distribute_tensor(full, p.device_mesh, p.placements))
        rot = model.model.rotary_emb
        fresh = type(rot)(config=cfg)
        for name, b in fresh.named_buffers():
            getattr(rot, name).copy_(b)


# ----------------------------------------------------------------------------- the parent
def run_workers(demo: Demo, kind: str, setup: dict[str, Any], tag: str) -> Row:
    """Start ``kind`` on every host (one rank each) and read back rank 0's step times."""
    res = demo.path("workers")
    res.mkdir(parents=True, exist_ok=True)
    argv = [PY, str(Path(__file__).resolve()), "--worker", kind, "--setup", json.dumps(setup), "--result-dir",
            str(res), "--tag", tag]
    before = load()
    demo.p.total += 1
    try:
        demo.p.run(f"{tag}: {setup['steps'] + setup['warmup']} steps on every host", demo.hosts.probe(
            argv, demo.path("logs", tag)), timeout=900)
    except DemoError as e:
        from torchpp.demo import run_verdict

        why = run_verdict(demo.path("logs", tag, "run.json"), str(e))
        return Row(name=tag, detail=kind, note=f"did not run: {why}", load=before)
    ranks = [json.loads((res / f"{tag}_rank{r}.json").read_text()) for r in range(len(demo.hosts.names))]
    steps = ranks[0]["step_times_s"][setup["warmup"]:]
    return Row(name=tag, detail=kind, windows_s=window_medians(steps), load=f"{before} → {load()}",
               peak_rss_mib=[r["peak_rss_bytes"] / 2**20 for r in ranks])


@dataclass
class Trained:
    """A torchpp plan's runs so far (they are taken in rounds, see :func:`run`)."""

    name: str
    plan: Path
    detail: str
    results: list[RunResult] = field(default_factory=list)
    machine_s: list[float] = field(default_factory=list)
    before: str = ""

    def train(self, demo: Demo, meas: Any, speed: MachineSpeed | None) -> None:
        """One more run (traces, analyse; the first in ``runs/<name>``, the others in
        ``runs/<name>_run<i>``), with ``speed`` timed just before it."""
        self.before = self.before or load()
        if speed is not None:
            self.machine_s.append(speed())
        i = len(self.results)
        self.results.append(demo.train(self.name if i == 0 else f"{self.name}_run{i + 1}", self.plan, meas))

    def row(self) -> Row:
        res, r = self.results, self.results[0]
        rep = json.loads((Path(r.report).parent / "report.json").read_text())
        medians = [statistics.median(x.windows) for x in res]
        return Row(name=self.name, detail=self.detail, windows_s=[w for x in res for w in x.windows],
                   predicted_s=r.predicted_step_s, load=f"{self.before} → {load()}",
                   memory_mib=median_memory([x.memory_mib for x in res]), stage_errors=rep.get("stage_errors", []),
                   runs_s=medians if len(res) > 1 else [], machine_s=self.machine_s,
                   now_errors=[(x.predicted_now_s - m) / m for x, m in zip(res, medians) if x.predicted_now_s],
                   speed_now=[x.speed_now for x in res if x.speed_now])


def median_memory(runs: list[list[dict]]) -> list[dict]:
    """Per rank: the prediction, the median of the runs' measured peaks (each run's kept in
    ``measured_runs``) and the error against that median."""
    out = []
    for row in runs[0]:
        got = [x["measured"] for rs in runs for x in rs if x["rank"] == row["rank"]]
        m = statistics.median(got)
        out.append({**row, "measured": m, "measured_runs": got, "error": (row["predicted"] - m) / m})
    return out


def costs_of(meas: Any) -> Any:
    from torchpp.planner import api

    return api.load(api.PlanInputs(layers=list(meas.files), capacities=meas.capacities, bandwidth=meas.bandwidth,
                                   devices=meas.devices, memory_model=meas.memory))


def unbalanced_plan(demo: Demo, meas: Any) -> Path:
    """The plan's stages with the hosts of its fastest and slowest stage swapped (if that fits
    memory; else the even split in reverse host order): a run the re-plan must repair."""
    from torchpp.formats import Plan
    from torchpp.planner import api
    from torchpp.planner.simple import make_plan

    plan, costs = Plan.load(meas.plan), costs_of(meas)
    pb = SimpleNamespace(profiles=costs.profiles, links=costs.links, memory=costs.memory,
                         optimizer_s_per_byte=costs.optimizer_s_per_byte)
    hosts = [[d.host for d in s.devices] for s in plan.stages]
    cap = json.loads(meas.capacities.read_text())["capacity"]
    order = sorted(range(len(hosts)), key=lambda i: sum(cap.get(h, 1.0) for h in hosts[i]))
    swapped = list(hosts)
    swapped[order[0]], swapped[order[-1]] = hosts[order[-1]], hosts[order[0]]
    out = demo.path("unbalanced", "plan.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    cand = make_plan(plan.model, seq_len=plan.seq_len, global_batch=plan.global_batch,
                     num_microbatches=plan.num_microbatches, layer_ranges=[s.layers for s in plan.stages],
                     group_sizes=[len(h) for h in swapped], hosts=[h for g in swapped for h in g], strategy="manual")
    if len(hosts) < 2 or not api.price(cand, pb, costs.budget).fits:
        from torchpp.planner.simple import even_plan
        names = list(reversed(demo.hosts.names))
        cand = even_plan(plan.model, stages=len(names), hosts=names, seq_len=plan.seq_len,
                         global_batch=plan.global_batch, num_microbatches=plan.num_microbatches)
    cand.save(out)
    price_fixed(out, meas)
    return out


def peer_rows(demo: Demo, args: argparse.Namespace) -> list[Row]:
    """torch.distributed.pipelining on the even split, every schedule x micro-batch count asked for."""
    c = demo.cfg
    rows = []
    for sched in args.peer_schedules.split(","):
        for m in args.peer_microbatches:
            if c.global_batch % m:
                continue
            setup = dict(model=c.model, batch=c.global_batch, seq_len=c.seq_len, microbatches=m, steps=3 * args.window,
                         warmup=1, timeout_s=300.0, peer_schedule=sched)
            row = run_workers(demo, "peer", setup, f"peer_{sched}_m{m}")
            row.detail = f"torch.distributed.pipelining Schedule{sched}, even split, {m} x {c.global_batch // m}"
            rows.append(row)
    return rows


def fsdp_rows(demo: Demo, args: argparse.Namespace) -> list[Row]:
    """FSDP2 at every micro-batch count asked for (each micro-batch: a host's share / k samples)."""
    c, n = demo.cfg, len(demo.hosts.names)
    rows = []
    for k in args.fsdp_microbatches:
        if (c.global_batch // n) % k:
            continue
        setup = dict(model=c.model, batch=c.global_batch, seq_len=c.seq_len, microbatches=k,
                     steps=3 * args.fsdp_window, warmup=1, timeout_s=600.0)
        row = run_workers(demo, "fsdp", setup, f"fsdp_m{k}")
        row.detail = (f"torch fully_shard (FSDP2) over gloo, {c.global_batch // n} samples per host in {k} "
                      f"micro-batch(es)")
        rows.append(row)
    if rows and not any(r.windows_s for r in rows):
        rows.append(fsdp_unlimited(demo, args, n))
    return rows


def fsdp_unlimited(demo: Demo, args: argparse.Namespace, n: int) -> Row:
    """Where FSDP2 fits no host, how much it needs: the same ranks as local processes without
    memory limits (nor CPU quotas), one step after one warm-up, their peak RSS."""
    import subprocess

    c, k = demo.cfg, max(args.fsdp_microbatches)
    setup = dict(model=c.model, batch=c.global_batch, seq_len=c.seq_len, microbatches=k, steps=1, warmup=1,
                 timeout_s=300.0)
    res, tag = demo.path("workers"), "fsdp_unlimited"
    argv = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n), str(Path(__file__).resolve()),
            "--worker", "fsdp", "--setup", json.dumps(setup), "--result-dir", str(res), "--tag", tag]
    before = load()
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    files = [res / f"{tag}_rank{r}.json" for r in range(n)]
    if done.returncode != 0 or not all(f.exists() for f in files):
        return Row(name=tag, detail="FSDP2 without limits", note=f"failed too (exit {done.returncode})", load=before)
    peaks = [json.loads(f.read_text())["peak_rss_bytes"] / 2**20 for f in files]
    return Row(name=tag, detail=f"FSDP2, {n} local processes without memory limits or quotas, {k} micro-batch(es)",
               note=f"needs {min(peaks):.0f}-{max(peaks):.0f} MiB per rank (peak RSS), more than any host's limit; "
                    "not comparable for speed", load=before, peak_rss_mib=peaks)


def run(demo: Demo, args: argparse.Namespace) -> dict:
    """Every strategy of the module docstring, in one run on the same hosts. The torchpp plans are
    trained in rounds, one run of each per round (even, plan, unbalanced, then the re-plan once the
    first unbalanced run has given it), so a machine whose speed drifts over the bench's minutes
    weighs on every plan's median alike instead of on whichever ran last."""
    t0, start_load = time.monotonic(), load()
    demo.p.total += demo.steps_per_run * (4 * args.repeats - 3)  # four plans `repeats` times (the demo counts three once)
    speed = MachineSpeed(demo.cfg.model, demo.cfg.seq_len, seconds=0.2 if args.quick else 3.0)
    speed.at_profile = speed()
    meas = demo.measure_and_plan()
    rows = [single_row(demo, meas)]
    even = demo.even_plan(meas.plan, meas)
    bad = unbalanced_plan(demo, meas)
    plans = {n: Trained(n, p, d) for n, p, d in (
        ("even", even, "torchpp 1F1B, even split"), ("plan", meas.plan, "torchpp plan"),
        ("unbalanced", bad, "plan's stages, fastest and slowest hosts swapped"))}
    for t in plans.values():
        t.train(demo, meas, speed)
    replanned = demo.replan(_result_of(demo, "unbalanced", bad), meas)
    plans["replan"] = Trained("replan", replanned, "re-planned from the unbalanced run")
    plans["replan"].train(demo, meas, speed)
    baselines = peer_rows(demo, args)
    baselines += fsdp_rows(demo, args) if not args.skip_fsdp else [Row(name="fsdp", detail="FSDP2", note="skipped")]
    for _ in range(args.repeats - 1):
        for t in plans.values():
            t.train(demo, meas, speed)
    rows += [plans["even"].row(), *baselines, *(plans[n].row() for n in ("plan", "unbalanced", "replan"))]
    runs = {"even": even, "plan": meas.plan, "unbalanced": bad, "replan": replanned}
    calibrated = cross_calibrated(demo, meas, runs, {r.name: r.median_s for r in rows if r.name in runs},
                                  "unbalanced" if args.quick else None)
    from torchpp.formats import Plan

    plan = Plan.load(meas.plan)
    bound = Row(name="bound", detail="all work incl. the optimizer / all capacity", predicted_s=plan.predicted["lower_bound_s"])
    for r in rows:
        r.detail = r.detail + describe(demo, r.name)
    return {"mode": demo.hosts.mode, "hosts": demo.hosts.names, "config": asdict(demo.cfg), "rows": [
        {**asdict(r), "median_s": r.median_s, "spread": r.spread, "error": r.error, "error_now": r.error_now}
        for r in rows + [bound]],
            "calibrated": calibrated, "repeats": args.repeats, "machine_at_profile_s": speed.at_profile,
            "load_start": start_load, "load_end": load(),
            "seconds": time.monotonic() - t0,
            "plan_stages": [{"layers": s.layers, "hosts": [d.host for d in s.devices], "embed": s.has_embed,
                             "tail": s.has_tail} for s in plan.stages],
            "plan_microbatches": [plan.num_microbatches, plan.micro_batch_size],
            "gap_to_bound": plan.predicted.get("gap_to_bound"),
            "capacities": {k: v for k, v in json.loads(meas.capacities.read_text()).items()
                           if k in ("capacity", "rounds")}}


def cross_calibrated(demo: Demo, meas: Any, runs: dict[str, Path], measured: dict[str, float | None],
                     on: str | None = None) -> list[dict]:
    """Each trained plan predicted from the files `torchpp replan` corrects with *another* plan's
    timelines (the loop's "look and re-plan" step, never the plan's own run): every ordered pair
    (``on``: only the pairs calibrated on that run). A prediction from the profile alone is the
    table's; this is what one measured run buys."""
    import glob

    out = []
    demo.p.total += len(runs) * len(runs)
    for y, plan_y in (runs if on is None else {on: runs[on]}).items():
        d = demo.path("calibrated", y)
        demo.p.run(f"calibrate on the {y} run (torchpp replan)",
                   [*demo.tp, "replan", "--plan", str(plan_y), "--traces", str(demo.path("runs", y, "traces")),
                    "--layers", *map(str, meas.files), "--capacities", str(meas.capacities), "--bandwidth",
                    str(meas.bandwidth), "--memory-model", str(meas.memory), "--devices", str(meas.devices),
                    "--out-dir", str(d)])
        layers = sorted(glob.glob(str(d / "layers_*.json")))
        for x, plan_x in runs.items():
            if x == y or not measured.get(x):
                continue
            text = demo.p.run(f"predict {x} from the {y} run's corrected files",
                              [*demo.tp, "simulate", "plan", str(plan_x), "--bandwidth", str(d / "bandwidth.json"),
                               "--layers", *layers, "--comm", "links", "--trace", str(d / f"predicted_{x}.json")])
            pred = next(float(t.split()[3]) for t in text.splitlines() if t.startswith("predicted step time"))
            out.append({"plan": x, "calibrated_on": y, "predicted_s": pred, "measured_s": measured[x],
                        "error": (pred - measured[x]) / measured[x]})
    return out


def describe(demo: Demo, name: str) -> str:
    """`` (m x b)`` for a trained plan: its micro-batching."""
    from torchpp.formats import Plan

    p = demo.path(name, "plan.json")
    if name in ("even", "plan", "unbalanced", "replan") and p.exists():
        q = Plan.load(p)
        return f" ({q.num_stages} stage(s), {q.num_microbatches} x {q.micro_batch_size})"
    return ""


def _result_of(demo: Demo, name: str, plan: Path) -> RunResult:
    """The demo's record of a finished run (what replan reads: its plan and its timelines)."""
    d = demo.path("runs", name)
    return RunResult(name=name, plan=str(plan), measured_step_s=0.0, predicted_step_s=None, steps_s=[],
                     report=str(d / "report" / "report.md"), trace_dir=str(d / "traces"))


def single_row(demo: Demo, meas: Any) -> Row:
    """The best single device as the planner prices it, confirmed by a real run where it does not fit."""
    got = next((b for b in demo.baselines(meas) if b.name.startswith("single")), None)
    if got is None:
        return Row(name="single", detail="best single device", note="not priced")
    note = got.note or ("fits" if got.fits else "does not fit (planner)")
    return Row(name="single", detail=f"best single device: {got.name}", predicted_s=got.predicted_step_s,
               note=f"planner: {got.memory}; real run: {note}", load=load())


# ----------------------------------------------------------------------------- the report
def verdicts(summary: dict) -> dict[str, Any]:
    """The targets, each with its measured ratio (None where a side did not run)."""
    rows = {r["name"]: r for r in summary["rows"]}
    med = lambda n: (rows.get(n) or {}).get("median_s")  # noqa: E731
    best_of = lambda prefix: min((r for r in summary["rows"] if r["name"].startswith(prefix) and r["median_s"]),  # noqa: E731
                                 key=lambda r: r["median_s"], default=None)
    peer, fsdp = best_of("peer_"), best_of("fsdp")
    plan, best = med("plan"), min(x for x in (med("plan"), med("replan")) if x) if med("plan") else None
    ratio = lambda a, b: a / b if a and b else None  # noqa: E731
    runs = [r for r in summary["rows"] if r["name"] in ("even", "plan", "unbalanced", "replan") and r["error"] is not None]
    mem = [abs(x["error"]) for r in runs for x in r["memory_mib"]]
    return {"plan_vs_even": ratio(med("even"), plan), "plan_vs_peer": ratio(peer and peer["median_s"], plan),
            "peer_best": peer and peer["name"], "plan_vs_fsdp": ratio(fsdp and fsdp["median_s"], plan),
            "fsdp_best": fsdp and fsdp["name"],
            "fsdp_note": next((r["note"] for r in reversed(summary["rows"]) if r["name"].startswith("fsdp")), ""),
            "plan_vs_bound": ratio(plan, rows["bound"]["predicted_s"]), "gap_to_bound": summary.get("gap_to_bound"),
            "mape": statistics.fmean(abs(r["error"]) for r in runs) if runs else None, "mape_plans": len(runs),
            "mape_now": (statistics.fmean(abs(r["error_now"]) for r in now) if (now := [
                r for r in runs if r.get("error_now") is not None]) else None), "mape_now_plans": len(now),
            "machine_slowdown": [machine_slowdown(summary, r) for r in runs],
            "mape_calibrated": (statistics.fmean(abs(c["error"]) for c in summary.get("calibrated", []))
                                if summary.get("calibrated") else None),
            "calibrated_plans": len({c["plan"] for c in summary.get("calibrated", [])}),
            "memory_max": max(mem) if mem else None, "memory_mean": statistics.fmean(mem) if mem else None,
            "replan_vs_best": ratio(med("replan"), best)}


def machine_slowdown(summary: dict, row: dict) -> float | None:
    """How much longer :class:`MachineSpeed`'s step took before the row's runs (their median)
    than before the profile: 1.10 = the machine itself ran 10% slower."""
    ref, xs = summary.get("machine_at_profile_s"), row.get("machine_s") or []
    return statistics.median(xs) / ref if ref and xs else None


def fmt(x: float | None, spec: str = ".3f", none: str = "–") -> str:
    return none if x is None else format(x, spec)


def report(summary: dict, out: Path) -> str:
    v = summary["verdicts"] = verdicts(summary)
    plan = next(r["median_s"] for r in summary["rows"] if r["name"] == "plan")
    lines = [f"# bench_prove on {summary['mode']} ({', '.join(summary['hosts'])})", "",
             f"{summary['config']['model']}, seq {summary['config']['seq_len']}, global batch "
             f"{summary['config']['global_batch']}; {summary['load_start']} at the start, {summary['load_end']} at the "
             f"end (2 cores, shared); {summary['seconds']:.0f} s in all. A run's step: the median of its 3 window "
             f"medians; a torchpp plan: the median of its {summary.get('repeats', 1)} run(s), spread = (slowest - "
             "fastest run) / median; a baseline (one run): spread over its windows. Peak memory: the median over "
             "the runs (each run's in brackets).", "",
             "| strategy | what | median step (s) | spread | predicted (s) | error | error at launch | vs plan | "
             "machine vs profile | load during | note |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in summary["rows"]:
        vs = fmt(r["median_s"] / plan, ".2f") + "x" if r["median_s"] and plan else (
            fmt(r["predicted_s"] / plan, ".2f") + "x (pred.)" if r["predicted_s"] and plan else "–")
        lines.append(f"| {r['name']} | {r['detail']} | {fmt(r['median_s'])} | {fmt(r['spread'] and 100 * r['spread'], '.0f')}"
                     f"{'%' if r['spread'] is not None else ''} | {fmt(r['predicted_s'])} | "
                     f"{fmt(r['error'] and 100 * r['error'], '+.1f')}{'%' if r['error'] is not None else ''} | "
                     f"{fmt(r.get('error_now') and 100 * r['error_now'], '+.1f')}"
                     f"{'%' if r.get('error_now') is not None else ''} | {vs} | "
                     f"{machine_cell(summary, r)} | {r['load']} | {r['note']} |")
    cap = summary.get("capacities") or {}
    if cap.get("capacity"):
        rounds = cap.get("rounds") or []
        lines += ["", "Capacities (of the first host" + (f"; the median of {len(rounds)} rounds of speed profiles, "
                  "each round's shown after it" if rounds else "") + "): " + ", ".join(
                      f"{h} {c:.3f}" + (" (" + "/".join(fmt(r.get(h), ".3f") for r in rounds) + ")" if rounds else "")
                      for h, c in cap["capacity"].items()) + "."]
    lines += ["", "## Targets", "", *target_lines(v), ""]
    if summary.get("calibrated"):
        lines += ["## Predicted after one calibration run", "",
                  "Each plan priced (`torchpp simulate plan`) from the files `torchpp replan` corrected with another "
                  "plan's timelines; rows: the plan predicted, columns: the run calibrated on.", ""]
        names = list(dict.fromkeys(c["plan"] for c in summary["calibrated"]))
        ons = list(dict.fromkeys(c["calibrated_on"] for c in summary["calibrated"]))
        cell = {(c["plan"], c["calibrated_on"]): c for c in summary["calibrated"]}
        lines += ["| plan (measured s) | " + " | ".join(f"on {y}" for y in ons) + " |",
                  "|---|" + "---|" * len(ons)]
        for x in names:
            m = next(c["measured_s"] for c in summary["calibrated"] if c["plan"] == x)
            lines.append(f"| {x} ({m:.3f}) | " + " | ".join(
                f"{cell[x, y]['predicted_s']:.3f} ({100 * cell[x, y]['error']:+.1f}%)" if (x, y) in cell else "–"
                for y in ons) + " |")
        lines.append("")
    lines += ["## Per stage and per rank (torchpp runs)", ""]
    for r in summary["rows"]:
        if r["memory_mib"]:
            mem = ", ".join(f"r{x['rank']} {x['predicted']:.0f}/{x['measured']:.0f} MiB ({100 * x['error']:+.0f}%"
                            + (" [" + ", ".join(f"{y:.0f}" for y in x["measured_runs"]) + "]"
                               if len(x.get("measured_runs", [])) > 1 else "") + ")"
                            for x in r["memory_mib"])
            st = ", ".join(f"s{x['stage']} F {fmt(x['forward_error'] and 100 * x['forward_error'], '+.0f')}% "
                           f"B {fmt(x['backward_error'] and 100 * x['backward_error'], '+.0f')}%" for x in r["stage_errors"])
            lines.append(f"- {r['name']}: peak memory predicted/measured {mem}; stage compute error {st or '–'}")
            if r.get("speed_now"):
                hosts = list(r["speed_now"][0])
                lines.append(f"  - speed checks before its runs (measured / profiled, run by run): " + ", ".join(
                    f"{h} " + "/".join(f"{x.get(h, float('nan')):.2f}" for x in r["speed_now"]) for h in hosts))
        elif r["peak_rss_mib"]:
            lines.append(f"- {r['name']}: peak RSS per rank " + ", ".join(f"{x:.0f}" for x in r["peak_rss_mib"]) + " MiB")
    text = "\n".join(lines)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.md").write_text(text + "\n")
    (out / "results.json").write_text(json.dumps(summary, indent=1) + "\n")
    chart(summary, out / "step_times.png")
    return text


def machine_cell(summary: dict, row: dict) -> str:
    """``+7% slower`` style: the machine before the row's runs against before the profile."""
    k = machine_slowdown(summary, row)
    return "–" if k is None else f"{100 * abs(k - 1):.0f}% {'slower' if k >= 1 else 'faster'}"


def target_lines(v: dict) -> list[str]:
    t = TARGETS
    ok = lambda good: "met" if good else "MISSED"  # noqa: E731
    pct = lambda x: fmt(x and 100 * x, ".1f") + "%"  # noqa: E731
    out = []
    for key, label, want in (("plan_vs_even", "plan faster than the even 1F1B split", t["plan_vs_even"]),
                             ("plan_vs_peer", f"plan faster than the peer's best ({v['peer_best']})", t["plan_vs_peer"])):
        out.append(f"- {label}: {fmt(v[key], '.2f')}x (target ≥ {want}x: "
                   f"{ok(v[key] is not None and v[key] >= want)})")
    out.append(f"- plan / lower bound: {fmt(v['plan_vs_bound'], '.2f')} (target ≤ {t['plan_vs_bound']}: "
               f"{ok(v['plan_vs_bound'] is not None and v['plan_vs_bound'] <= t['plan_vs_bound'])})")
    if v.get("gap_to_bound"):
        from torchpp.planner.gap import Gap

        out.append(f"  - the plan's predicted step above the bound (each part taken out of the same replay in turn): "
                   f"{Gap(**v['gap_to_bound']).line()}")
    if v["plan_vs_fsdp"] is None:
        out.append(f"- plan faster than sharded DP (FSDP2): FSDP2 could not run here: {v['fsdp_note']}")
    else:
        out.append(f"- plan faster than sharded DP (FSDP2, {v['fsdp_best']}): {fmt(v['plan_vs_fsdp'], '.2f')}x "
                   f"(target > 1: {ok(v['plan_vs_fsdp'] > 1)})")
    out.append(f"- step-time MAPE over {v['mape_plans']} plans: {pct(v['mape'])} (target ≤ 5% over ≥ 4: "
               f"{ok(v['mape'] is not None and v['mape'] <= t['mape'] and v['mape_plans'] >= 4)})")
    if v.get("mape_now") is not None:
        out.append(f"- step-time MAPE at launch (each run predicted at the speed its hosts' `torchpp speed-check` read "
                   f"just before it), over {v['mape_now_plans']} plans: {pct(v['mape_now'])} (target ≤ 5% over ≥ 4: "
                   f"{ok(v['mape_now'] <= t['mape'] and v['mape_now_plans'] >= 4)})")
    if v.get("mape_calibrated") is not None:
        out.append(f"- step-time MAPE after one calibration run (each of {v['calibrated_plans']} plans predicted from "
                   f"`torchpp replan`'s files fitted on each other plan's run): {pct(v['mape_calibrated'])} "
                   f"(target ≤ 5%: {ok(v['mape_calibrated'] <= t['mape'] and v['calibrated_plans'] >= 4)})")
    out.append(f"- peak memory per rank: max |error| {pct(v['memory_max'])}, mean {pct(v['memory_mean'])} "
               f"(target ≤ 10%: {ok(v['memory_max'] is not None and v['memory_max'] <= t['memory'])})")
    out.append(f"- re-plan / best of plan and re-plan: {fmt(v['replan_vs_best'], '.3f')} (target ≤ {t['replan']}: "
               f"{ok(v['replan_vs_best'] is not None and v['replan_vs_best'] <= t['replan'])})")
    return out


def chart(summary: dict, path: Path) -> None:
    """Median step per strategy with its window range, predictions as markers, the bound as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in summary["rows"] if r["median_s"] or r["predicted_s"]]
    rows = [r for r in rows if r["name"] != "bound"]
    bound = next(r["predicted_s"] for r in summary["rows"] if r["name"] == "bound")
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(rows)), 4))
    xs = range(len(rows))
    meds = [r["median_s"] or 0 for r in rows]
    lo = [m - min(r["windows_s"]) if r["windows_s"] else 0 for m, r in zip(meds, rows)]
    hi = [max(r["windows_s"]) - m if r["windows_s"] else 0 for m, r in zip(meds, rows)]
    ax.bar(xs, meds, yerr=[lo, hi], capsize=3, color=["C2" if r["name"] in ("plan", "replan") else "C0" for r in rows],
           label="measured (median; bars: window range)")
    ax.scatter([x for x, r in zip(xs, rows) if r["predicted_s"]], [r["predicted_s"] for r in rows if r["predicted_s"]],
               color="k", marker="_", s=300, zorder=3, label="predicted")
    ax.axhline(bound, color="C3", ls="--", lw=1, label="lower bound")
    ax.set_xticks(list(xs), [r["name"] for r in rows], rotation=30, ha="right")
    ax.set_ylabel("step time (s)")
    ax.set_title(f"{summary['config']['model']} on {summary['mode']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "bench_prove")
    ap.add_argument("--work", type=Path, default=Path("out/bench_prove"), help="profiles, plans, traces, logs")
    ap.add_argument("--window", type=int, default=2, help="steps per window; 3 windows after one warm-up step")
    ap.add_argument("--repeats", type=int, default=5, help="runs of each torchpp plan (fresh processes): one run "
                    "of a plan moves by ~10%% with the machine, the median of 5 by about half that")
    ap.add_argument("--fsdp-window", type=int, default=1, help="steps per FSDP2 window (its steps are slow)")
    ap.add_argument("--peer-schedules", default="1F1B,GPipe")
    ap.add_argument("--peer-microbatches", type=lambda t: [int(x) for x in t.split(",")], default=[8, 16])
    ap.add_argument("--fsdp-microbatches", type=lambda t: [int(x) for x in t.split(",")], default=[1, 4],
                    help="micro-batches per host's share of the batch, each tried")
    ap.add_argument("--skip-fsdp", action="store_true")
    ap.add_argument("--no-speed-check", action="store_true", help="no `torchpp speed-check` before each torchpp run "
                    "(then no prediction at launch)")
    ap.add_argument("--local", action="store_true", help="local processes instead of the emulated cluster")
    ap.add_argument("--quick", action="store_true", help="the demo's quick sizes, every strategy once, one step per "
                    "window, one micro-batching of each baseline: checks that it runs, no measurement")
    ap.add_argument("--worker", choices=["peer", "fsdp"], default=None, help=argparse.SUPPRESS)
    ap.add_argument("--setup", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--result-dir", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--tag", default="", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.worker:
        worker(a.worker, json.loads(a.setup), a.result_dir, a.tag)
        return 0
    if a.quick:
        a.window, a.repeats, a.fsdp_window, a.peer_schedules = 1, 1, 1, "1F1B"
        a.peer_microbatches, a.fsdp_microbatches = [2], [1]
        cfg = replace(DemoConfig.smoke(), cluster=DemoConfig().cluster, steps=1 + 3 * a.window)
    else:
        cfg = DemoConfig(steps=1 + 3 * a.window, speed_check=not a.no_speed_check)
    a.work.mkdir(parents=True, exist_ok=True)
    try:
        with demo_hosts(cfg, a.work, a.local, 2) as demo:
            summary = run(demo, a)
    except DemoError as e:
        print(f"bench_prove: {e}", file=sys.stderr)
        return 1
    print("\n" + report(summary, a.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
