"""Measure one host: per-block forward/backward times and bytes of a causal LM (seed 000, step 1).

Runs ``warmup + iters`` forward+backward steps on synthetic random token ids with the block
hooks attached, keeps the ``iters`` counted steps, and returns a :class:`LayersFile`:
per block the parameter bytes (parameters × element size), the bytes of its output tensor
per sample, the mean forward and backward time and the raw per-step samples.
"""
from __future__ import annotations

import platform
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import psutil
import torch

from ..formats import BlockProfile, LayersFile, RunInfo
from ..hostname import host_name
from ..models.blocks import EMBED, TAIL, find_parts, layer_block
from ..models.presets import DTYPES, build_model, has_weights, load_config, model_info
from ..runtime.allocator import retain_freed_memory
from ..trace import cpu_steal
from ..trace.chrome import TraceWriter
from .hooks import BlockProfiler, StepTimes
from .host_memory import OPTIMIZER_SAMPLE_BYTES, Fit, block_bytes, choose_blocks
from .timer import SpanTimer


@dataclass(kw_only=True)
class ProfileConfig:
    """What to measure; field names follow ``torchpp profile``'s options."""

    model: str
    seq_len: int = 128
    batch: int = 2
    dtype: str = "float32"
    iters: int = 6
    warmup: int = 2
    threads: int = 1
    host: str = ""
    num_layers: int | None = None
    """Profile only the first N decoder layers (the layers file then describes N layers)."""
    seed: int = 0
    timer: str | None = None
    """Force a timer backend ("cpp" or "python"); default: the C++ one when built."""
    attn_implementation: str | None = None
    """eager or sdpa, as ``torchpp.train --attn-implementation`` (default: the one training picks)."""
    fit_batches: tuple[int, ...] = ()
    """Smaller batch sizes also measured, to fit each block's per-call time (``*_fixed_s``)."""
    extras: bool = True
    """Also time the optimizer step and the split backward (False: the blocks only, what a speed
    check compares)."""
    memory_bytes: int | None = None
    """``--memory``: this host's memory limit, where the cgroup and the machine do not tell it."""
    left_out: tuple[str, ...] | None = None
    """Blocks not to time (``embed``, ``tail``); None: those this host's memory cannot hold."""

    def __post_init__(self) -> None:
        self.fit_batches = tuple(sorted({int(b) for b in self.fit_batches if b != self.batch}))
        if any(b < 1 or b > self.batch for b in self.fit_batches):
            raise ValueError(f"--batch: expected sizes between 1 and the largest ({self.batch}), got "
                             f"{', '.join(map(str, self.fit_batches))}")
        for name, lo in (("seq_len", 1), ("batch", 1), ("iters", 1), ("warmup", 0), ("threads", 1)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"--{name.replace('_', '-')}: expected an integer >= {lo}, got {v!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype: expected one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.num_layers is not None and self.num_layers < 1:
            raise ValueError(f"--layers: expected an integer >= 1, got {self.num_layers!r}")
        if not self.host:
            self.host = host_name()

    @property
    def autocast(self) -> str:
        """``--dtype bfloat16`` measures what training runs: fp32 weights under bf16 autocast."""
        return "bfloat16" if self.dtype == "bfloat16" else ""

    @property
    def weights_dtype(self) -> str:
        return "float32" if self.autocast else self.dtype


def max_positions(cfg) -> int | None:
    v = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None)
    return int(v) if v else None


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


SMALL_VOCAB = 256
"""Vocabulary of the model timed when the embedding and tail are left out: the decoder layers'
times do not depend on it, and it keeps the left-out blocks' bytes out of memory."""


def _token_ids(pc: ProfileConfig, vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (pc.batch, pc.seq_len), generator=torch.Generator().manual_seed(pc.seed))


def _what_to_time(pc: ProfileConfig, note: Callable[[str], None] | None
                  ) -> tuple[Any, Fit | None, tuple[str, ...], bool]:
    """(the model's config, the memory fit, the blocks left out, whether weights are random), the
    last two said in one line each."""
    cfg = load_config(pc.model, pc.num_layers, pc.attn_implementation)
    limit = max_positions(cfg)
    if limit is not None and pc.seq_len > limit:
        raise ValueError(f"--seq-len: expected at most {limit} (the model's position limit), got {pc.seq_len}")
    fit = choose_blocks(cfg, DTYPES[pc.weights_dtype], pc.batch, pc.seq_len, pc.memory_bytes) \
        if pc.left_out is None else None
    left_out = fit.left_out if fit is not None else tuple(pc.left_out or ())
    random = bool(left_out) or not has_weights(pc.model)
    if note and not has_weights(pc.model):
        note(f"{pc.model}: config.json without weights: random weights from the config (timings do not depend on "
             "the values)")
    if note and fit is not None and left_out:
        note(f"left out {' and '.join(left_out)}: the whole model needs at least {fit.need_all / 2**20:.0f} MiB "
             f"to profile and this host may add {fit.memory.room_bytes / 2**20:.0f} MiB (limit "
             f"{fit.memory.limit_bytes / 2**20:.0f} MiB, {fit.memory.source}); the decoder layers are timed alone "
             "and the planner prices the rest from hosts that timed it")
    return cfg, fit, left_out, random


def measure_layers(pc: ProfileConfig, progress: Callable[[str, int, int, float], None] | None = None,
                   trace: TraceWriter | None = None, note: Callable[[str], None] | None = None) -> LayersFile:
    """Profile ``pc.model`` on this host; ``progress(phase, i, n, step_s)`` after every step;
    ``note(line)`` says which blocks were left out and where weights are random."""
    cfg, fit, left_out, random = _what_to_time(pc, note)
    torch.set_num_threads(pc.threads)
    retain_freed_memory()  # time blocks under the allocator policy training runs with
    timed_cfg = _with_vocab(cfg, SMALL_VOCAB) if left_out else cfg
    model = build_model(pc.model, seed=pc.seed, dtype=pc.weights_dtype, config=timed_cfg, random_weights=random)
    parts, all_ids = find_parts(model), _token_ids(pc, int(timed_cfg.vocab_size))
    timer = SpanTimer(1 << 12, prefer=pc.timer)
    steal_since = cpu_steal.read()
    by_batch, peak = _time_batches(model, parts, timer, all_ids, pc, progress)
    opt_s, opt_bytes = measure_optimizer(model, pc, timer) if pc.extras else ([], 1)
    del model  # the split backward builds a stage of its own
    split = measure_backward_split(cfg, pc, random) if pc.extras else None
    steps, stolen = by_batch[pc.batch], cpu_steal.stolen_cores(steal_since)  # the optimizer's and split's timing too
    if trace is not None:
        write_trace(trace, steps, pc)
    first = steps[0]
    names = [EMBED, *(layer_block(i) for i in range(parts.num_layers)), TAIL]
    untimed = _untimed_blocks(left_out, cfg, timed_cfg, first, pc)

    def block(name: str, index: int | None) -> BlockProfile:
        if name in untimed:
            return untimed[name]
        fw = [s.forward_s[name] for s in steps]
        bw = [s.backward_s[name] for s in steps]
        act = first.activation_bytes[name]
        if act % pc.batch:
            raise RuntimeError(f"{name}: output of {act} bytes does not split into {pc.batch} samples")
        rows = [[float(b), statistics.fmean(s.forward_s[name] for s in st), statistics.fmean(s.backward_s[name] for s in st)]
                for b, st in sorted(by_batch.items())]
        f0, b0 = fit_fixed(rows)
        return BlockProfile(name=name, index=index, param_bytes=parts.param_bytes(name),
                            activation_bytes_per_sample=act // pc.batch, forward_time_s=statistics.fmean(fw),
                            backward_time_s=statistics.fmean(bw), forward_samples_s=fw, backward_samples_s=bw,
                            forward_fixed_s=min(f0, statistics.fmean(fw)), backward_fixed_s=min(b0, statistics.fmean(bw)),
                            batch_times_s=rows if len(rows) > 1 else [])

    walls = [s.wall_s for s in steps]
    return LayersFile(
        host=pc.host, model=model_info(cfg, pc.model, pc.weights_dtype, pc.autocast),
        run=RunInfo(seq_len=pc.seq_len, batch=pc.batch, iters=pc.iters, warmup=pc.warmup, threads=pc.threads,
                    torch_version=torch.__version__, timer=timer.backend, seed=pc.seed, cpu=_cpu_name(),
                    batches=sorted(by_batch) if len(by_batch) > 1 else [],
                    cpu_steal_cores=None if stolen is None else round(stolen, 4)),
        embed=block(EMBED, None), tail=block(TAIL, None), embed_param_bytes=block(EMBED, None).param_bytes,
        tail_param_bytes=block(TAIL, None).param_bytes,
        layers=[block(n, i) for i, n in enumerate(names[1:-1])],
        step_time_s=statistics.fmean(walls), peak_rss_bytes=peak, step_samples_s=walls,
        optimizer_s_per_byte=statistics.fmean(opt_s) / opt_bytes if opt_s else None,
        backward_split_factor=split.factor if split else None, backward_split_layer_s=split.layer_s if split else None,
        left_out=list(left_out), memory_limit_bytes=fit.memory.limit_bytes if fit is not None and left_out else None,
    )


def _time_batches(model: torch.nn.Module, parts: Any, timer: SpanTimer, all_ids: torch.Tensor, pc: ProfileConfig,
                  progress: Callable[[str, int, int, float], None] | None) -> tuple[dict[int, list[StepTimes]], int]:
    """Every batch size's counted steps, and the peak RSS seen (sampled after each forward)."""
    proc, peak = psutil.Process(), 0

    def sample_rss(*_):
        nonlocal peak
        peak = max(peak, proc.memory_info().rss)

    rss_hook = model.register_forward_hook(sample_rss)
    by_batch: dict[int, list[StepTimes]] = {bsz: [] for bsz in (*pc.fit_batches, pc.batch)}
    try:
        with BlockProfiler(model, timer=timer, parts=parts) as prof, \
                torch.autocast("cpu", dtype=torch.bfloat16, enabled=bool(pc.autocast)):
            # the sizes in turn, every round: a load that changes while the host is profiled (the
            # other hosts of an emulated cluster finishing theirs) then weighs on every size alike
            # instead of bending the per-call / per-sample fit; the main batch last in each round
            for i in range(pc.warmup + pc.iters):
                counted = i >= pc.warmup
                for bsz in by_batch:
                    st = prof.run_step(all_ids[:bsz])
                    sample_rss()
                    model.zero_grad(set_to_none=True)
                    if counted:
                        by_batch[bsz].append(st)
                if progress:
                    phase, k, n = ("measure", i - pc.warmup, pc.iters) if counted else ("warmup", i, pc.warmup)
                    tag = f" (batches {', '.join(map(str, by_batch))})" if len(by_batch) > 1 else ""
                    progress(phase + tag, k + 1, n, st.wall_s)
    finally:
        rss_hook.remove()
    return by_batch, peak


def codec_costs(rows: int, hidden: int) -> dict[str, list[float]]:
    """[encode, decode] CPU seconds per fp32 byte of each lossy wire format on this host, on one
    activation-sized message (``rows`` tokens of ``hidden`` values): what the cost model adds to a
    compressed link; and PowerSGD's compress/decompress arithmetic per byte of a gradient at
    rank ``wire.POWERSGD_RANK``."""
    from ..formats import WIRE_FORMATS
    from ..wire import measure_codec, measure_powersgd

    out = {}
    for fmt in WIRE_FORMATS[1:]:
        c = measure_codec(fmt, (max(1, rows), hidden))
        out[fmt] = [c.encode_s_per_byte, c.decode_s_per_byte]
    c = measure_powersgd((max(4 * hidden, rows), hidden))  # a weight matrix's gradient, at rank POWERSGD_RANK
    out["powersgd"] = [c.encode_s_per_byte, c.decode_s_per_byte]
    return out


def _untimed_blocks(left_out: Sequence[str], cfg: Any, timed_cfg: Any, first: StepTimes, pc: ProfileConfig
                    ) -> dict[str, BlockProfile]:
    """The blocks left out: the model's bytes (from ``cfg``, not the small vocabulary timed), no times."""
    if not left_out:
        return {}
    real = block_bytes(cfg, DTYPES[pc.weights_dtype])
    out = {}
    for name in left_out:
        act = first.activation_bytes[name] // pc.batch
        if name == TAIL:  # the logits: as wide as the vocabulary
            act = act * int(cfg.vocab_size) // int(timed_cfg.vocab_size)
        out[name] = BlockProfile(name=name, index=None, param_bytes=real.embed if name == EMBED else real.tail,
                                 activation_bytes_per_sample=act, forward_time_s=0.0, backward_time_s=0.0)
    return out


def _with_vocab(cfg: Any, vocab: int) -> Any:
    """A copy of ``cfg`` with a ``vocab``-word vocabulary (token ids above it cleared)."""
    import copy

    out = copy.deepcopy(cfg)
    out.vocab_size = vocab
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        v = getattr(out, key, None)
        if isinstance(v, int) and v >= vocab:
            setattr(out, key, None)
    return out


_OPTIMIZER_SPAN = 1


def measure_optimizer(model: torch.nn.Module, pc: ProfileConfig, timer) -> tuple[list[float], int]:
    """Seconds of each counted optimizer step over up to ``OPTIMIZER_SAMPLE_BYTES`` of ``model``'s
    parameters (in model order, each tensor whole), and their bytes.

    The step is the runtime's: ``make_optimizer`` and ``SteppedOptimizer`` with ``torchpp.train``'s
    default optimizer and settings (AdamW, fused where torch has it, the global gradient norm),
    on gradients of the parameters' own dtype. The first step allocates AdamW's moments, so at
    least one warm-up step runs uncounted. Timed with the blocks' span timer."""
    from ..runtime.optim import SteppedOptimizer
    from ..runtime.trainer import TrainConfig, make_optimizer

    train = TrainConfig(plan=Path("plan.json"))  # torchpp.train's defaults (the plan is not read)
    params, size = [], 0
    trainable = [p for p in model.parameters() if p.requires_grad]
    if not trainable:
        raise RuntimeError(f"{pc.model}: no trainable parameters to time the optimizer step on")
    for p in trainable:  # a tensor above the sample (a large embedding) only where nothing else fits
        if size + p.numel() * p.element_size() > OPTIMIZER_SAMPLE_BYTES:
            continue
        params.append(p)
        size += p.numel() * p.element_size()
    if not params:
        params = [min(trainable, key=lambda p: p.numel())]
    for p in params:
        p.grad = torch.full_like(p, 1e-3)
    optimizer = make_optimizer(train.optimizer, params, train.lr, train.weight_decay, train.adam_eps,
                               tuple(train.adam_betas))
    stepper = SteppedOptimizer(optimizer, params, train.optim_settings(), counts_stage=True, skip=None)
    warmup, times = max(1, pc.warmup), []
    for i in range(warmup + pc.iters):
        timer.reset()
        slot = timer.begin(_OPTIMIZER_SPAN)
        stepper.step()
        timer.end(slot)
        _, t0, t1 = (int(x) for x in timer.read()[0])
        if i >= warmup:
            times.append((t1 - t0) * 1e-9)
    stepper.zero_grad(set_to_none=True)
    return times, sum(p.numel() * p.element_size() for p in params)


SPLIT_SAMPLE_LAYERS = 4
"""Decoder layers the split backward is timed on: enough that its per-layer cost shows."""
SPLIT_PAIRS_PER_ITER = 2
"""Timed pairs (one backward, one split backward) per profiled step and size: the split's cost is
a difference of two noisy times, read at two sizes (factor and per-layer cost traded against
each other across runs with one pair per step: 0 to 10 ms per layer on one emulated host)."""


@dataclass(frozen=True)
class SplitCost:
    """What a split backward (``I`` then ``W``) costs beyond one backward pass of the same forward:
    ``I + W = factor · B + layers · layer_s`` per call. The per-layer part is per call, not per
    sample (what each layer's deferred weight products and their bookkeeping add,
    ``models.deferred``), so it weighs most on small micro-batches."""

    factor: float
    layer_s: float


def fit_split(rows: Sequence[tuple[float, float]], layers: int) -> SplitCost:
    """``(B, I + W)`` seconds at one or more batch sizes -> the split's cost: ``I + W − B =
    layers · layer_s + (factor − 1) · B`` by non-negative least squares (one size: all in the factor)."""
    import numpy as np
    from scipy.optimize import nnls

    b = np.array([r[0] for r in rows], dtype=float)
    s = np.array([r[1] for r in rows], dtype=float)
    if len(rows) < 2 or float(np.ptp(b)) <= 0:
        return SplitCost(float(np.mean(s / b)), 0.0)
    (c, f1), _ = nnls(np.stack([np.full(len(b), float(layers)), b], axis=1), s - b)
    if c == 0 and f1 == 0:
        return SplitCost(float(np.mean(s / b)), 0.0)  # no dearer than one pass: all in the factor
    return SplitCost(1.0 + float(f1), float(c))


def measure_backward_split(cfg: Any, pc: ProfileConfig, random_weights: bool = False) -> SplitCost:
    """The runtime's split backward (``backward_input`` then ``backward_weight``, as zero-bubble
    schedules run it) against one ``autograd.backward`` of the same forward, on up to
    ``SPLIT_SAMPLE_LAYERS`` decoder layers with the profile's precision (``--dtype bfloat16``: fp32
    weights under bf16 autocast, as training runs it), at the profile's batch and its smallest
    other batch; medians over ``SPLIT_PAIRS_PER_ITER × pc.iters`` alternating pairs after a warm-up,
    fitted by ``fit_split``."""
    import time

    from ..models.stages import StageSpec, backward_input, backward_weight, build_stage

    n = min(SPLIT_SAMPLE_LAYERS, int(cfg.num_hidden_layers))
    stage = build_stage(pc.model, cfg, StageSpec(layers=(0, n), has_embed=False, has_tail=False),
                        dtype=pc.weights_dtype, autocast=pc.autocast, random_weights=random_weights)
    weights = [p for p in stage.parameters() if p.requires_grad]
    gen = torch.Generator().manual_seed(pc.seed)
    sizes = sorted({pc.batch, *pc.fit_batches[:1]})
    inputs = {b: torch.randn(b, pc.seq_len, int(cfg.hidden_size), generator=gen).to(stage.dtype) for b in sizes}
    whole: dict[int, list[float]] = {b: [] for b in sizes}
    split: dict[int, list[float]] = {b: [] for b in sizes}
    for i in range(max(1, pc.warmup) + SPLIT_PAIRS_PER_ITER * max(3, pc.iters)):
        for batch, x0 in inputs.items():  # the sizes in turn, as the blocks are timed
            x = x0.clone().requires_grad_(True)
            out = stage.forward(x, None, None)
            grad = torch.randn(out.shape, generator=gen, dtype=out.dtype)
            t0 = time.perf_counter()
            torch.autograd.backward(out, grad)
            t1 = time.perf_counter()
            stage.defer_weight_gradients()  # as the runtime builds a chunk that runs W
            x = x0.clone().requires_grad_(True)
            out = stage.forward(x, None, None)
            t2 = time.perf_counter()
            _, task = backward_input(out, grad, x, weights, [])
            backward_weight(task)
            t3 = time.perf_counter()
            stage.defer_weight_gradients(False)
            for w in weights:
                w.grad = None
            if i >= max(1, pc.warmup):
                whole[batch].append(t1 - t0)
                split[batch].append(t3 - t2)
    return fit_split([(statistics.median(whole[b]), statistics.median(split[b])) for b in sizes], n)


def fit_fixed(rows: list[list[float]]) -> tuple[float, float]:
    """Per-call seconds (forward, backward): intercepts of ``t = fixed + b * per_sample`` fitted
    by non-negative least squares over ``[batch, fwd, bwd]`` rows; 0 with fewer than two sizes."""
    if len(rows) < 2:
        return 0.0, 0.0
    import numpy as np
    from scipy.optimize import nnls

    m = np.asarray(rows, dtype=float)
    a = np.stack([np.ones(len(m)), m[:, 0]], axis=1)
    return float(nnls(a, m[:, 1])[0][0]), float(nnls(a, m[:, 2])[0][0])


def write_trace(tw: TraceWriter, steps: list[StepTimes], pc: ProfileConfig) -> None:
    """The counted steps as a Chrome trace: F/B per step on 'compute', one event per block on 'blocks'."""
    if not steps:
        return
    t0 = steps[0].begin_ns
    tw.name_process(0, f"rank 0 · profile · host {pc.host}")
    tw.metadata.update(model=pc.model, seq_len=pc.seq_len, batch=pc.batch, dtype=pc.dtype)
    s = lambda ns: (ns - t0) * 1e-9  # noqa: E731
    for it, st in enumerate(steps):
        sp = st.spans_ns
        order = list(sp)
        f0, f1 = sp[order[0]][0], sp[order[-1]][1]
        b0, b1 = sp[order[-1]][2], sp[order[0]][3]
        tw.complete(0, "compute", f"F{it}", s(f0), s(f1) - s(f0), {"stage": 0, "microbatch": it, "iteration": it})
        tw.complete(0, "compute", f"B{it}", s(b0), s(b1) - s(b0), {"stage": 0, "microbatch": it, "iteration": it})
        for name in order:
            a, b, c, d = sp[name]
            args = {"iteration": it, "block": name, "bytes": st.activation_bytes.get(name, 0)}
            tw.complete(0, "blocks", f"{name} fwd", s(a), s(b) - s(a), {**args, "phase": "forward"})
            tw.complete(0, "blocks", f"{name} bwd", s(c), s(d) - s(c), {**args, "phase": "backward"})


def format_summary(lf: LayersFile) -> str:
    """A table a person reads: per block ms and bytes, and how much of the step the blocks cover."""
    ms = lambda x: f"{x * 1e3:9.3f}"  # noqa: E731
    mb = lambda b: f"{b / 2**20:9.2f}"  # noqa: E731
    r = lf.run
    lines = [f"host {lf.host}: {lf.model.name} ({lf.model.architecture}, {lf.model.num_layers} layers, "
             f"hidden {lf.model.hidden_size}, {lf.model.dtype}), batch {r.batch} × seq {r.seq_len}, "
             f"{r.threads} thread(s), timer {r.timer}, mean of {r.iters} step(s) after {r.warmup} warm-up",
             f"{'block':<8} {'fwd ms':>9} {'bwd ms':>9} {'params MiB':>10} {'act KiB/sample':>15}"]
    blocks = [lf.embed, *lf.layers, lf.tail]
    for b in blocks:
        lines.append(f"{b.name:<8} {ms(b.forward_time_s)} {ms(b.backward_time_s)} {mb(b.param_bytes):>10} "
                     f"{b.activation_bytes_per_sample / 1024:15.1f}"
                     + ("  left out: not timed on this host" if b.name in lf.left_out else ""))
    tot_f = sum(b.forward_time_s for b in blocks)
    tot_b = sum(b.backward_time_s for b in blocks)
    lines.append(f"{'total':<8} {ms(tot_f)} {ms(tot_b)} {mb(sum(b.param_bytes for b in blocks)):>10}")
    if r.batches:
        f0 = sum(b.forward_fixed_s for b in blocks)
        b0 = sum(b.backward_fixed_s for b in blocks)
        lines.append(f"per-call time fitted over batches {', '.join(map(str, r.batches))}: forward {f0 * 1e3:.3f} ms, "
                     f"backward {b0 * 1e3:.3f} ms of the totals above do not grow with the samples")
    lines.append(f"step {lf.step_time_s * 1e3:.3f} ms (blocks cover {100 * (tot_f + tot_b) / lf.step_time_s:.1f}%), "
                 f"peak RSS {lf.peak_rss_bytes / 2**20:.1f} MiB")
    if r.cpu_steal_cores is not None:
        lines.append(f"steal (CPU other guests of a virtual machine took while the blocks were timed): "
                     f"{cpu_steal.describe(r.cpu_steal_cores, cpu_steal.cpus())}")
    if lf.codec_s_per_byte:
        lines.append("wire codecs (encode/decode ns per fp32 byte): " + ", ".join(
            f"{f} {e * 1e9:.2f}/{d * 1e9:.2f}" for f, (e, d) in lf.codec_s_per_byte.items()))
    if lf.backward_split_factor is not None:
        per_layer = (f" + {lf.backward_split_layer_s * 1e3:.3f} ms per decoder layer per call"
                     if lf.backward_split_layer_s else "")
        lines.append(f"split backward (zero-bubble I + W) {lf.backward_split_factor:.3f} x one backward pass{per_layer}")
    if lf.optimizer_s_per_byte is not None:
        params = sum(b.param_bytes for b in blocks) - (lf.embed_param_bytes if lf.model.tied_embeddings else 0)
        lines.append(f"optimizer step {lf.optimizer_s_per_byte * params * 1e3:.3f} ms over {params / 2**20:.2f} MiB "
                     f"of parameters: {lf.optimizer_s_per_byte * 1e9:.3g} s/GB")
    return "\n".join(lines)
