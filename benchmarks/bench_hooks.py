"""Hook overhead: step time (forward + loss + backward) with the block hooks / without.

For each model, repetitions alternate bare and hooked runs (ABBA order, so drift in machine
load hits both alike); each run times ``--steps`` steps and keeps their median; the printed
ratio is the median over repetitions of hooked/bare.

    python benchmarks/bench_hooks.py [--models qwen3-tiny qwen3-0.6b] [--layers 2] [--seq-len 128] [--batch 2]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from torchpp.models.presets import build_model
from torchpp.profiling.hooks import BlockProfiler


def _steps(model, ids, n: int, prof: BlockProfiler | None) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        if prof is None:
            model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        else:
            prof.run_step(ids)
        times.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
    return statistics.median(times)


def bench(name: str, layers: int | None, seq: int, batch: int, reps: int, steps: int) -> tuple[float, float, float]:
    model = build_model(name, num_layers=layers)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    prof = BlockProfiler(model)
    _steps(model, ids, 2, None)  # warm up allocator and kernels
    bare, hooked, ratios = [], [], []
    for r in range(reps):
        order = ("bare", "hooked") if r % 2 == 0 else ("hooked", "bare")
        got = {}
        for kind in order:
            if kind == "hooked":
                prof.attach()
                got[kind] = _steps(model, ids, steps, prof)
                prof.detach()
            else:
                got[kind] = _steps(model, ids, steps, None)
        bare.append(got["bare"])
        hooked.append(got["hooked"])
        ratios.append(got["hooked"] / got["bare"])
    return statistics.median(bare), statistics.median(hooked), statistics.median(ratios)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["qwen3-tiny", "qwen3-0.6b"])
    ap.add_argument("--layers", type=int, default=2, help="decoder layers of qwen3-0.6b (tiny presets keep theirs)")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    print(f"seq {a.seq_len}, batch {a.batch}, {a.threads} thread(s), {a.reps} interleaved repetitions × {a.steps} steps")
    print(f"{'model':<24} {'bare ms':>10} {'hooked ms':>10} {'ratio':>8}")
    for name in a.models:
        layers = a.layers if name == "qwen3-0.6b" else None
        b, h, r = bench(name, layers, a.seq_len, a.batch, a.reps, a.steps)
        label = f"{name}" + (f" ({layers} layers)" if layers else "")
        print(f"{label:<24} {b * 1e3:10.2f} {h * 1e3:10.2f} {r:8.4f}", flush=True)


if __name__ == "__main__":
    main()
