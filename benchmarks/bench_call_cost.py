"""The runtime's CPU per compute call: what one rank spends between its compute calls, in CPU seconds.

    python benchmarks/bench_call_cost.py                 # 1f1b, interleaved, zbv on 2 ranks, qwen3-tiny
    python benchmarks/bench_call_cost.py --quick         # 1f1b, a few steps: checks that it runs
    python benchmarks/bench_call_cost.py --compare-to /tmp/base   # and a baseline checkout's runtime, alternating

The call probe (``torchpp.profiling.call_probe``) reads the wall-clock gaps between compute
calls off traced steps; on a machine shared with other work those gaps hold other processes'
time too. This counts CPU instead: each rank runs ``Executor.step`` as ``torchpp train`` does
(untraced), and per step takes its process CPU time (every thread: the compute loop, gloo's I/O
threads, the send waiter) minus the CPU its compute thread spent inside the compute calls
(the stage's forward and the backward passes, each timed with the thread's own CPU clock)
and the CPU of the step's end (all-reduces, the last sends' wait, the optimizer: the process's
CPU while they run, left out as the call probe leaves them out). What is left, divided by the rank's F/B/I/W calls, is the runtime's
CPU per call: dispatch, posting receives and sends, copies, waking threads. The model is
small (one sample of 16 tokens per micro-batch) so the figure is not lost in the compute.
"""
from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CODE = Path(sys.argv[sys.argv.index("--tree") + 1]).resolve() if "--tree" in sys.argv[:-1] else ROOT
"""The torchpp this process (and its spawned ranks, which inherit ``sys.path``) imports: this
checkout, or ``--tree``'s (a baseline measured by ``--compare-to``)."""
sys.path.insert(0, str(CODE))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

SCHEDULES = ("1f1b", "interleaved", "zbv")


def plan_for(model: str, schedule: str, p: int, microbatches: int, seq_len: int, path: Path) -> Path:
    from torchpp.models.presets import load_config, model_info
    from torchpp.plans import even_layer_ranges, make_chunked_plan, make_plan

    info = model_info(load_config(model), model)
    kw = dict(seq_len=seq_len, global_batch=microbatches, num_microbatches=microbatches)
    if schedule == "1f1b":
        plan = make_plan(info, layer_ranges=even_layer_ranges(info.num_layers, p), group_sizes=[1] * p,
                         schedule=schedule, **kw)
    else:
        plan = make_chunked_plan(info, layer_ranges=even_layer_ranges(info.num_layers, 2 * p), schedule=schedule,
                                 chunks_per_device=2, **kw)
    plan.save(path)
    return path


class _ComputeClock:
    """Thread CPU seconds spent inside the wrapped compute functions (not nested)."""

    def __init__(self, clock=time.thread_time) -> None:
        self.clock = clock
        self.cpu_s = 0.0
        self.calls = 0
        self.depth = 0
        """Wrapped calls running now (on the compute thread): one wrapped function may call another
        (a split backward runs ``torch.autograd.backward``), and only the outermost is timed and counted."""

    def wrap(self, fn, count: bool = True):
        def timed(*a, **kw):
            outer = self.depth == 0
            self.depth += 1
            t0 = self.clock() if outer else 0.0
            try:
                return fn(*a, **kw)
            finally:
                self.depth -= 1
                if outer:
                    self.cpu_s += self.clock() - t0
                    self.calls += count
        return timed


def thread_cpu() -> dict[str, float]:
    """CPU seconds of each thread of this process so far, by thread name (summed over equal names)."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            name = Path(f"/proc/self/task/{tid}/comm").read_text().strip()
            fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the thread ended
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def worker(rank: int, world: int, plan: str, steps: int, warmup: int) -> dict[str, Any]:
    import torch

    from torchpp.data import SyntheticTokens
    from torchpp.models.stages import count_targets
    from torchpp.runtime import executor as ex
    from torchpp.runtime.allocator import retain_freed_memory
    from torchpp.runtime.comm import Comm
    from torchpp.runtime.trainer import TrainConfig, _build_chunks, make_optimizer, prepare

    torch.set_num_threads(1)
    retain_freed_memory()
    prep = prepare(TrainConfig(plan=Path(plan), threads=1, timeout_s=120.0), world)
    chunks = prep.plan.stages_of_rank(rank)
    comm = Comm(rank, 120.0, boundaries=prep.plan.num_stages - 1, samples=prep.plan.micro_batch_size)
    comm.make_groups(prep.schedule)
    stages = _build_chunks(prep, prep.plan, [c.index for c in chunks], 0)
    opt = make_optimizer("adamw", stages.parameters(), 1e-3, 0.0)
    clock = _ComputeClock()
    for st in stages.chunks.values():
        st.forward = clock.wrap(st.forward)
    ex.backward_input = clock.wrap(ex.backward_input)
    ex.backward_weight = clock.wrap(ex.backward_weight)
    real_backward = torch.autograd.backward
    known = inspect.signature(ex.Executor).parameters  # a baseline tree's (--compare-to) may predate an option
    executor = ex.Executor(rank=rank, plan=prep.plan, actions=prep.schedule[rank], stage=stages, comm=comm,
                           optimizer=opt, **({"schedule": prep.schedule} if "schedule" in known else {}))
    # the end of the step (all-reduces, waiting for the sends, the optimizer) is left out as the call
    # probe leaves it out: its CPU (gloo's threads' included) is counted with the process clock
    end = _ComputeClock(time.process_time)
    executor._allreduce_action = end.wrap(executor._allreduce_action, count=False)
    executor._optimizer_action = end.wrap(executor._optimizer_action, count=False)
    if hasattr(executor, "_compile"):
        executor._program = executor._compile()
    needs = any(c.has_embed or c.has_tail for c in chunks)
    data = SyntheticTokens(vocab_size=prep.plan.model.vocab_size, seq_len=prep.plan.seq_len,
                           global_batch=prep.plan.global_batch, seed=0) if needs else None
    per_call, wall, losses = [], [], []
    threads0: dict[str, float] = {}
    torch.autograd.backward = clock.wrap(real_backward)
    try:
        for i in range(warmup + steps):
            ids = data.batch(i) if data is not None else None
            n_tokens = count_targets(ids) if ids is not None and chunks[-1].has_tail else None
            torch.distributed.barrier()
            clock.cpu_s, clock.calls, end.cpu_s = 0.0, 0, 0.0
            c0, t0 = time.process_time(), time.perf_counter()
            res = executor.step(ids, n_tokens)
            c1, t1 = time.process_time(), time.perf_counter()
            losses.append(res.loss)
            if i == warmup:
                threads0 = thread_cpu()
            if i >= warmup:
                per_call.append((c1 - c0 - clock.cpu_s - end.cpu_s) / clock.calls)
                wall.append(t1 - t0)
    finally:
        torch.autograd.backward = real_backward
    threads = {k: v - threads0.get(k, 0.0) for k, v in thread_cpu().items()}
    weights = hashlib.sha256()  # the trained weights, bit for bit: what --compare-to compares
    for _, p in stages.named_parameters():
        weights.update(p.detach().contiguous().numpy().tobytes())
    return {"per_call_cpu_s": per_call, "step_wall_s": wall, "calls": clock.calls, "losses": losses,
            "thread_cpu_s": {k: v for k, v in threads.items() if v > 0}, "weights_sha256": weights.hexdigest()}


def measure(schedule: str, p: int, model: str, microbatches: int, seq_len: int, steps: int, warmup: int,
            out: Path) -> list[dict[str, Any]]:
    from torchpp.runtime.launch import run_ranks

    plan = plan_for(model, schedule, p, microbatches, seq_len, out / f"plan_{schedule}_pp{p}.json")
    return run_ranks(p, worker, str(plan), steps, warmup, timeout_s=300.0, pg_timeout_s=120.0, threads=1,
                     log=str(out / f"{schedule}_pp{p}_rank{{rank}}.log"))


def measure_tree(tree: Path, schedule: str, a: argparse.Namespace, steps: int, out: Path) -> list[dict[str, Any]]:
    """``measure`` with ``tree``'s torchpp, in a fresh interpreter (this file's worker, that tree's runtime)."""
    res = out / f"{schedule}_tree.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--tree", str(tree), "--json", str(res), "--schedules",
           schedule, "--ranks", str(a.ranks), "--model", a.model, "--microbatches", str(a.microbatches),
           "--seq-len", str(a.seq_len), "--steps", str(steps), "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{tree}: the measurement failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return json.loads(res.read_text())[schedule]


def _medians(ranks: list[dict[str, Any]]) -> list[float]:
    return [statistics.median(x["per_call_cpu_s"]) for x in ranks]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="1f1b only, 3 steps: checks that it runs")
    ap.add_argument("--schedules", nargs="+", default=None, choices=SCHEDULES)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--model", default="qwen3-tiny")
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=16)
    ap.add_argument("--steps", type=int, default=None, help="measured steps (default 30; --quick 3)")
    ap.add_argument("--out", type=Path, default=ROOT / "out" / "bench_call_cost")
    ap.add_argument("--compare-to", type=Path, default=None, metavar="TREE",
                    help="another checkout of torchpp (say `git archive` of a baseline commit): each schedule is "
                         "also measured with its runtime, alternating with this one, and the ratio printed")
    ap.add_argument("--rounds", type=int, default=1, help="with --compare-to: baseline/this pairs per schedule")
    ap.add_argument("--tree", type=Path, default=None, help=argparse.SUPPRESS)  # read at import (CODE)
    ap.add_argument("--json", type=Path, default=None, help="also write the per-rank results here")
    a = ap.parse_args(argv)
    schedules = a.schedules or (["1f1b"] if a.quick else list(SCHEDULES))
    steps = a.steps or (3 if a.quick else 30)
    a.out.mkdir(parents=True, exist_ok=True)
    print(f"bench_call_cost: {a.model}, {a.microbatches} micro-batches of 1 x {a.seq_len}, {a.ranks} ranks, "
          f"{steps} steps; load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores", flush=True)
    everything: dict[str, list[dict[str, Any]]] = {}
    for sched in schedules:
        pairs = []
        for _ in range(a.rounds if a.compare_to else 1):
            base = measure_tree(a.compare_to, sched, a, steps, a.out / "compare") if a.compare_to else None
            ranks = measure(sched, a.ranks, a.model, a.microbatches, a.seq_len, steps, 2, a.out)
            pairs.append((base, ranks))
        everything[sched] = ranks
        cells = [f"rank {r}: {statistics.median(x['per_call_cpu_s']) * 1e3:.3f} ms "
                 f"(quartiles {' '.join(f'{q * 1e3:.3f}' for q in statistics.quantiles(x['per_call_cpu_s'], n=4)[::2])})"
                 for r, x in enumerate(ranks)]
        print(f"{sched:<12} runtime CPU per call, median of {steps} steps: {'; '.join(cells)}; "
              f"{ranks[0]['calls']} calls a step; step wall {statistics.median(ranks[0]['step_wall_s']) * 1e3:.1f} ms",
              flush=True)
        for r, x in enumerate(ranks):
            print(f"  rank {r} CPU s by thread over {steps} steps: "
                  + ", ".join(f"{k} {v:.2f}" for k, v in sorted(x["thread_cpu_s"].items(), key=lambda kv: -kv[1])))
        for i, (base, ranks) in enumerate(pairs if a.compare_to else ()):
            old, new = _medians(base), _medians(ranks)
            same = all(x["losses"] == y["losses"] and x["weights_sha256"] == y["weights_sha256"]
                       for x, y in zip(base, ranks))
            print(f"  round {i + 1}: {a.compare_to} / this runtime, CPU per call: "
                  + "; ".join(f"rank {r} {o * 1e3:.3f} / {n * 1e3:.3f} ms = {n / o:.2f}x"
                              for r, (o, n) in enumerate(zip(old, new)))
                  + f"; step wall (rank 0) {statistics.median(base[0]['step_wall_s']) * 1e3:.2f} / "
                  f"{statistics.median(ranks[0]['step_wall_s']) * 1e3:.2f} ms"
                  + f"; losses and weights bit-identical: {same}", flush=True)
    if a.json is not None:
        a.json.write_text(json.dumps(everything))
    return 0


if __name__ == "__main__":
    sys.exit(main())
