"""Hook overhead: step time (forward + loss + backward) with the block hooks / without.

For each model, steps alternate bare and hooked (ABBA order, attaching and detaching the
hooks between steps, so drift in machine load hits both alike); the printed ratio is the
median hooked step over the median bare step (and the same for means).

    python benchmarks/bench_hooks.py [--models qwen3-tiny qwen3-0.6b] [--layers 2] [--seq-len 128] [--batch 2]
    python benchmarks/bench_hooks.py --quick      # qwen3-tiny, seq 16, 4 steps: checks that it runs, no measurement
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from torchpp.models.presets import build_model
from torchpp.profiling.hooks import BlockProfiler


def _step(model, ids, prof: BlockProfiler | None) -> float:
    t0 = time.perf_counter()
    if prof is None:
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    else:
        prof.run_step(ids)
    dt = time.perf_counter() - t0
    model.zero_grad(set_to_none=True)
    return dt


def bench(name: str, layers: int | None, seq: int, batch: int, steps: int) -> tuple[float, float, float, float]:
    """Alternate bare and hooked steps (ABBA) so machine load drifts hit both alike.

    Returns (median bare s, median hooked s, ratio of medians, ratio of means)."""
    model = build_model(name, num_layers=layers)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    prof = BlockProfiler(model)
    for _ in range(2):  # warm up allocator and kernels, both ways
        _step(model, ids, None)
        prof.attach()
        _step(model, ids, prof)
        prof.detach()
    got: dict[bool, list[float]] = {False: [], True: []}
    for i in range(steps):
        hooked = (i % 4) in (1, 2)
        if hooked:
            prof.attach()
        got[hooked].append(_step(model, ids, prof if hooked else None))
        prof.detach()
    b, h = statistics.median(got[False]), statistics.median(got[True])
    return b, h, h / b, statistics.fmean(got[True]) / statistics.fmean(got[False])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["qwen3-tiny", "qwen3-0.6b"])
    ap.add_argument("--layers", type=int, default=2, help="decoder layers of qwen3-0.6b (tiny presets keep theirs)")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=None, help="steps per model, half of them hooked (ABBA order); "
                    "default 200 for tiny presets, 24 for qwen3-0.6b")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--quick", action="store_true", help="qwen3-tiny, seq 16, 4 steps: checks that it runs, no measurement")
    a = ap.parse_args()
    if a.quick:
        a.models, a.seq_len, a.steps = ["qwen3-tiny"], 16, 4
    torch.set_num_threads(a.threads)
    print(f"seq {a.seq_len}, batch {a.batch}, {a.threads} thread(s), half of the steps hooked (ABBA)")
    print(f"{'model':<24} {'steps':>6} {'bare ms':>10} {'hooked ms':>10} {'ratio (medians)':>16} {'ratio (means)':>14}")
    for name in a.models:
        layers = a.layers if name == "qwen3-0.6b" else None
        steps = a.steps or (24 if name == "qwen3-0.6b" else 200)
        b, h, r, rm = bench(name, layers, a.seq_len, a.batch, steps)
        label = f"{name}" + (f" ({layers} layers)" if layers else "")
        print(f"{label:<24} {steps:>6} {b * 1e3:10.2f} {h * 1e3:10.2f} {r:16.4f} {rm:14.4f}", flush=True)


if __name__ == "__main__":
    main()
