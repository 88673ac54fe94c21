"""torchpp's 1F1B against `torch.distributed.pipelining.Schedule1F1B` and single-process training.

    python benchmarks/bench_pipelining.py              # qwen3-small, batch 16 x 128, 8 micro-batches, 2 and 4 ranks
    python benchmarks/bench_pipelining.py --quick      # qwen3-tiny, small batch: a minute or two

One run measures, on this machine, with gloo on CPU and one torch thread per rank:

* ``single``: plain HF training of the whole model on the whole batch in one process;
* ``torchpp``: ``torchpp.runtime`` training an even split (p stages, one rank each, 1F1B);
* ``peer``: the same split with ``torch.distributed.pipelining``: every rank builds the whole
  model, drops what its stage does not own, wraps the rest in a ``PipelineStage`` and runs
  ``Schedule1F1B`` with the same loss; the tied embedding's gradient is summed between the
  first and the last stage as torchpp does (the library does not tie weights across stages);
* the block profile of the model (``torchpp.profiling``, one micro-batch, one thread), from
  which the pipeline bound ``(m + p - 1) x max over stages of (forward + backward per
  micro-batch)`` is computed for each split.

Every configuration runs in freshly launched processes (one per rank, env:// rendezvous on
loopback, bounded by --timeout-s, killed if they overrun), so each rank's memory figures are
its own: peak RSS sampled with psutil every 20 ms while it runs, and the kernel's high-water
mark. Configurations alternate between repeats (torchpp, peer, then peer, torchpp) so drifting
machine load hits both alike; step times are the median over all measured steps of all
repeats (steps after --warmup of each run), as rank 0 timed them (each step ends with an
all-reduce on both systems, so rank 0's time is the pipeline's). All three systems train
from the same weights on the same data; their losses are compared as a check.

Writes into --out: ``results.csv``, ``results.json`` (with the block profile and the load
average), ``step_times.png`` and the ranks' logs.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

SYSTEMS = ("single", "torchpp", "peer")


@dataclass(kw_only=True)
class Setup:
    """What every system trains: the same model, batch, micro-batches, seed and optimizer."""

    model: str = "qwen3-small"
    layers: int | None = None
    batch: int = 16
    seq_len: int = 128
    microbatches: int = 8
    steps: int = 6
    """Measured optimizer steps per run (after --warmup)."""
    warmup: int = 2
    seed: int = 0
    lr: float = 1e-3
    timeout_s: float = 120.0

    @property
    def micro_batch_size(self) -> int:
        return self.batch // self.microbatches


def even_split(num_layers: int, p: int) -> list[tuple[int, int]]:
    """Decoder layers in p contiguous ranges of equal size (the first ranges take any remainder)."""
    q, r = divmod(num_layers, p)
    out, a = [], 0
    for i in range(p):
        b = a + q + (1 if i < r else 0)
        out.append((a, b))
        a = b
    return out


# ----------------------------------------------------------------------------- inside a rank
class RssSampler:
    """Largest resident set size of this process, sampled with psutil every ``period_s``."""

    def __init__(self, period_s: float = 0.02):
        import psutil

        self.proc, self.period_s, self.peak = psutil.Process(), period_s, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            self._stop.wait(self.period_s)

    def __enter__(self) -> "RssSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.proc.memory_info().rss)


@dataclass
class RankResult:
    system: str
    ranks: int
    rank: int
    step_times_s: list[float]
    losses: list[float]
    peak_rss_bytes: int
    hwm_bytes: int
    """The kernel's high-water mark of the resident set (getrusage ru_maxrss)."""


def _run_single(s: Setup) -> tuple[list[float], list[float]]:
    """Plain HF training of the whole model on the whole batch."""
    import torch

    from torchpp.data import SyntheticTokens
    from torchpp.models.presets import build_model

    model = build_model(s.model, seed=s.seed, num_layers=s.layers)
    opt = torch.optim.AdamW(model.parameters(), lr=s.lr, weight_decay=0.0)
    data = SyntheticTokens(vocab_size=model.config.vocab_size, seq_len=s.seq_len, global_batch=s.batch, seed=s.seed)
    times, losses = [], []
    for step in range(s.warmup + s.steps):
        ids = data.batch(step)
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        losses.append(float(loss))
    return times, losses


def _run_torchpp(s: Setup, plan: Path) -> tuple[list[float], list[float]]:
    from torchpp.runtime.trainer import TrainConfig, train

    cfg = TrainConfig(plan=plan, steps=s.warmup + s.steps, lr=s.lr, seed=s.seed, threads=1, timeout_s=s.timeout_s,
                      layers=s.layers)
    summary = train(cfg)
    return summary.step_times_s, summary.losses


def _run_peer(s: Setup, rank: int, world: int) -> tuple[list[float], list[float]]:
    """``torch.distributed.pipelining``: whole model on every rank, sliced, ``Schedule1F1B``."""
    import datetime
    import gc

    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from torchpp.data import SyntheticTokens
    from torchpp.models.presets import build_model, load_config
    from torchpp.models.stages import Stage, StagePaths, StageSpec, _get, _set, count_targets

    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=s.timeout_s)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
    try:
        cfg = load_config(s.model, s.layers)
        model = build_model(s.model, seed=s.seed, config=cfg)  # the whole model, as the library's examples do
        parts = StagePaths.of(model)
        n = int(cfg.num_hidden_layers)
        a, b = even_split(n, world)[rank]
        first, last = rank == 0, rank == world - 1
        layers = _get(model, parts.layers)
        for i in range(n):
            if not a <= i < b:
                layers[i] = nn.Module()
        if not first:
            for p in parts.embed:
                _set(model, p, None)
        if not last:
            _set(model, parts.norm, None)
            _set(model, parts.lm_head, None)
        gc.collect()
        # The same per-stage compute as torchpp (positions, masks, rotary per stage); the tail returns
        # logits and the schedule applies the loss.
        stage = Stage(model, cfg, StageSpec(layers=(a, b), has_embed=first, has_tail=False, num_stages=world), parts)

        class Part(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.hf = model

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                h = stage.forward(x)
                return stage.logits(h) if last else h

        part = Part()
        pstage = PipelineStage(part, rank, world, torch.device("cpu"))
        sched = Schedule1F1B(pstage, s.microbatches,
                             loss_fn=lambda logits, target: Stage.loss(logits, target, count_targets(target)))
        params = [p for p in part.parameters()]
        opt = torch.optim.AdamW(params, lr=s.lr, weight_decay=0.0)
        tied = None
        if getattr(cfg, "tie_word_embeddings", False):
            tied = _get(model, parts.token).weight if first else (_get(model, parts.lm_head).weight if last else None)
        tied_group = dist.new_group([0, world - 1], timeout=timeout)
        data = SyntheticTokens(vocab_size=int(cfg.vocab_size), seq_len=s.seq_len, global_batch=s.batch, seed=s.seed)
        times, losses = [], []
        for step in range(s.warmup + s.steps):
            ids = data.batch(step) if first or last else None
            t0 = time.perf_counter()
            mb_losses: list[torch.Tensor] = []
            if first:
                sched.step(ids, return_outputs=False)
            elif last:
                sched.step(target=ids, losses=mb_losses, return_outputs=False)
            else:
                sched.step(return_outputs=False)
            if tied is not None:
                g = tied.grad if tied.grad is not None else torch.zeros_like(tied)
                dist.all_reduce(g, group=tied_group)
                tied.grad = g
            opt.step()
            opt.zero_grad(set_to_none=True)
            v = torch.zeros(1, dtype=torch.float64)
            if last:
                v[0] = float(sum(float(x) for x in mb_losses)) / s.microbatches
            dist.all_reduce(v)
            times.append(time.perf_counter() - t0)
            losses.append(float(v[0]))
        return times, losses
    finally:
        dist.destroy_process_group()


def worker(spec_path: Path) -> None:
    spec = json.loads(spec_path.read_text())
    s = Setup(**spec["setup"])
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    with RssSampler() as rss:
        if spec["system"] == "single":
            times, losses = _run_single(s)
        elif spec["system"] == "torchpp":
            times, losses = _run_torchpp(s, Path(spec["plan"]))
        else:
            times, losses = _run_peer(s, rank, world)
    hwm = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    res = RankResult(system=spec["system"], ranks=world, rank=rank, step_times_s=times, losses=losses,
                     peak_rss_bytes=rss.peak, hwm_bytes=hwm)
    Path(spec["result"].format(rank=rank)).write_text(json.dumps(asdict(res)))


# ----------------------------------------------------------------------------- the parent
def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(system: str, world: int, s: Setup, out: Path, tag: str, plan: Path | None) -> list[RankResult]:
    """Run one configuration in ``world`` fresh processes; kill them all if any fails or overruns."""
    runs = out / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    spec = runs / f"{tag}.json"
    result = runs / f"{tag}_rank{{rank}}.result.json"
    spec.write_text(json.dumps({"system": system, "setup": asdict(s), "plan": str(plan) if plan else None,
                                "result": str(result)}))
    port = _free_port()
    procs: list[subprocess.Popen] = []
    logs = []
    deadline = time.monotonic() + s.timeout_s + 60 + 10 * (s.warmup + s.steps) * 3
    try:
        for r in range(world):
            env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(world),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1",
                       PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
            log = open(runs / f"{tag}_rank{r}.log", "w")
            logs.append(log)
            procs.append(subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--worker", str(spec)],
                                          env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT))
        while any(p.poll() is None for p in procs):
            if any(p.poll() not in (None, 0) for p in procs):
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"{tag}: ranks still running after the deadline; killed (logs in {runs})")
            time.sleep(0.1)
        bad = [(r, p.returncode) for r, p in enumerate(procs) if p.poll() not in (None, 0)]
        if bad:
            r = bad[0][0]
            tail = (runs / f"{tag}_rank{r}.log").read_text()[-3000:]
            raise RuntimeError(f"{tag}: rank {r} exited with code {bad[0][1]}:\n{tail}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        for log in logs:
            log.close()
    return [RankResult(**json.loads(Path(str(result).format(rank=r)).read_text())) for r in range(world)]


def profile(s: Setup):
    """Per-block forward/backward time of one micro-batch (torchpp.profiling, one thread)."""
    from torchpp.profiling.measure import ProfileConfig, measure_layers

    return measure_layers(ProfileConfig(model=s.model, seq_len=s.seq_len, batch=s.micro_batch_size, threads=1,
                                        iters=max(3, s.steps), warmup=2, num_layers=s.layers, seed=s.seed))


def stage_costs(lf, ranges: list[tuple[int, int]]) -> list[float]:
    """Forward + backward seconds per micro-batch of each stage, from the block profile."""
    fb = lambda b: b.forward_time_s + b.backward_time_s  # noqa: E731
    out = []
    for i, (a, b) in enumerate(ranges):
        c = sum(fb(lf.layers[j]) for j in range(a, b))
        if i == 0:
            c += fb(lf.embed)
        if i == len(ranges) - 1:
            c += fb(lf.tail)
        out.append(c)
    return out


@dataclass
class Row:
    system: str
    ranks: int
    step_s: float
    """Median measured step time (rank 0)."""
    step_mean_s: float
    steps: int
    vs_peer: float | None = None
    vs_bound: float | None = None
    speedup_vs_single: float | None = None
    bound_s: float | None = None
    peak_rss_mib: list[float] = field(default_factory=list)
    hwm_mib: list[float] = field(default_factory=list)
    max_loss_diff_vs_single: float | None = None


def plan_for(s: Setup, p: int, path: Path) -> Path:
    from torchpp.models.presets import load_config, model_info
    from torchpp.planner.simple import make_plan

    cfg = load_config(s.model, s.layers)
    info = model_info(cfg, s.model)
    plan = make_plan(info, seq_len=s.seq_len, global_batch=s.batch, num_microbatches=s.microbatches,
                     layer_ranges=even_split(int(cfg.num_hidden_layers), p), group_sizes=[1] * p, schedule="1f1b",
                     strategy="even")
    plan.save(path)
    return path


def format_table(rows: list[Row], s: Setup) -> str:
    head = (f"{'system':<9} {'ranks':>5} {'step s':>8} {'vs peer':>8} {'vs bound':>9} {'bound s':>8} "
            f"{'speedup':>8} {'peak RSS MiB per rank (psutil)':<34} {'|dloss|':>8}")
    lines = [f"{s.model}{'' if s.layers is None else f' ({s.layers} layers)'}: batch {s.batch} x {s.seq_len}, "
             f"{s.microbatches} micro-batches, 1 thread per rank, median of measured steps", head]
    f = lambda x, fmt: "-" if x is None else format(x, fmt)  # noqa: E731
    for r in rows:
        rss = " ".join(f"{x:.0f}" for x in r.peak_rss_mib)
        lines.append(f"{r.system:<9} {r.ranks:>5} {r.step_s:8.3f} {f(r.vs_peer, '8.3f'):>8} {f(r.vs_bound, '9.3f'):>9} "
                     f"{f(r.bound_s, '8.3f'):>8} {f(r.speedup_vs_single, '8.2f'):>8} {rss:<34} "
                     f"{f(r.max_loss_diff_vs_single, '8.1e'):>8}")
    return "\n".join(lines)


def chart(rows: list[Row], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    labels, vals, colors = [], [], []
    palette = {"single": "tab:gray", "torchpp": "tab:blue", "peer": "tab:orange", "bound": "tab:green"}
    for r in rows:
        labels.append(f"{r.system}\n{r.ranks} rank(s)")
        vals.append(r.step_s)
        colors.append(palette[r.system])
        if r.system == "peer" and r.bound_s is not None:
            labels.append(f"bound\n{r.ranks} ranks")
            vals.append(r.bound_s)
            colors.append(palette["bound"])
    ax1.bar(range(len(vals)), vals, color=colors)
    ax1.set_xticks(range(len(vals)), labels, fontsize=8)
    ax1.set_ylabel("step time, s (median)")
    ax1.set_title("step time")
    for i, v in enumerate(vals):
        ax1.text(i, v, f"{v:.2f}", ha="center", va="bottom", fontsize=8)
    pipe = [r for r in rows if r.system != "single"]
    width = 0.8 / max(1, max(r.ranks for r in pipe) if pipe else 1)
    for j, r in enumerate(pipe):
        for k, m in enumerate(r.peak_rss_mib):
            ax2.bar(j + (k - (r.ranks - 1) / 2) * width, m, width * 0.9, color=palette[r.system])
    ax2.set_xticks(range(len(pipe)), [f"{r.system}\n{r.ranks} ranks" for r in pipe], fontsize=8)
    ax2.set_ylabel("peak RSS per rank, MiB (psutil)")
    ax2.set_title("memory per rank (bars: ranks 0..p-1)")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--quick", action="store_true", help="qwen3-tiny, batch 8 x 32, 4 micro-batches, 3 steps, 1 repeat")
    p.add_argument("--model", default=None, help="preset (default qwen3-small; --quick: qwen3-tiny)")
    p.add_argument("--layers", type=int, default=None, help="keep only the first N decoder layers")
    p.add_argument("--batch", type=int, default=None, help="global batch (default 16)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sample (default 128)")
    p.add_argument("--microbatches", type=int, default=None, help="micro-batches per step (default 8)")
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4], help="pipeline sizes to compare")
    p.add_argument("--steps", type=int, default=None, help="measured steps per run (default 6)")
    p.add_argument("--warmup", type=int, default=2, help="unmeasured steps at the start of each run")
    p.add_argument("--repeats", type=int, default=None, help="runs of each configuration (default 2)")
    p.add_argument("--timeout-s", type=float, default=120.0, help="a rank silent this long fails the run")
    p.add_argument("--out", type=Path, default=ROOT / "out" / "bench_pipelining")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.worker is not None:
        worker(a.worker)
        return 0
    q = a.quick
    s = Setup(model=a.model or ("qwen3-tiny" if q else "qwen3-small"), layers=a.layers,
              batch=a.batch or (8 if q else 16), seq_len=a.seq_len or (32 if q else 128),
              microbatches=a.microbatches or (4 if q else 8), steps=a.steps or (3 if q else 6),
              warmup=a.warmup if not q else min(a.warmup, 1), timeout_s=a.timeout_s)
    repeats = a.repeats or (1 if q else 2)
    if s.batch % s.microbatches:
        raise SystemExit(f"--microbatches: expected a divisor of --batch {s.batch}, got {s.microbatches}")
    from torchpp.models.presets import load_config

    n_layers = int(load_config(s.model, s.layers).num_hidden_layers)
    for p in a.ranks:
        if not 2 <= p <= min(n_layers, s.microbatches):
            raise SystemExit(f"--ranks: expected 2..{min(n_layers, s.microbatches)} (layers and micro-batches), got {p}")
    out: Path = a.out
    out.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    print(f"bench_pipelining: {s.model}, batch {s.batch} x {s.seq_len}, {s.microbatches} micro-batches, ranks "
          f"{a.ranks}, {s.warmup}+{s.steps} steps x {repeats} repeat(s); load average {load_before[0]:.2f} "
          f"(1 min), {os.cpu_count()} cores", flush=True)

    t0 = time.monotonic()
    print("[profile] block forward/backward per micro-batch ...", flush=True)
    lf = profile(s)
    plans = {p: plan_for(s, p, out / f"plan_pp{p}.json") for p in a.ranks}
    got: dict[tuple[str, int], list[list[RankResult]]] = {}
    order: list[tuple[str, int]] = [("single", 1)]
    for rep in range(repeats):
        pairs = [(sys_, p) for p in a.ranks for sys_ in (("torchpp", "peer") if rep % 2 == 0 else ("peer", "torchpp"))]
        for system, p in [("single", 1), *pairs]:
            if (system, p) not in order:
                order.append((system, p))
            tag = f"{system}_pp{p}_rep{rep}"
            print(f"[run] {tag} ({time.monotonic() - t0:.0f} s) ...", flush=True)
            got.setdefault((system, p), []).append(launch(system, p, s, out, tag, plans.get(p)))
    load_after = os.getloadavg()

    def steps_of(results: list[list[RankResult]]) -> list[float]:
        return [t for run in results for t in run[0].step_times_s[s.warmup:]]

    single_losses = got[("single", 1)][0][0].losses
    single_step = statistics.median(steps_of(got[("single", 1)]))
    rows: list[Row] = []
    bounds: dict[int, dict[str, Any]] = {}
    for system, p in order:
        res = got[(system, p)]
        ts = steps_of(res)
        r = Row(system=system, ranks=p, step_s=statistics.median(ts), step_mean_s=statistics.fmean(ts), steps=len(ts))
        r.peak_rss_mib = [max(run[k].peak_rss_bytes for run in res) / 2**20 for k in range(p)]
        r.hwm_mib = [max(run[k].hwm_bytes for run in res) / 2**20 for k in range(p)]
        r.max_loss_diff_vs_single = max(abs(x - y) for run in res for x, y in zip(run[0].losses, single_losses))
        if system != "single":
            ranges = even_split(n_layers, p)
            costs = stage_costs(lf, ranges)
            r.bound_s = (s.microbatches + p - 1) * max(costs)
            r.vs_bound = r.step_s / r.bound_s
            r.speedup_vs_single = single_step / r.step_s
            bounds[p] = {"layer_ranges": ranges, "stage_fb_s": costs, "bound_s": r.bound_s,
                         "cpu_bound_s": s.microbatches * sum(costs) / min(p, os.cpu_count() or 1)}
        rows.append(r)
    for r in rows:
        if r.system == "torchpp":
            peer = next(x for x in rows if x.system == "peer" and x.ranks == r.ranks)
            r.vs_peer = r.step_s / peer.step_s
            peer.vs_peer = 1.0
    table = format_table(rows, s)
    print()
    print(table)
    print(f"bound = (m + p - 1) x max stage (forward + backward per micro-batch), block profile of this run; "
          f"single = {single_step:.3f} s")
    for p, b in bounds.items():
        print(f"  p={p}: stages {b['layer_ranges']}: f+b per micro-batch "
              f"{' '.join(f'{c * 1e3:.1f}' for c in b['stage_fb_s'])} ms; with {os.cpu_count()} cores no schedule "
              f"beats m x sum / min(p, cores) = {b['cpu_bound_s']:.3f} s")
    print(f"load average (1 min) {load_before[0]:.2f} before, {load_after[0]:.2f} after; "
          f"{time.monotonic() - t0:.0f} s in all")

    with open(out / "results.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["system", "ranks", "step_median_s", "step_mean_s", "steps", "vs_peer", "vs_bound", "bound_s",
                    "speedup_vs_single", "peak_rss_mib_per_rank", "hwm_mib_per_rank", "max_loss_diff_vs_single"])
        for r in rows:
            w.writerow([r.system, r.ranks, f"{r.step_s:.6f}", f"{r.step_mean_s:.6f}", r.steps,
                        "" if r.vs_peer is None else f"{r.vs_peer:.4f}", "" if r.vs_bound is None else f"{r.vs_bound:.4f}",
                        "" if r.bound_s is None else f"{r.bound_s:.6f}",
                        "" if r.speedup_vs_single is None else f"{r.speedup_vs_single:.4f}",
                        " ".join(f"{x:.1f}" for x in r.peak_rss_mib), " ".join(f"{x:.1f}" for x in r.hwm_mib),
                        f"{r.max_loss_diff_vs_single:.3g}"])
    (out / "results.json").write_text(json.dumps({
        "setup": asdict(s), "ranks": a.ranks, "repeats": repeats, "cores": os.cpu_count(),
        "load_average_before": load_before, "load_average_after": load_after,
        "rows": [asdict(r) for r in rows], "bounds": {str(k): v for k, v in bounds.items()},
        "blocks": {b.name: {"forward_s": b.forward_time_s, "backward_s": b.backward_time_s}
                   for b in [lf.embed, *lf.layers, lf.tail]},
        "step_times_s": {f"{k[0]}_pp{k[1]}": [run[0].step_times_s for run in v] for k, v in got.items()},
        "table": table}, indent=1))
    chart(rows, out / "step_times.png", f"{s.model}, batch {s.batch} x {s.seq_len}, {s.microbatches} micro-batches, "
          f"gloo/CPU, 1 thread per rank, load {load_before[0]:.1f}-{load_after[0]:.1f} on {os.cpu_count()} cores")
    print(f"wrote {out / 'results.csv'}, {out / 'results.json'}, {out / 'step_times.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
