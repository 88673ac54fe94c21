"""torchpp's 1F1B against `torch.distributed.pipelining.Schedule1F1B` and single-process training.

    python benchmarks/bench_pipelining.py              # qwen3-small, batch 16 x 128, 8 micro-batches, 2 and 4 ranks
    python benchmarks/bench_pipelining.py --quick      # qwen3-tiny, 2 ranks, 2 steps: checks that it runs, no measurement

One run measures, on this machine, with gloo on CPU and one torch thread per rank:

* ``single``: plain HF training of the whole model on the whole batch in one process;
* ``torchpp``: ``torchpp.runtime`` training an even split (p stages, one rank each, 1F1B);
* ``peer``: the same split with ``torch.distributed.pipelining``: every rank builds the whole
  model, drops what its stage does not own, wraps the rest in a ``PipelineStage`` and runs
  ``Schedule1F1B`` with the same loss; the tied embedding's gradient is summed between the
  first and the last stage as torchpp does (the library does not tie weights across stages);
* the block profile of the model (``torchpp.profiling``, one micro-batch, one thread), from
  which the pipeline bound ``(m + p - 1) x max over stages of (forward + backward per
  micro-batch)`` is computed for each split;
* ``compute``: the same bound with each stage's forward + backward timed in the pipelines' own
  processes in every round, min(p, cores) stages at once (so the cores are as busy as in a
  pipeline step; "bound@run") and, as ``compute_alone``, one stage at a time ("bound@run1"). On a machine whose speed drifts by 10-20% over minutes, a bound taken
  minutes apart from the pipelines (the profile, before and after) says as much about the drift
  as about the pipelines; the per-round ratio does not.

torchpp keeps freed memory in the process (``torchpp.runtime.allocator``); in the shared
processes the peer and the bare compute run under the same policy, and the block profile
applies it too, so every ratio compares like with like. The separate memory runs use each
system as it comes (the peer with the C library's default).

Step times: for each p, torchpp, the peer and the stages' bare compute run in the same p
processes, one step each in turn (the order rotating, forwards and backwards), so load
that drifts on a shared machine hits all alike; each step ends with an all-reduce on both
systems, and the time is rank 0's. The median of the measured steps (after --warmup) is reported, and, as a check, the
median of the per-step ratios. Memory: every system also runs on its own in freshly launched
processes (one per rank, a gloo group through a FileStore, bounded by --timeout-s, killed if they
overrun), whose peak RSS psutil samples every 20 ms (plus the kernel's high-water mark);
these runs' step times are shown as "alone". The block profile is measured before and after
the pipelines run and the median of all its steps is used. All three systems train from the
same weights on the same data; their largest loss difference is shown as a check.

Writes into --out: ``results.csv``, ``results.json`` (with the block profile and the load
average), ``step_times.png`` and the ranks' logs.
"""
from __future__ import annotations

import argparse
import copy
import csv
import dataclasses
import json
import os
import resource
import statistics
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from torchpp.planner.simple import even_layer_ranges as even_split  # noqa: E402  (the split torchpp plans use)

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
    peer_schedule: str = "1F1B"
    """The peer's schedule class, ``torch.distributed.pipelining.Schedule<peer_schedule>`` (1F1B, GPipe)."""

    @property
    def micro_batch_size(self) -> int:
        return self.batch // self.microbatches


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
    alternating: dict[str, dict[str, list]] = field(default_factory=dict)
    """``alternating`` runs: per system, its step times and losses (and the stages' compute per rank)."""


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
    """``torchpp.runtime.trainer.train``: what ``torchrun -m torchpp.train --plan`` runs."""
    from torchpp.runtime.trainer import TrainConfig, train

    cfg = TrainConfig(plan=plan, steps=s.warmup + s.steps, lr=s.lr, seed=s.seed, threads=1, timeout_s=s.timeout_s,
                      layers=s.layers)
    summary = train(cfg)
    return summary.step_times_s, summary.losses


class TorchppSteps:
    """torchpp's training step as ``trainer.train`` runs it (executor step + statistics all-reduce),
    one step at a time, so it can alternate with the peer's in the same processes."""

    def __init__(self, s: Setup, plan: Path, rank: int, world: int):
        import torch

        from torchpp.data import SyntheticTokens
        from torchpp.models.stages import StageSpec, build_stage
        from torchpp.runtime.comm import Comm
        from torchpp.runtime.executor import Executor
        from torchpp.runtime.trainer import TrainConfig, make_optimizer, prepare

        torch.set_num_threads(1)
        self.cfg = TrainConfig(plan=plan, lr=s.lr, seed=s.seed, threads=1, timeout_s=s.timeout_s, layers=s.layers)
        prep = prepare(self.cfg, world)
        self.plan = prep.plan
        self.pstage = self.plan.stage_of_rank(rank)
        comm = Comm(rank, s.timeout_s, boundaries=self.plan.num_stages - 1, samples=self.plan.micro_batch_size)
        comm.make_groups(prep.schedule)
        stage = build_stage(prep.model, prep.config, StageSpec.from_plan(self.plan, self.pstage.index), seed=s.seed,
                            dtype=self.plan.model.dtype)
        opt = make_optimizer(self.cfg.optimizer, stage.parameters(), s.lr, 0.0, self.cfg.adam_eps)
        self.executor = Executor(rank=rank, plan=self.plan, actions=prep.schedule[rank], stage=stage, comm=comm,
                                 optimizer=opt, schedule=prep.schedule)
        needs = self.pstage.has_embed or self.pstage.has_tail
        self.data = SyntheticTokens(vocab_size=self.plan.model.vocab_size, seq_len=s.seq_len, global_batch=s.batch,
                                    seed=s.seed) if needs else None

    def step(self, index: int) -> tuple[float, float]:
        from torchpp.models.stages import count_targets
        from torchpp.runtime.trainer import _reduce_stats

        ids = self.data.batch(index) if self.data is not None else None
        n_tokens = count_targets(ids) if ids is not None and self.pstage.has_tail else None
        t0 = time.perf_counter()
        res = self.executor.step(ids, n_tokens)
        stats = _reduce_stats(res, {self.pstage.index: len(self.pstage.devices)}, self.plan.num_stages)
        return time.perf_counter() - t0, float(stats[0])


class StageCompute:
    """The bound's ingredient measured where the pipelines run: each rank times m forward +
    backward passes of its own stage (a separate copy with the same weights, random inputs and
    output gradients, no communication), so machine drift hits this and the pipelines alike.

    ``at_once`` ranks compute together (in waves, after a barrier): min(p, cores) keeps the
    cores as busy as in a pipeline's steady state without giving a stage less than a core;
    1 times each stage with the rest of the machine idle, as the block profile does, and the
    ratio of the two is what running side by side costs on this machine."""

    def __init__(self, s: Setup, plan: Path, rank: int, world: int, at_once: int):
        import torch

        from torchpp.data import SyntheticTokens
        from torchpp.models.stages import StageSpec, build_stage, count_targets
        from torchpp.runtime.trainer import TrainConfig, prepare

        prep = prepare(TrainConfig(plan=plan, lr=s.lr, seed=s.seed, threads=1, timeout_s=s.timeout_s,
                                   layers=s.layers), world)
        self.plan = prep.plan
        self.pstage = self.plan.stage_of_rank(rank)
        self.stage = build_stage(prep.model, prep.config, StageSpec.from_plan(self.plan, self.pstage.index),
                                 seed=s.seed + 1, dtype=self.plan.model.dtype)
        self.m, self.mbs = s.microbatches, self.plan.micro_batch_size
        data = SyntheticTokens(vocab_size=self.plan.model.vocab_size, seq_len=s.seq_len, global_batch=s.batch,
                               seed=s.seed + 1)
        self.ids = data.batch(0)
        self.n_tokens = count_targets(self.ids)
        gen = torch.Generator().manual_seed(s.seed + rank)
        shape = (self.mbs, s.seq_len, self.stage.hidden_size)
        self.x = torch.randn(shape, generator=gen, dtype=self.stage.dtype)
        self.dy = torch.randn(shape, generator=gen, dtype=self.stage.dtype)
        self.rank, self.world, self.at_once = rank, world, at_once
        self.per_rank: list[list[float]] = []
        """Per round: every rank's seconds for its m passes."""

    def timed(self, at_once: int) -> "StageCompute":
        """The same stage and inputs, timed with ``at_once`` ranks computing together."""
        other = copy.copy(self)
        other.at_once, other.per_rank = at_once, []
        return other

    def step(self, index: int) -> tuple[float, float]:
        """Seconds of m forward + backward passes of the slowest stage (all-reduced max)."""
        import torch
        import torch.distributed as dist

        st = self.pstage
        t = torch.zeros(self.world, dtype=torch.float64)
        for wave in range(0, self.world, self.at_once):
            dist.barrier()
            if not wave <= self.rank < wave + self.at_once:
                continue
            t0 = time.perf_counter()
            for mb in range(self.m):
                rows = slice(mb * self.mbs, (mb + 1) * self.mbs)
                x = self.ids[rows] if st.has_embed else self.x.detach().requires_grad_(True)
                out = self.stage.forward(x, self.ids[rows] if st.has_tail else None, self.n_tokens)
                if st.has_tail:
                    out.backward()
                else:
                    torch.autograd.backward(out, self.dy)
            t[self.rank] = time.perf_counter() - t0
        for p in self.stage.parameters():
            p.grad = None
        dist.all_reduce(t)
        self.per_rank.append(t.tolist())
        return float(t.max()), 0.0


class PeerSteps:
    """``torch.distributed.pipelining``: whole model on every rank, sliced, ``Schedule1F1B``."""

    def __init__(self, s: Setup, rank: int, world: int):
        import datetime

        import torch
        import torch.distributed as dist
        from peer_part import peer_part
        from torch.distributed import pipelining
        from torch.distributed.pipelining import PipelineStage

        from torchpp.data import SyntheticTokens
        from torchpp.models.presets import build_model, load_config
        from torchpp.models.stages import Stage, StagePaths, _get, count_targets
        from torchpp.runtime.trainer import make_optimizer

        torch.set_num_threads(1)
        self.s = s
        timeout = datetime.timedelta(seconds=s.timeout_s)
        cfg = load_config(s.model, s.layers)
        model = build_model(s.model, seed=s.seed, config=cfg)  # the whole model, as the library's examples do
        parts = StagePaths.of(model)
        n = int(cfg.num_hidden_layers)
        a, b = even_split(n, world)[rank]
        self.first, self.last = first, last = rank == 0, rank == world - 1
        # the same per-stage compute as torchpp; the last stage returns logits and the schedule applies the loss
        part, _ = peer_part(model, cfg, (a, b), first=first, last=last, num_stages=world)
        group = dist.new_group(list(range(world)), timeout=timeout)
        pstage = PipelineStage(part, rank, world, torch.device("cpu"), group=group)
        self.sched = getattr(pipelining, f"Schedule{s.peer_schedule}")(pstage, s.microbatches,
                                  loss_fn=lambda logits, target: Stage.loss(logits, target, count_targets(target)))
        # the same optimizer as torchpp (fused AdamW), so the comparison is of the pipelines alone
        self.opt = make_optimizer("adamw", list(part.parameters()), s.lr, 0.0)
        self.tied = None
        if getattr(cfg, "tie_word_embeddings", False):
            self.tied = (_get(model, parts.token).weight if first else
                         _get(model, parts.lm_head).weight if last else None)
        self.tied_group = dist.new_group([0, world - 1], timeout=timeout)
        self.data = SyntheticTokens(vocab_size=int(cfg.vocab_size), seq_len=s.seq_len, global_batch=s.batch,
                                    seed=s.seed)

    def step(self, index: int) -> tuple[float, float]:
        import torch
        import torch.distributed as dist

        ids = self.data.batch(index) if self.first or self.last else None
        t0 = time.perf_counter()
        losses: list[torch.Tensor] = []
        if self.first:
            self.sched.step(ids, return_outputs=False)
        elif self.last:
            self.sched.step(target=ids, losses=losses, return_outputs=False)
        else:
            self.sched.step(return_outputs=False)
        if self.tied is not None:  # what torchpp's tied all-reduce does; the library leaves it to the user
            g = self.tied.grad if self.tied.grad is not None else torch.zeros_like(self.tied)
            dist.all_reduce(g, group=self.tied_group)
            self.tied.grad = g
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        v = torch.zeros(1, dtype=torch.float64)
        if self.last:
            v[0] = sum(float(x) for x in losses) / self.s.microbatches
        dist.all_reduce(v)
        return time.perf_counter() - t0, float(v[0])


def _run_peer(s: Setup, rank: int, world: int) -> tuple[list[float], list[float]]:
    peer = PeerSteps(s, rank, world)
    got = [peer.step(i) for i in range(s.warmup + s.steps)]
    return [t for t, _ in got], [x for _, x in got]


def _run_alternating(s: Setup, plan: Path, rank: int, world: int) -> dict[str, dict[str, list]]:
    """Both systems and the stages' bare compute in the same processes, one step each in turn
    (the order rotating through all permutations): load that drifts hits all three alike, so
    their ratios are measured far more precisely than in separate runs."""
    cores = os.cpu_count() or 1
    compute = StageCompute(s, plan, rank, world, at_once=min(world, cores))
    systems = {"torchpp": TorchppSteps(s, plan, rank, world), "peer": PeerSteps(s, rank, world),
               "compute": compute, "compute_alone": compute.timed(1)}
    out = {k: {"step_times_s": [], "losses": []} for k in systems}
    names = list(systems)  # rotations and their reverses in turn: no member always goes first
    orders = [names[k:] + names[:k] for k in range(len(names))]
    orders = [o for pair in zip(orders, [o[::-1] for o in orders]) for o in pair]
    for i in range(s.warmup + s.steps):
        for name in orders[i % len(orders)]:
            dt, loss = systems[name].step(i)
            out[name]["step_times_s"].append(dt)
            out[name]["losses"].append(loss)
    for name in ("compute", "compute_alone"):
        out[name]["per_rank_s"] = systems[name].per_rank
    return out


def worker(rank: int, world: int, system: str, setup: dict[str, Any], plan: str | None) -> dict[str, Any]:
    """One rank of one run, in the gloo group ``launch`` started it in: its ``RankResult``."""
    s = Setup(**setup)
    extra: dict[str, Any] = {}
    if system == "alternating":
        # torchpp's allocator policy (train() sets it) is process-wide: the peer and the bare stage
        # compute in these processes run under it too, so their ratios compare pipelines alone
        from torchpp.runtime.allocator import retain_freed_memory

        retain_freed_memory()
    with RssSampler() as rss:
        if system == "single":
            times, losses = _run_single(s)
        elif system == "torchpp":
            times, losses = _run_torchpp(s, Path(plan))
        elif system == "peer":
            times, losses = _run_peer(s, rank, world)
        else:
            extra = _run_alternating(s, Path(plan), rank, world)
            times, losses = [], []
    hwm = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return asdict(RankResult(system=system, ranks=world, rank=rank, step_times_s=times, losses=losses,
                             peak_rss_bytes=rss.peak, hwm_bytes=hwm, alternating=extra))


# ----------------------------------------------------------------------------- the parent
def launch(system: str, world: int, s: Setup, out: Path, tag: str, plan: Path | None) -> list[RankResult]:
    """Run one configuration in ``world`` fresh processes (``torchpp.runtime.launch``: one gloo
    group, each rank's output in ``runs/<tag>_rank<r>.log``, all killed if any fails or overruns)."""
    from torchpp.runtime.launch import RankError, RanksTimedOut, run_ranks

    runs = out / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    deadline_s = s.timeout_s + 60 + 10 * (s.warmup + s.steps) * 3
    try:
        got = run_ranks(world, worker, system, asdict(s), str(plan) if plan else None, timeout_s=deadline_s,
                        pg_timeout_s=s.timeout_s, threads=1, log=str(runs / f"{tag}_rank{{rank}}.log"))
    except (RankError, RanksTimedOut) as e:
        raise RuntimeError(f"{tag}: {e} (logs in {runs})") from e
    return [RankResult(**r) for r in got]


def profile(s: Setup):
    """Per-block forward/backward time of one micro-batch (torchpp.profiling, one thread)."""
    from torchpp.profiling.measure import ProfileConfig, measure_layers

    return measure_layers(ProfileConfig(model=s.model, seq_len=s.seq_len, batch=s.micro_batch_size, threads=1,
                                        iters=6, warmup=2, num_layers=s.layers, seed=s.seed))


def block_costs(profiles: list) -> dict[str, float]:
    """Forward + backward seconds of each block per micro-batch: the median over every measured
    step of every profile (profiles are taken before and after the pipelines run)."""
    out = {}
    for b in [profiles[0].embed, *profiles[0].layers, profiles[0].tail]:
        samples = []
        for lf in profiles:
            pb = next(x for x in [lf.embed, *lf.layers, lf.tail] if x.name == b.name)
            samples += [f + w for f, w in zip(pb.forward_samples_s, pb.backward_samples_s)]
        out[b.name] = statistics.median(samples)
    return out


def stage_costs(blocks: dict[str, float], ranges: list[tuple[int, int]]) -> list[float]:
    """Forward + backward seconds per micro-batch of each stage (the sum of its blocks, as the
    cost layer sums them)."""
    from torchpp.cost import BlockSums, stage_blocks
    from torchpp.models.blocks import EMBED, TAIL, layer_block

    n_layers = len(blocks) - 2
    per = BlockSums([blocks[EMBED], *[blocks[layer_block(j)] for j in range(n_layers)], blocks[TAIL]])
    return [float(per(*stage_blocks((a, b), i == 0, i == len(ranges) - 1))) for i, (a, b) in enumerate(ranges)]


@dataclass
class Row:
    system: str
    ranks: int
    step_s: float
    """Median step time (rank 0): pipelines from the alternating run, single from its own run."""
    steps: int
    alone_step_s: float | None = None
    """Median step time of the same system run on its own in fresh processes."""
    vs_peer: float | None = None
    vs_bound: float | None = None
    """Against the bound from the block profile (measured before and after the pipelines)."""
    vs_bound_here: float | None = None
    """Median over rounds of step time / the bound from the stages' compute in the same round."""
    bound_here_s: float | None = None
    """Median over rounds of (m + p - 1) x the slowest stage's forward + backward per micro-batch,
    measured in the same processes in the same round, min(p, cores) stages at once."""
    vs_bound_one: float | None = None
    """As ``vs_bound_here`` with the stages timed one at a time (the rest of the machine idle)."""
    bound_one_s: float | None = None
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
    f = lambda x, fmt: "-" if x is None else format(x, fmt)  # noqa: E731
    lines = [f"{s.model}{'' if s.layers is None else f' ({s.layers} layers)'}: batch {s.batch} x {s.seq_len}, "
             f"{s.microbatches} micro-batches, 1 thread per rank; step s: median (pipelines: torchpp and peer "
             f"alternating step by step in the same processes)",
             f"{'system':<8} {'ranks':>5} {'step s':>7} {'vs peer':>7} {'vs bound':>8} {'bound s':>7} "
             f"{'vs bound@run':>12} {'bound@run s':>11} {'vs bound@run1':>13} {'speedup':>7} {'alone s':>7}  "
             f"{'peak RSS MiB/rank':<20} "
             f"{'|dloss|':>7}"]
    for r in rows:
        rss = " ".join(f"{x:.0f}" for x in r.peak_rss_mib)
        lines.append(f"{r.system:<8} {r.ranks:>5} {r.step_s:7.3f} {f(r.vs_peer, '7.3f'):>7} {f(r.vs_bound, '8.3f'):>8} "
                     f"{f(r.bound_s, '7.3f'):>7} {f(r.vs_bound_here, '12.3f'):>12} {f(r.bound_here_s, '11.3f'):>11} "
                     f"{f(r.vs_bound_one, '13.3f'):>13} "
                     f"{f(r.speedup_vs_single, '7.2f'):>7} {f(r.alone_step_s, '7.3f'):>7}  "
                     f"{rss:<20} {f(r.max_loss_diff_vs_single, '7.1e'):>7}")
    return "\n".join(lines)


def chart(rows: list[Row], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 4.8), gridspec_kw={"width_ratios": [3, 2]})
    labels, vals, colors = [], [], []
    palette = {"single": "tab:gray", "torchpp": "tab:blue", "peer": "tab:orange", "bound": "tab:green", "bound@run": "tab:olive"}
    for r in rows:
        labels.append(f"{r.system}\n{r.ranks} rank(s)")
        vals.append(r.step_s)
        colors.append(palette[r.system])
        if r.system == "peer" and r.bound_s is not None:
            labels += [f"bound\nprofile\n{r.ranks} ranks", f"bound\nat run\n{r.ranks} ranks"]
            vals += [r.bound_s, r.bound_here_s]
            colors += [palette["bound"], palette["bound@run"]]
    ax1.bar(range(len(vals)), vals, color=colors)
    ax1.set_xticks(range(len(vals)), labels, fontsize=8)
    ax1.set_ylabel("step time, s (median)")
    ax1.set_title("step time (pipelines: alternating in the same processes)", fontsize=9)
    for i, v in enumerate(vals):
        ax1.text(i, v, f"{v:.2f}", ha="center", va="bottom", fontsize=8)
    pipe = [r for r in rows if r.system != "single"]
    width = 0.8 / max([r.ranks for r in pipe] or [1])
    for j, r in enumerate(pipe):
        for k, m in enumerate(r.peak_rss_mib):
            ax2.bar(j + (k - (r.ranks - 1) / 2) * width, m, width * 0.9, color=palette[r.system])
    ax2.set_xticks(range(len(pipe)), [f"{r.system}\n{r.ranks} ranks" for r in pipe], fontsize=8)
    ax2.set_ylabel("peak RSS per rank, MiB (psutil)")
    lo = min([m for r in pipe for m in r.peak_rss_mib] or [0])
    ax2.set_ylim(max(0.0, lo - 100), None)
    ax2.set_title("memory per rank, separate runs (bars: ranks 0..p-1; axis does not start at 0)", fontsize=9)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="qwen3-tiny, batch 8 x 32, 4 micro-batches, 2 ranks, 1+2 steps: checks that it runs")
    p.add_argument("--model", default=None, help="preset (default qwen3-small; --quick: qwen3-tiny)")
    p.add_argument("--layers", type=int, default=None, help="keep only the first N decoder layers")
    p.add_argument("--batch", type=int, default=None, help="global batch (default 16)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sample (default 128)")
    p.add_argument("--microbatches", type=int, default=None, help="micro-batches per step (default 8)")
    p.add_argument("--ranks", type=int, nargs="+", default=None, help="pipeline sizes to compare (default 2 4; --quick 2)")
    p.add_argument("--steps", type=int, default=None,
                   help="measured steps of each system in the alternating runs (default 24; --quick 2)")
    p.add_argument("--alone-steps", type=int, default=None,
                   help="measured steps of the separate runs (memory, single process; default 4; --quick 1)")
    p.add_argument("--warmup", type=int, default=2, help="unmeasured steps at the start of each run")
    p.add_argument("--timeout-s", type=float, default=120.0, help="a rank silent this long fails the run")
    p.add_argument("--out", type=Path, default=ROOT / "out" / "bench_pipelining")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    q = a.quick
    s = Setup(model=a.model or ("qwen3-tiny" if q else "qwen3-small"), layers=a.layers,
              batch=a.batch or (8 if q else 16), seq_len=a.seq_len or (32 if q else 128),
              microbatches=a.microbatches or (4 if q else 8), steps=a.steps or (2 if q else 24),
              warmup=min(a.warmup, 1) if q else a.warmup, timeout_s=a.timeout_s)
    alone = dataclasses.replace(s, steps=a.alone_steps or (1 if q else 4))
    a.ranks = a.ranks or ([2] if q else [2, 4])
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
    cores = os.cpu_count() or 1
    print(f"bench_pipelining: {s.model}, batch {s.batch} x {s.seq_len}, {s.microbatches} micro-batches, ranks "
          f"{a.ranks}; load average {load_before[0]:.2f} (1 min) on {cores} cores", flush=True)
    t0 = time.monotonic()

    def note(text: str) -> None:
        print(f"[{time.monotonic() - t0:5.0f} s] {text}", flush=True)

    note("block profile (before)")
    profiles = [profile(s)]
    plans = {p: plan_for(s, p, out / f"plan_pp{p}.json") for p in a.ranks}
    alt: dict[int, list[RankResult]] = {}
    for p in a.ranks:
        note(f"torchpp and peer alternating, {p} ranks, {s.warmup}+{s.steps} steps each")
        alt[p] = launch("alternating", p, s, out, f"alternating_pp{p}", plans[p])
    sep: dict[tuple[str, int], list[RankResult]] = {}
    for system, p in [("single", 1), *[(x, p) for p in a.ranks for x in ("torchpp", "peer")]]:
        note(f"{system} alone, {p} rank(s), {alone.warmup}+{alone.steps} steps (memory)")
        sep[(system, p)] = launch(system, p, alone, out, f"{system}_pp{p}", plans.get(p))
    note("block profile (after)")
    profiles.append(profile(s))
    load_after = os.getloadavg()

    blocks = block_costs(profiles)
    single = sep[("single", 1)][0]
    meas = lambda ts, w: ts[w:]  # noqa: E731
    single_step = statistics.median(meas(single.step_times_s, alone.warmup))
    rows = [Row(system="single", ranks=1, step_s=single_step, steps=len(meas(single.step_times_s, alone.warmup)),
                peak_rss_mib=[single.peak_rss_bytes / 2**20], hwm_mib=[single.hwm_bytes / 2**20],
                max_loss_diff_vs_single=0.0)]
    bounds: dict[int, dict[str, Any]] = {}
    for p in a.ranks:
        ranges = even_split(n_layers, p)
        costs = stage_costs(blocks, ranges)
        bound = (s.microbatches + p - 1) * max(costs)
        scale = (s.microbatches + p - 1) / s.microbatches
        here = [scale * t for t in meas(alt[p][0].alternating["compute"]["step_times_s"], s.warmup)]
        one = [scale * t for t in meas(alt[p][0].alternating["compute_alone"]["step_times_s"], s.warmup)]
        per_rank = {k: meas(alt[p][0].alternating[k]["per_rank_s"], s.warmup) for k in ("compute", "compute_alone")}
        per_stage = {k: [statistics.median(col) / s.microbatches for col in zip(*v)] for k, v in per_rank.items()}
        bounds[p] = {"layer_ranges": ranges, "stage_fb_s": costs, "bound_s": bound,
                     "cpu_bound_s": s.microbatches * sum(costs) / min(p, cores),
                     "stage_fb_at_run_s": per_stage["compute"], "stage_fb_at_run_one_at_a_time_s":
                     per_stage["compute_alone"], "at_once": min(p, cores),
                     # what computing side by side costs: per round, the slowest stage together vs one at a time
                     "side_by_side_slowdown": statistics.median(
                         max(x) / max(y) for x, y in zip(per_rank["compute"], per_rank["compute_alone"]))}
        for system in ("torchpp", "peer"):
            rec = alt[p][0].alternating[system]
            ts = meas(rec["step_times_s"], s.warmup)
            res = sep[(system, p)]
            diffs = [abs(x - y) for got in (rec["losses"], res[0].losses) for x, y in zip(got, single.losses)]
            rows.append(Row(system=system, ranks=p, step_s=statistics.median(ts), steps=len(ts),
                            alone_step_s=statistics.median(meas(res[0].step_times_s, alone.warmup)),
                            bound_s=bound, vs_bound=statistics.median(ts) / bound,
                            bound_here_s=statistics.median(here),
                            vs_bound_here=statistics.median(x / y for x, y in zip(ts, here)),
                            bound_one_s=statistics.median(one),
                            vs_bound_one=statistics.median(x / y for x, y in zip(ts, one)),
                            speedup_vs_single=single_step / statistics.median(ts),
                            peak_rss_mib=[r.peak_rss_bytes / 2**20 for r in res],
                            hwm_mib=[r.hwm_bytes / 2**20 for r in res], max_loss_diff_vs_single=max(diffs)))
        tp, peer = rows[-2], rows[-1]
        # the ratio of medians and, as a check, the median of the per-round ratios (same round, same load)
        tp_ts = meas(alt[p][0].alternating["torchpp"]["step_times_s"], s.warmup)
        pe_ts = meas(alt[p][0].alternating["peer"]["step_times_s"], s.warmup)
        tp.vs_peer, peer.vs_peer = tp.step_s / peer.step_s, 1.0
        bounds[p]["paired_ratio_median"] = statistics.median(x / y for x, y in zip(tp_ts, pe_ts))
        q1 = lambda ts: statistics.quantiles(ts, n=4)[0] if len(ts) > 1 else ts[0]  # noqa: E731
        bounds[p]["fast_quartile_ratio"] = q1(tp_ts) / q1(pe_ts)
    table = format_table(rows, s)
    print()
    print(table)
    print(f"bound = (m + p - 1) x max over stages of (forward + backward per micro-batch), from the block profiles "
          f"of this run (median of {sum(len(lf.layers[0].forward_samples_s) for lf in profiles)} steps, taken before "
          f"and after the pipelines); bound@run: the same formula with each stage's forward + backward timed in the "
          f"pipelines' processes, min(p, cores) stages at once, in every round; bound@run1: the same with the "
          f"stages timed one at a time (vs bound@run, @run1: median of per-round ratios)")
    for p, b in bounds.items():
        print(f"  p={p}: stages {b['layer_ranges']}: f+b per micro-batch "
              f"{' '.join(f'{c * 1e3:.1f}' for c in b['stage_fb_s'])} ms (profile), "
              f"{' '.join(f'{c * 1e3:.1f}' for c in b['stage_fb_at_run_s'])} ms (at run, {b['at_once']} at once), "
              f"{' '.join(f'{c * 1e3:.1f}' for c in b['stage_fb_at_run_one_at_a_time_s'])} ms (at run, one at a "
              f"time; side by side costs x{b['side_by_side_slowdown']:.3f}); "
              f"torchpp/peer: median of per-step ratios "
              f"{b['paired_ratio_median']:.3f}, ratio of first quartiles {b['fast_quartile_ratio']:.3f}; "
              f"with {cores} cores no schedule beats m x sum / min(p, cores) = {b['cpu_bound_s']:.3f} s")
    print(f"load average (1 min) {load_before[0]:.2f} before, {load_after[0]:.2f} after, on {cores} cores; "
          f"{time.monotonic() - t0:.0f} s in all")

    with open(out / "results.csv", "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["system", "ranks", "step_median_s", "steps", "vs_peer", "vs_bound", "bound_s", "vs_bound_at_run",
                    "bound_at_run_s", "vs_bound_at_run_one_at_a_time",
                    "bound_at_run_one_at_a_time_s", "speedup_vs_single",
                    "alone_step_median_s", "peak_rss_mib_per_rank", "hwm_mib_per_rank", "max_loss_diff_vs_single"])
        o = lambda x: "" if x is None else f"{x:.6g}"  # noqa: E731
        for r in rows:
            w.writerow([r.system, r.ranks, o(r.step_s), r.steps, o(r.vs_peer), o(r.vs_bound), o(r.bound_s),
                        o(r.vs_bound_here), o(r.bound_here_s), o(r.vs_bound_one), o(r.bound_one_s),
                        o(r.speedup_vs_single), o(r.alone_step_s), " ".join(f"{x:.1f}" for x in r.peak_rss_mib),
                        " ".join(f"{x:.1f}" for x in r.hwm_mib), o(r.max_loss_diff_vs_single)])
    (out / "results.json").write_text(json.dumps({
        "setup": asdict(s), "alone_steps": alone.steps, "ranks": a.ranks, "cores": cores,
        "load_average_before": load_before, "load_average_after": load_after,
        "rows": [asdict(r) for r in rows], "bounds": {str(k): v for k, v in bounds.items()},
        "block_fb_s": blocks,
        "step_times_s": {**{f"{k}_pp{p}_alternating": v["step_times_s"] for p, rr in alt.items()
                            for k, v in rr[0].alternating.items()},
                         **{f"{k[0]}_pp{k[1]}_alone": v[0].step_times_s for k, v in sep.items()}},
        "table": table}, indent=1))
    chart(rows, out / "step_times.png", f"{s.model}, batch {s.batch} x {s.seq_len}, {s.microbatches} micro-batches, "
          f"gloo/CPU, 1 thread per rank, load {load_before[0]:.1f}-{load_after[0]:.1f} on {cores} cores")
    print(f"wrote {out / 'results.csv'}, {out / 'results.json'}, {out / 'step_times.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
