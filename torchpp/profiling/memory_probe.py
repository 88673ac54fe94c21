"""One memory-calibration span, run in its own process: ``python -m torchpp.profiling.memory_probe``.

Builds the stage the runtime would build for decoder layers [start, end) (plus the embedding
and/or tail), runs a few forward + backward + AdamW steps on ``batch`` samples, and prints one JSON line
with the peak resident-set increase over the process's RSS before the model was built. The
peak is sampled with psutil from a background thread (torch releases the GIL in its kernels).
A fresh process per span keeps one span's allocator state out of the next span's figure.

Three orders: ``fb`` (each micro-batch's forward then its full backward, one held at a time),
``gpipe`` (every forward, then every full backward: all ``microbatches`` held at once, what the
memory model's ``Kb`` is fitted on) and ``zb`` (one stage of a ZB-H1 pipeline: the F, I and W
order of ``--zb-position`` of ``--zb-stages``, read off ``schedules.position_order``, with the
runtime's own ``backward_input`` / ``backward_weight``), whose peak holds ``held`` micro-batches,
``past_input`` of them past their I (read off the same order): what the memory model's ``Kw``
and ``Kz`` are fitted on; ``chunks`` (one device of an interleaved pipeline holding two chunks:
the span and ``--second-start``/``--second-end``, chunks ``--zb-position`` and that plus
``--zb-stages``, running its order of F and B over twice as many micro-batches as stages), what
the memory model's ``Kc`` is fitted on.
"""
from __future__ import annotations

import argparse
import json
import threading
import time

PROBE_STEPS = 3
ORDERS = ("fb", "gpipe", "zb", "chunks")
"""``fb``: forward then full backward per micro-batch; ``gpipe``: all F, then every full backward
(every micro-batch held at once); ``zb``: the F, I and W order of one ZB-H1 stage; ``chunks``: the
F and B order of an interleaved device holding two chunks."""


class PeakRSS:
    """Samples this process's RSS every ``interval`` seconds and keeps the maximum."""

    def __init__(self, interval: float = 0.0005):
        import psutil

        from ..runtime.tracing import reset_peak_rss

        reset_peak_rss()  # the kernel's high-water mark then counts from here, not from the imports
        self.proc, self.interval = psutil.Process(), interval
        self.base = self.proc.memory_info().rss
        self.peak = self.base
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(self.interval)

    def __enter__(self) -> "PeakRSS":
        self._t.start()
        return self

    def __exit__(self, *exc) -> None:
        from ..runtime.tracing import peak_rss_bytes

        # the kernel's high-water mark catches what sampling misses; the runtime reports it too
        self.peak = max(self.peak, self.proc.memory_info().rss, peak_rss_bytes())
        self._stop.set()
        self._t.join()


def run_span(model: str, start: int, end: int, has_embed: bool, has_tail: bool, batch: int, seq_len: int,
             threads: int = 1, steps: int = PROBE_STEPS, microbatches: int = 1, order: str = "fb",
             zb_stages: int = 2, zb_position: int = 1, second: tuple[int, int] | None = None) -> dict:
    """The runtime's own stage (``build_stage``) and optimizer, trained ``steps`` times.

    One step is not enough: AdamW's moments only exist after the first ``step()``, so the first
    backward's activations sit beside weights and gradients alone, while every later one sits
    beside the moments too; from the second step on the peak is the one a training rank sees.
    With ``microbatches`` > 1 each step accumulates gradients over that many micro-batches, as a
    pipeline rank does: every backward after the first runs beside the whole stage's gradients
    and adds its own into them. ``order``: see :data:`ORDERS`."""
    import torch

    from ..models.presets import load_config, num_hidden_layers
    from ..models.stages import StageSpec, build_stage, build_stages
    from ..runtime.allocator import retain_freed_memory
    from ..runtime.trainer import make_optimizer

    retain_freed_memory()  # the allocator policy of a training rank, whose peak this predicts
    torch.set_num_threads(threads)
    cfg = load_config(model)
    total = num_hidden_layers(cfg)
    if not 0 <= start < end <= total:
        raise ValueError(f"span [{start}, {end}) outside the model's {total} layers")
    if steps < 1 or microbatches < 1:
        raise ValueError(f"steps, microbatches: expected at least 1, got {steps}, {microbatches}")
    if order not in ORDERS:
        raise ValueError(f"order: expected one of {', '.join(ORDERS)}, got {order!r}")
    if order == "zb" and not 0 <= zb_position < zb_stages:
        raise ValueError(f"zb position {zb_position} outside the {zb_stages} stage(s)")
    if order == "chunks" and (second is None or not end <= second[0] < second[1] <= total or has_tail):
        raise ValueError(f"chunks: expected a second span after [{start}, {end}) inside the model's {total} "
                         f"layers, the first without the tail, got {second}")
    vocab = int(cfg.vocab_size)
    gen = torch.Generator().manual_seed(0)
    kept_ratio = None
    with PeakRSS() as rss:
        if order == "chunks":
            specs = {0: StageSpec(layers=(start, end), has_embed=has_embed, has_tail=False),
                     1: StageSpec(layers=tuple(second), has_embed=False, has_tail=second[1] == total)}
            stage = build_stages(model, cfg, specs)
        else:
            stage = build_stage(model, cfg, StageSpec(layers=(start, end), has_embed=has_embed, has_tail=has_tail))
        opt = make_optimizer("adamw", stage.parameters(), 1e-4, 0.0)
        for _ in range(steps):
            if order == "chunks":
                _chunks_step(stage, has_embed, batch, seq_len, vocab, gen, microbatches, zb_stages, zb_position)
            elif order == "zb":
                kept_ratio = _split_step(stage, has_embed, has_tail, batch, seq_len, vocab, gen, microbatches,
                                         zb_stages, zb_position)
            elif order == "gpipe":
                for _x, out, grad in [_forward(stage, has_embed, has_tail, batch, seq_len, vocab, gen)
                                      for _mb in range(microbatches)]:
                    out.backward(grad)
            else:
                for _mb in range(microbatches):
                    _one_microbatch(stage, has_embed, has_tail, batch, seq_len, vocab, gen)
            opt.step()
            opt.zero_grad(set_to_none=True)
    out = {"start": start, "end": end, "has_embed": has_embed, "has_tail": has_tail, "batch": batch,
           "steps": steps, "microbatches": microbatches, "order": order, "peak_bytes": int(rss.peak - rss.base),
           "base_rss_bytes": int(rss.base)}
    if order == "chunks":
        out["second"], out["position"] = list(second), zb_position
    if order == "zb":
        out["held"], out["past_input"] = zb_peak_profile(zb_stages, zb_position, microbatches)
        out["kept_ratio"] = kept_ratio
    return out


def _forward(stage, has_embed: bool, has_tail: bool, batch: int, seq_len: int, vocab: int, gen):
    """One micro-batch's input, forward output and the gradient its backward starts from."""
    import torch

    if has_embed:
        x = torch.randint(0, vocab, (batch, seq_len), generator=gen)
    else:  # a received activation: the runtime computes its gradient to send it back
        x = torch.randn(batch, seq_len, stage.hidden_size, generator=gen).requires_grad_(True)
    if has_tail:
        labels = torch.randint(0, vocab, (batch, seq_len), generator=gen)
        return x, stage.forward(x, labels, batch * (seq_len - 1)), None
    out = stage.forward(x)
    return x, out, torch.randn(out.shape, generator=gen)


def _one_microbatch(stage, has_embed: bool, has_tail: bool, batch: int, seq_len: int, vocab: int, gen) -> None:
    """Forward and backward of one micro-batch, its gradients added into the stage's."""
    _, out, grad = _forward(stage, has_embed, has_tail, batch, seq_len, vocab, gen)
    out.backward(grad)


def _split_step(stage, has_embed: bool, has_tail: bool, batch: int, seq_len: int, vocab: int, gen,
                microbatches: int, zb_stages: int, zb_position: int) -> float | None:
    """One step of a ZB-H1 stage at ``zb_position`` of ``zb_stages`` over ``microbatches``: its
    own order of F, I and W (``schedules.position_order``, the order its rank runs), with the
    executor's ``backward_input`` / ``backward_weight``. A span holding the embedding has no input
    gradient: its micro-batches stay whole until their W. Returns the bytes the first micro-batch
    keeps past its I over the bytes its graph saved (live tensors, counted by storage; None where
    I keeps nothing)."""
    import contextlib

    import torch

    from ..formats import placement_of
    from ..models.stages import backward_input, backward_weight
    from ..schedules import position_order

    stage.defer_weight_gradients()
    weights = [p for p in stage.parameters() if p.requires_grad]
    pl = placement_of("zb-h1", zb_stages, 1)
    held, tasks = {}, {}
    saved: dict[int, int] = {}

    def count(t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, torch.nn.Parameter):
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    ratio = None
    for kind, _chunk, mb in position_order("zb-h1", pl, pl.position[zb_position], microbatches):
        if kind.value == "F":
            with torch.autograd.graph.saved_tensors_hooks(count, lambda t: t) if mb == 0 else contextlib.nullcontext():
                held[mb] = _forward(stage, has_embed, has_tail, batch, seq_len, vocab, gen)
        elif kind.value == "I":
            x, out, grad = held.pop(mb)
            _, tasks[mb] = backward_input(out, grad, x, weights, [])
            del x, out, grad  # the input gradient is sent on and dropped
            if mb == 0 and tasks[0].kept is not None and saved:
                kept = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                        for d in tasks[0].kept for t in (d.x, d.dy)}
                ratio = sum(kept.values()) / sum(saved.values())
        elif kind.value == "W":
            backward_weight(tasks.pop(mb))
    if held or tasks:
        raise RuntimeError(f"zb-h1 position {zb_position} of {zb_stages}: micro-batches {sorted({*held, *tasks})} "
                           "were not finished by its order")
    return ratio


def chunks_order(stages: int, position: int, microbatches: int):
    """The F and B order of the device at ``position`` of an interleaved pipeline of ``stages``
    devices holding two chunks each (``position`` and ``position + stages``), as the runtime runs it."""
    from ..formats import placement_of
    from ..schedules import position_order

    pl = placement_of("interleaved", 2 * stages, 2)
    return pl, position_order("interleaved", pl, pl.position[position], microbatches)


def _chunks_step(stages, has_embed: bool, batch: int, seq_len: int, vocab: int, gen, microbatches: int,
                 zb_stages: int, zb_position: int) -> None:
    """One step of an interleaved device holding two chunks (``stages.chunks`` 0 and 1: its chunks
    ``zb_position`` and ``zb_position + zb_stages``), in its own order of F and full B."""
    _, order = chunks_order(zb_stages, zb_position, microbatches)
    held = {}
    for kind, chunk, mb in order:
        c = 0 if chunk < zb_stages else 1
        st = stages.chunks[c]
        if kind.value == "F":
            held[(c, mb)] = _forward(st, has_embed and c == 0, st.spec.has_tail, batch, seq_len, vocab, gen)
        else:
            _x, out, grad = held.pop((c, mb))
            out.backward(grad)
            del _x, out, grad
    if held:
        raise RuntimeError(f"interleaved position {zb_position}: micro-batches {sorted(held)} were not finished")


def zb_peak_profile(zb_stages: int, zb_position: int, microbatches: int) -> tuple[int, int]:
    """(micro-batches held, of them past their I) at the peak of ``_split_step``'s order, read off
    it as the planner reads a stage's (``schedules.in_flight``, ``split_in_flight``). Calibration
    runs twice as many micro-batches as stages, whose steady state comes back to that profile after
    a W: the Kz it fits is the heap a W leaves (``schedules.peak_states``)."""
    from ..schedules import in_flight, split_in_flight

    return (in_flight("zb-h1", zb_stages, zb_position, microbatches),
            split_in_flight("zb-h1", zb_stages, zb_position, microbatches))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", required=True)
    p.add_argument("--start", type=int, required=True)
    p.add_argument("--end", type=int, required=True)
    p.add_argument("--embed", action="store_true")
    p.add_argument("--tail", action="store_true")
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--steps", type=int, default=PROBE_STEPS)
    p.add_argument("--microbatches", type=int, default=1, help="micro-batches accumulated per step")
    p.add_argument("--order", choices=ORDERS, default="fb",
                   help="fb: F then B per micro-batch; gpipe: all F, all B; zb: a ZB-H1 stage's own order; "
                        "chunks: an interleaved device's two chunks in its order")
    p.add_argument("--zb-stages", type=int, default=2, help="zb: stages of the ZB-H1 pipeline")
    p.add_argument("--zb-position", type=int, default=1, help="zb: the probed stage's position in it")
    p.add_argument("--second-start", type=int, default=None, help="chunks: the second chunk's first layer")
    p.add_argument("--second-end", type=int, default=None, help="chunks: the second chunk's end layer")
    a = p.parse_args(argv)
    print(json.dumps(run_span(a.model, a.start, a.end, a.embed, a.tail, a.batch, a.seq_len, a.threads, a.steps,
                              a.microbatches, a.order, a.zb_stages, a.zb_position,
                              None if a.second_start is None else (a.second_start, a.second_end))),
          flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
