"""torchpp's chunked schedules against torch.distributed.pipelining's, on the same split.

    python benchmarks/bench_chunked.py              # qwen3-small, batch 16 x 64, 8 micro-batches, 2 and 4 ranks
    python benchmarks/bench_chunked.py --quick      # qwen3-tiny, 2 ranks, 2 steps, no memory runs: seconds, no measurement
    python benchmarks/bench_chunked.py --model qwen3-tiny --batch 8 --seq-len 16 --steps 30 --no-memory   # small stages

Pairs (torchpp schedule kind vs the peer's class), each on 2p chunks of an even layer split,
the embedding in chunk 0 and the tail in chunk 2p-1:

* ``interleaved``     vs ``ScheduleInterleaved1F1B``      (chunk c on rank c mod p)
* ``interleaved-zb``  vs ``ScheduleInterleavedZeroBubble`` (the same placement, backward split)
* ``zbv``             vs ``ScheduleZBVZeroBubble``         (chunks c and 2p-1-c on rank c)

Step time: torchpp and the peer run in the same p processes, one step each in turn, so load
that drifts on a shared machine hits both alike; the ratio is the median of the per-step
ratios. Peak RSS per rank: each system alone in fresh (spawned) processes, the
kernel's high-water mark of each rank (``ru_maxrss``: exact, where sampling every 20 ms, as
``bench_pipelining`` does, can miss a peak; the sampled figure is kept in the results). The peer builds the whole model on every rank and keeps the chunks it
holds (its examples' way); it does not tie weights, so its tied embedding and lm_head are two
parameters whose gradients are summed (locally when one rank holds both, else by an
all-reduce between their ranks), as torchpp does where it must.
"""
from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bench_pipelining import RssSampler, Setup  # noqa: E402

PAIRS = {"interleaved": "ScheduleInterleaved1F1B", "interleaved-zb": "ScheduleInterleavedZeroBubble",
         "zbv": "ScheduleZBVZeroBubble"}


DEFAULTS = dict(seq_len=64, warmup=1)
"""Where this benchmark's runs differ from ``bench_pipelining``'s :class:`Setup` (the same record)."""


def chunk_ranges(s: Setup, p: int) -> list[tuple[int, int]]:
    from torchpp.models.presets import load_config
    from torchpp.plans import even_layer_ranges

    return even_layer_ranges(int(load_config(s.model).num_hidden_layers), 2 * p)


def plan_for(s: Setup, p: int, schedule: str, path: Path) -> Path:
    from torchpp.models.presets import load_config, model_info
    from torchpp.plans import make_chunked_plan

    info = model_info(load_config(s.model), s.model)
    plan = make_chunked_plan(info, seq_len=s.seq_len, global_batch=s.batch, num_microbatches=s.microbatches,
                             layer_ranges=chunk_ranges(s, p), schedule=schedule, chunks_per_device=2)
    plan.save(path)
    return path


# ----------------------------------------------------------------------------- inside a rank
class TorchppSteps:
    """What ``trainer.train`` runs per step: the executor over every chunk of the rank, then the
    statistics all-reduce."""

    def __init__(self, s: Setup, plan: Path, rank: int, world: int):
        from torchpp.data import SyntheticTokens
        from torchpp.runtime.comm import Comm
        from torchpp.runtime.executor import Executor
        from torchpp.runtime.trainer import TrainConfig, _build_chunks, make_optimizer, prepare

        prep = prepare(TrainConfig(plan=plan, lr=s.lr, seed=s.seed, threads=1, timeout_s=s.timeout_s), world)
        self.plan = prep.plan
        self.chunks = self.plan.stages_of_rank(rank)
        comm = Comm(rank, s.timeout_s, boundaries=self.plan.num_stages - 1, samples=self.plan.micro_batch_size)
        comm.make_groups(prep.schedule)
        stages = _build_chunks(prep, self.plan, [c.index for c in self.chunks], s.seed)
        opt = make_optimizer("adamw", stages.parameters(), s.lr, 0.0)
        self.executor = Executor(rank=rank, plan=self.plan, actions=prep.schedule[rank], stage=stages, comm=comm,
                                 optimizer=opt, schedule=prep.schedule)
        needs = any(c.has_embed or c.has_tail for c in self.chunks)
        self.data = SyntheticTokens(vocab_size=self.plan.model.vocab_size, seq_len=s.seq_len, global_batch=s.batch,
                                    seed=s.seed) if needs else None

    def step(self, index: int) -> tuple[float, float]:
        from torchpp.models.stages import count_targets
        from torchpp.runtime.trainer import _reduce_stats

        ids = self.data.batch(index) if self.data is not None else None
        n_tokens = count_targets(ids) if ids is not None and self.chunks[-1].has_tail else None
        t0 = time.perf_counter()
        res = self.executor.step(ids, n_tokens)
        stats = _reduce_stats(res, {c.index: len(c.devices) for c in self.chunks}, self.plan.num_stages)
        return time.perf_counter() - t0, float(stats[0])


def _peer_chunk(s: Setup, cfg, chunk: int, layers: tuple[int, int], last: bool):
    """One chunk as the peer's examples build it: the whole model, pruned to the chunk."""
    from peer_part import peer_part

    from torchpp.models.presets import build_model
    from torchpp.models.stages import _get

    model = build_model(s.model, seed=s.seed, config=cfg)
    part, stage = peer_part(model, cfg, layers, first=chunk == 0, last=last)
    parts = stage.parts  # found before the pruning
    tied = None
    if getattr(cfg, "tie_word_embeddings", False) and (chunk == 0 or last):
        tied = _get(model, parts.token).weight if chunk == 0 else _get(model, parts.lm_head).weight
    return part, tied


class PeerSteps:
    """``torch.distributed.pipelining``: one ``PipelineStage`` per chunk of the rank, the schedule class."""

    def __init__(self, s: Setup, schedule: str, rank: int, world: int):
        import datetime

        import torch
        import torch.distributed as dist
        import torch.distributed.pipelining as pp

        from torchpp.data import SyntheticTokens
        from torchpp.models.presets import load_config
        from torchpp.models.stages import Stage, count_targets
        from torchpp.runtime.trainer import make_optimizer

        torch.set_num_threads(1)
        self.s = s
        cfg = load_config(s.model)
        ranges = chunk_ranges(s, world)
        S = len(ranges)
        mine = [rank, 2 * world - 1 - rank] if schedule == "zbv" else [rank, rank + world]
        timeout = datetime.timedelta(seconds=s.timeout_s)
        group = dist.new_group(list(range(world)), timeout=timeout)
        stages, params, self.tied = [], [], []
        for c in mine:
            part, tied = _peer_chunk(s, cfg, c, ranges[c], c == S - 1)
            stages.append(pp.PipelineStage(part, c, S, torch.device("cpu"), group=group))
            params += list(part.parameters())
            if tied is not None:
                self.tied.append(tied)
        cls = getattr(pp, PAIRS[schedule])
        self.sched = cls(stages, s.microbatches,
                         loss_fn=lambda logits, target: Stage.loss(logits, target, count_targets(target)))
        self.opt = make_optimizer("adamw", params, s.lr, 0.0)
        self.first, self.last = 0 in mine, S - 1 in mine
        self.tied_group = dist.new_group([0, world - 1], timeout=timeout) if schedule != "zbv" else None
        self.data = SyntheticTokens(vocab_size=int(cfg.vocab_size), seq_len=s.seq_len, global_batch=s.batch,
                                    seed=s.seed)

    def _sum_tied(self) -> None:
        import torch
        import torch.distributed as dist

        grads = [t.grad if t.grad is not None else torch.zeros_like(t) for t in self.tied]
        total = sum(grads[1:], grads[0].clone()) if grads else None
        if total is not None and self.tied_group is not None:
            dist.all_reduce(total, group=self.tied_group)
        for t in self.tied:
            t.grad = total.clone() if len(self.tied) > 1 else total

    def step(self, index: int) -> tuple[float, float]:
        import torch
        import torch.distributed as dist

        ids = self.data.batch(index)
        t0 = time.perf_counter()
        losses: list[torch.Tensor] = []
        args = (ids,) if self.first else ()
        kw = dict(target=ids, losses=losses) if self.last else {}
        self.sched.step(*args, return_outputs=False, **kw)
        if self.tied:
            self._sum_tied()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        v = torch.zeros(1, dtype=torch.float64)
        if self.last:
            v[0] = sum(float(x.detach()) for x in losses) / self.s.microbatches
        dist.all_reduce(v)
        return time.perf_counter() - t0, float(v[0])


def worker(rank: int, world: int, mode: str, schedule: str, setup: dict[str, Any], plan: str) -> dict[str, Any]:
    """``alternating``: both systems here, one step each in turn; ``torchpp``/``peer``: one alone."""
    import torch

    from torchpp.runtime.allocator import retain_freed_memory

    torch.set_num_threads(1)
    s = Setup(**setup)
    if mode != "peer":
        retain_freed_memory()  # torchpp's policy (train() sets it); in alternating runs both run under it
    times: dict[str, list[float]] = {}
    losses: dict[str, list[float]] = {}
    with RssSampler() as rss:
        systems = {}
        if mode in ("alternating", "torchpp"):
            systems["torchpp"] = TorchppSteps(s, Path(plan), rank, world)
        if mode in ("alternating", "peer"):
            systems["peer"] = PeerSteps(s, schedule, rank, world)
        names = list(systems)
        for i in range(s.warmup + s.steps):
            for name in (names if i % 2 == 0 else names[::-1]):
                dt, loss = systems[name].step(i)
                times.setdefault(name, []).append(dt)
                losses.setdefault(name, []).append(loss)
    return {"times": times, "losses": losses, "peak_rss": rss.peak,
            "hwm": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


# ----------------------------------------------------------------------------- the parent
def launch(mode: str, schedule: str, p: int, s: Setup, plan: Path, out: Path) -> list[dict[str, Any]]:
    from torchpp.runtime.launch import run_ranks

    (out / "runs").mkdir(parents=True, exist_ok=True)
    return run_ranks(p, worker, mode, schedule, asdict(s), str(plan), timeout_s=s.timeout_s + 60 * (s.steps + 2),
                     pg_timeout_s=s.timeout_s, threads=1, log=str(out / "runs" / f"{mode}_{schedule}_pp{p}_rank{{rank}}.log"))


def compare(s: Setup, schedule: str, p: int, out: Path, memory: bool = True) -> dict[str, Any]:
    """One pair on p ranks: paired step-time ratio and per-rank peak RSS ratio (``memory``: else
    no separate runs, and no RSS figures)."""
    plan = plan_for(s, p, schedule, out / f"plan_{schedule}_pp{p}.json")
    alt = launch("alternating", schedule, p, s, plan, out)[0]
    w = s.warmup
    tp, pe = alt["times"]["torchpp"][w:], alt["times"]["peer"][w:]
    alone = {m: launch(m, schedule, p, s, plan, out) for m in ("torchpp", "peer")} if memory else {}
    mem = {m: [r["hwm"] for r in alone.get(m, ())] for m in ("torchpp", "peer")}
    sampled = {m: [r["peak_rss"] for r in alone.get(m, ())] for m in ("torchpp", "peer")}
    dloss = max(abs(a - b) for a, b in zip(alt["losses"]["torchpp"], alt["losses"]["peer"]))
    ratios = [a / b for a, b in zip(tp, pe)]
    q1, _, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (ratios[0],) * 3
    return {"schedule": schedule, "peer": PAIRS[schedule], "ranks": p, "torchpp_step_s": statistics.median(tp),
            "peer_step_s": statistics.median(pe), "step_ratio": statistics.median(ratios),
            "step_ratio_quartiles": [q1, q3], "step_ratios": ratios,
            "rss_torchpp_mib": [x / 2**20 for x in mem["torchpp"]], "rss_peer_mib": [x / 2**20 for x in mem["peer"]],
            "rss_ratio": [a / b for a, b in zip(mem["torchpp"], mem["peer"])],
            "rss_sampled_torchpp_mib": [x / 2**20 for x in sampled["torchpp"]],
            "rss_sampled_peer_mib": [x / 2**20 for x in sampled["peer"]], "max_loss_diff": dloss}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="qwen3-tiny, batch 8 x 16, 1+2 steps, 2 ranks, no memory runs: checks that it runs")
    ap.add_argument("--ranks", type=int, nargs="+", default=None, help="pipeline sizes (default 2 4; --quick 2)")
    ap.add_argument("--no-memory", action="store_true", help="skip the separate peak-RSS runs")
    ap.add_argument("--schedules", nargs="+", default=list(PAIRS), choices=list(PAIRS))
    ap.add_argument("--steps", type=int, default=None, help="measured steps per system (default 6; --quick 2)")
    ap.add_argument("--model", default=None, help="preset (default qwen3-small; --quick qwen3-tiny); qwen3-tiny with "
                    "--batch 8 --seq-len 16 gives stages whose calls are short, where the runtime's own time shows")
    ap.add_argument("--batch", type=int, default=None, help="global batch (default 16; --quick 8), 8 micro-batches")
    ap.add_argument("--seq-len", type=int, default=None, help="tokens per sample (default 64; --quick 16)")
    ap.add_argument("--out", type=Path, default=ROOT / "out" / "bench_chunked")
    a = ap.parse_args(argv)
    s = Setup(**{**DEFAULTS, **(dict(model="qwen3-tiny", batch=8, seq_len=16, steps=2) if a.quick else {})})
    given = {k: v for k, v in (("model", a.model), ("batch", a.batch), ("seq_len", a.seq_len)) if v is not None}
    s = replace(s, **given)
    ranks = a.ranks or ([2] if a.quick else [2, 4])
    memory = not (a.quick or a.no_memory)
    if a.steps is not None:
        s = replace(s, steps=a.steps)
    a.out.mkdir(parents=True, exist_ok=True)
    print(f"bench_chunked: {s.model}, batch {s.batch} x {s.seq_len}, {s.microbatches} micro-batches, ranks {ranks}; "
          f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores", flush=True)
    rows = []
    for p in ranks:
        for sched in a.schedules:
            r = compare(s, sched, p, a.out, memory)
            rows.append(r)
            print(f"{sched:<15} vs {r['peer']:<30} p={p}: step torchpp/peer {r['step_ratio']:.3f} "
                  f"[quartiles {r['step_ratio_quartiles'][0]:.3f}-{r['step_ratio_quartiles'][1]:.3f}] "
                  f"({r['torchpp_step_s']:.3f} s / {r['peer_step_s']:.3f} s); peak RSS torchpp/peer per rank "
                  f"{' '.join(f'{x:.3f}' for x in r['rss_ratio'])} "
                  f"({' '.join(f'{x:.0f}' for x in r['rss_torchpp_mib'])} / "
                  f"{' '.join(f'{x:.0f}' for x in r['rss_peer_mib'])} MiB); |dloss| {r['max_loss_diff']:.1e}",
                  flush=True)
    import json

    (a.out / "results.json").write_text(json.dumps({"setup": asdict(s), "rows": rows,
                                                    "load_average": os.getloadavg()}, indent=1))
    print(f"load average {os.getloadavg()[0]:.2f} after; wrote {a.out / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
