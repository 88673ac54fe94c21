"""The training loop of one rank: check the plan, join the world, build the stage, run steps.

Order matters for failure behaviour: the plan is checked against the world and the model
*before* the process group is created, so a bad plan gives every rank the same one-line
error instead of a hang in the first collective.
"""
from __future__ import annotations

import datetime
import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist

from ..formats import OPTIMIZERS, FormatError, Plan, file_hash, validate_plan
from ..hostname import host_name, machine_name
from ..models.presets import DTYPES, hidden_size, is_preset, load_config, num_hidden_layers
from ..models.identity import plan_model
from ..models.stages import StageSet, StageSpec, build_stages, count_targets
from ..schedules import Schedule, build
from . import checkpoint as ckpt
from . import diloco, elastic_hooks, wire_links
from .allocator import retain_freed_memory
from .comm import Comm, calm_gloo_loops, guarded
from . import preflight
from .exchange import DisagreementError, all_gather_json, require_agreement, require_no_errors
from .evaluate import Evaluator
from .executor import Executor, StepResult, describe_failure
from .optim import OptimSettings, SteppedOptimizer
from .rendezvous import env_store

LOG = logging.getLogger("torchpp.train")
"""Rank 0's progress lines (loss, step time, checkpoints); the command line prints them."""
LOG_FAILURE = logging.getLogger("torchpp.runtime")
"""Every rank's failed action with the schedule grid (stderr unless configured otherwise)."""

FULL_CHECKPOINT_EVERY = 10
"""Default steps between full checkpoints when checkpointing every step (gradient logs between):
a log costs a third of a full AdamW checkpoint, and resuming replays at most 9 updates."""


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    """Everything ``torchpp.train`` takes on the command line."""

    plan: Path
    """plan.json (torchpp plan)."""
    model: str | None = None
    """Preset name or local HF checkpoint directory; default: the plan's (its preset, or the local
    directory it remembers); a different model is refused by name."""
    data: str = "synthetic"
    """'synthetic', a corpus from `torchpp data prepare`, or text files, tables or a datasets
    save_to_disk folder (prepared once into ``data_cache``)."""
    steps: int = 10
    """Optimizer steps."""
    lr: float = 1e-3
    """Peak learning rate."""
    weight_decay: float = 0.0
    """Decoupled weight decay (AdamW) or L2 (SGD)."""
    optimizer: Literal["adamw", "sgd"] = "adamw"
    """adamw (fused) or sgd."""
    adam_eps: float = 1e-8
    """AdamW's epsilon."""
    adam_betas: tuple[float, float] = (0.9, 0.999)
    """AdamW's beta1,beta2."""
    max_grad_norm: float = 0.0
    """Clip the global gradient norm (all stages and groups) to this; 0: no clipping."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """constant, linear or cosine decay (to 0 at ``steps``) after ``warmup_steps`` of linear warm-up."""
    warmup_steps: int = 0
    """Linear warm-up from 0 over this many steps."""
    eval_every: int = 0
    """Steps between evaluation losses on held-out data (0: none); the last step is always evaluated."""
    eval_fraction: float = 0.0
    """Hold out this fraction of ``data`` for evaluation (or give ``eval_data``)."""
    eval_data: str | None = None
    """Evaluate on this file or directory instead of a held-out split."""
    eval_batches: int = 1
    """Global batches in one evaluation."""
    attn_implementation: Literal["eager", "sdpa"] | None = None
    """eager or sdpa; default: SDPA where HF supports it for the model, eager where HF requires it."""
    text_column: str = "text"
    """The text column of .csv/.parquet/.json tables in ``data``."""
    tokenizer: str | None = None
    """A HF tokenizer directory, or ``bytes`` (UTF-8 bytes as ids); default: the model directory's.
    Text ``data`` without one is refused, as is a tokenizer larger than the model's vocabulary."""
    split: str | None = None
    """The split of a ``datasets`` DatasetDict folder given as ``data``."""
    data_cache: Path | None = None
    """Where raw ``data`` is prepared once (keyed by its and the tokenizer's hashes); default
    ``$TORCHPP_CACHE/corpus`` or ``~/.cache/torchpp/corpus``."""
    data_timeout_s: float = 3600.0
    """The longest a rank waits for another process preparing the same raw ``data``."""
    seed: int = 0
    """Weight init and data order."""
    threads: int | None = None
    """Torch intra-op threads per rank; default: this host's cores / ranks on this host."""
    trace_dir: Path | None = None
    """Write Chrome traces of ``trace_steps`` here."""
    trace_steps: tuple[int, ...] = (2,)
    """1-based optimizer steps to record (the first step includes warm-up)."""
    checkpoint_dir: Path | None = None
    """Directory of checkpoints (one manifest per step, parameters under their HF names)."""
    checkpoint_every: int = 0
    """Steps between checkpoints (0: only the last)."""
    keep_checkpoints: int = 3
    """Complete checkpoints kept in ``checkpoint_dir`` (older ones are deleted once a newer one is
    complete); 0 keeps every one."""
    resume: bool = False
    """Continue from the newest complete checkpoint."""
    export_dir: Path | None = None
    """Where the trained model is written as a HF checkpoint directory (weights, config, generation
    config, tokenizer) after the last step; default ``<checkpoint_dir>/final`` when checkpointing."""
    log_dir: Path | None = None
    """TensorBoard scalars and metrics.jsonl (rank 0)."""
    timeout_s: float = 300.0
    """A peer silent this long is an error."""
    layers: int | None = None
    """Keep only the first N decoder layers."""
    profile_blocks: bool = False
    """Per-block (embed/layer/tail) events in traces."""
    checkpoint_background: bool = False
    """Write each checkpoint during the next step (tensors copied first; manifest still written last)."""
    full_checkpoint_every: int = 0
    """With ``checkpoint_every`` 1: a full checkpoint every this many steps and a gradient log
    (a third of AdamW's bytes) between them; 1 makes every checkpoint full; 0 picks
    ``FULL_CHECKPOINT_EVERY``."""
    heartbeat_dir: Path | None = None
    """Each rank writes ``rank<R>`` here after every step (an elastic driver's stall detector)."""
    elastic_log: Path | None = None
    """The elastic driver's decisions so far (JSON lines), shown in metrics, TensorBoard and traces."""
    torch_profiler: bool = False
    """Also record the traced steps with torch.profiler (``torch_step<N>_rank<R>.json`` in ``trace_dir``),
    on the same wall clock as torchpp's traces (``torchpp.trace.kineto.merge_kineto``)."""
    output_dir: Path | None = None
    """Where checkpoints (``step_<N>/``) and the final model (``final/``) go when ``checkpoint_dir``
    is not given (it becomes ``checkpoint_dir``). ``torchpp.train`` defaults it to
    ``runs/<plan stem>/`` beside the plan (``safekeeping.default_output_dir``; ``--no-output``:
    none); None here saves nothing unless ``checkpoint_dir`` is given."""
    accept_changes: bool = False
    """Resume even when the checkpoint was trained with other data, tokenizer, model or optimizer
    settings (each difference is still printed)."""
    no_output: bool = False
    """Save nothing: no default ``output_dir`` (checkpoints only where ``checkpoint_dir`` says)."""

    def __post_init__(self) -> None:
        if self.no_output:
            self.output_dir = None
        if self.checkpoint_dir is None and self.output_dir is not None:
            self.checkpoint_dir = self.output_dir
        if self.steps < 1:
            raise ValueError(f"--steps: expected a positive number of optimizer steps, got {self.steps}")
        if not self.lr > 0:
            raise ValueError(f"--lr: expected a learning rate > 0, got {self.lr}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"--optimizer: expected one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}")
        if self.timeout_s <= 0:
            raise ValueError(f"--timeout-s: expected seconds > 0, got {self.timeout_s}")
        if self.checkpoint_every < 0:
            raise ValueError(f"--checkpoint-every: expected steps >= 0, got {self.checkpoint_every}")
        if self.keep_checkpoints < 0:
            raise ValueError(f"--keep-checkpoints: expected a count >= 0 (0 keeps all), got {self.keep_checkpoints}")
        if self.full_checkpoint_every < 0:
            raise ValueError(f"--full-checkpoint-every: expected steps >= 0 (0: {FULL_CHECKPOINT_EVERY}), "
                             f"got {self.full_checkpoint_every}")
        if self.full_checkpoint_every > 1 and self.checkpoint_every != 1:
            raise ValueError("--full-checkpoint-every: gradient logs need a checkpoint every step (--checkpoint-every "
                             f"1), got --checkpoint-every {self.checkpoint_every}")
        if any(s < 1 for s in self.trace_steps):
            raise ValueError(f"--trace-steps: expected 1-based step numbers, got {self.trace_steps}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"--threads: expected >= 1, got {self.threads}")
        if (self.checkpoint_every or self.resume) and self.checkpoint_dir is None:
            raise ValueError("--checkpoint-dir: expected a directory with --checkpoint-every or --resume")
        self.optim_settings()  # checks --max-grad-norm, --lr-schedule and --warmup-steps
        if not all(0 <= b < 1 for b in self.adam_betas):
            raise ValueError(f"--adam-betas: expected two values in [0, 1), got {self.adam_betas}")
        if self.eval_every < 0 or self.eval_batches < 1:
            raise ValueError(f"--eval-every/--eval-batches: expected >= 0 and >= 1, got {self.eval_every}, "
                             f"{self.eval_batches}")
        if self.eval_every and not (self.eval_data or self.eval_fraction):
            raise ValueError("--eval-every: expected --eval-fraction or --eval-data to say what to evaluate on")
        if not 0 <= self.eval_fraction < 1:
            raise ValueError(f"--eval-fraction: expected a fraction in [0, 1), got {self.eval_fraction}")
        if self.eval_data and self.eval_fraction:
            raise ValueError("--eval-data and --eval-fraction: expected one of them, not both")
        if self.data_timeout_s <= 0:
            raise ValueError(f"--data-timeout-s: expected seconds > 0, got {self.data_timeout_s}")

    @property
    def full_every(self) -> int:
        """Steps between full checkpoints (1: no gradient logs)."""
        if self.checkpoint_every != 1:
            return 1
        return self.full_checkpoint_every or FULL_CHECKPOINT_EVERY

    @property
    def export_to(self) -> Path | None:
        if self.export_dir is not None:
            return self.export_dir
        return self.checkpoint_dir / "final" if self.checkpoint_dir is not None else None

    def optim_settings(self) -> OptimSettings:
        return OptimSettings(max_grad_norm=self.max_grad_norm, schedule=self.lr_schedule,
                             warmup_steps=self.warmup_steps, total_steps=self.steps)

    @property
    def evaluates(self) -> bool:
        return bool(self.eval_data or self.eval_fraction)


@dataclass
class Prepared:
    plan: Plan
    model: str
    config: Any
    schedule: Schedule
    plan_hash: str
    data: str = "synthetic"
    """``synthetic`` or the prepared corpus directory (raw ``--data`` prepared into the cache)."""
    eval_data: str | None = None
    tokenizer: str | None = None
    """The tokenizer the corpus was checked against (exported with the model), or None."""
    sources: tuple[Any, Any] = (None, None)
    """(training, evaluation) token sources, opened by :func:`prepare`."""


@dataclass
class TrainSummary:
    rank: int
    start_step: int
    steps_done: int
    losses: list[float] = field(default_factory=list)
    step_times_s: list[float] = field(default_factory=list)
    traces: list[Path] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    """Global gradient norm of each step before clipping."""
    eval_losses: list[tuple[int, float]] = field(default_factory=list)
    steps_wall_s: float = 0.0
    """Seconds from the first step's start to the last checkpoint's end (set-up and export excluded)."""
    steps_cpu_s: float = 0.0
    """CPU seconds this process (every thread) spent in that time."""
    stopped_by: int = 0
    """The signal (SIGTERM, SIGINT) that stopped the run at a step boundary before ``steps``; 0: none."""


def prepare(cfg: TrainConfig, world_size: int) -> Prepared:
    """Load and check everything local: plan vs world size, plan vs model. No collective yet."""
    source = str(cfg.plan)
    host_name()  # a bad TORCHPP_HOST or HOST: one line on this rank before any collective
    plan = Plan.load(cfg.plan)
    model = plan_model(plan.model, source, cfg.model)
    mcfg = load_config(model, cfg.layers, cfg.attn_implementation)
    validate_plan(plan, source, world_size=world_size, model_layers=num_hidden_layers(mcfg))
    checks = (("hidden_size", hidden_size(mcfg), plan.model.hidden_size),
              ("vocab_size", int(mcfg.vocab_size), plan.model.vocab_size),
              ("tied_embeddings", bool(getattr(mcfg, "tie_word_embeddings", False)), plan.model.tied_embeddings))
    for name, want, got in checks:
        if want != got:
            raise FormatError(source, f"model.{name}", f"{want} (the {name} of --model {model})", got)
    if plan.model.dtype not in DTYPES:
        raise FormatError(source, "model.dtype", f"one of {', '.join(DTYPES)}", plan.model.dtype)
    if plan.micro_batch_size >= 1 << 16:
        raise FormatError(source, "micro_batch_size", "fewer than 65536 samples", plan.micro_batch_size)
    _check_positions(plan, mcfg, source, model)
    if plan.tied_sync is not None and plan.tied_sync.kind == "rows" and cfg.checkpoint_dir is not None \
            and cfg.full_every > 1:
        raise ValueError(f"--full-checkpoint-every: expected 1 with {source}'s tied_sync rows (its tied gradient "
                         "lives on the last stage only, and a gradient log needs it at both ends), "
                         f"got {cfg.full_every}")
    prep = Prepared(plan, model, mcfg, build(plan), file_hash(cfg.plan), **_prepare_data(cfg, model, mcfg))
    # opened on every rank, even those that read no tokens: too few tokens or a held-out split that
    # leaves nothing is then every rank's error before any collective
    prep.sources = _sources(cfg, prep)
    return prep


def _prepare_data(cfg: TrainConfig, model: str, mcfg: Any) -> dict[str, Any]:
    """The right tokens or an error, on every rank before any collective: the tokenizer fits the
    model, text has a tokenizer, a corpus was made by this tokenizer; raw data is prepared once."""
    from ..data import check_fits, load_tokenizer, resolve_data, resolve_tokenizer

    tokenizer = resolve_tokenizer(cfg.tokenizer, model)
    if cfg.tokenizer is not None and cfg.data == "synthetic":
        check_fits(load_tokenizer(cfg.tokenizer)[1], int(mcfg.vocab_size), "--tokenizer", model)
    kw = dict(tokenizer=tokenizer, model=model, model_vocab=int(mcfg.vocab_size), text_column=cfg.text_column,
              split=cfg.split, cache=cfg.data_cache, timeout_s=cfg.data_timeout_s)
    return {"data": resolve_data(cfg.data, flag="--data", **kw),
            "eval_data": resolve_data(cfg.eval_data, flag="--eval-data", **kw), "tokenizer": tokenizer}


def _check_positions(plan: Plan, mcfg: Any, source: str, model: str) -> None:
    """Refuse a sequence longer than the model has positions for, before any memory is spent on it
    (learned positions would index out of range; rotary ones would train outside their range)."""
    limit = getattr(mcfg, "max_position_embeddings", None) or getattr(mcfg, "n_positions", None)
    if isinstance(limit, int) and plan.seq_len > limit:
        raise FormatError(source, "seq_len", f"at most {limit} (the positions of --model {model})", plan.seq_len)


def _env_int(name: str, default: int) -> int:
    v = os.environ.get(name)
    return int(v) if v not in (None, "") else default


def world_from_env() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)


def init_world(rank: int, world_size: int, timeout_s: float) -> bool:
    """Join the gloo world (env:// under torchrun); returns True when this call created it."""
    if dist.is_initialized():
        return False
    timeout = datetime.timedelta(seconds=timeout_s)
    if "MASTER_ADDR" in os.environ:
        # Keys of a restarted attempt must never meet the ones a killed rank left in a store that
        # outlived it (a stale gloo address means "connection refused" in the next group).
        store = preflight.attempt_store(env_store(rank, world_size, timeout))
        # before the group exists: a rank that failed its own checks has posted why (train.py)
        problems = preflight.peer_problems(preflight.exchange(store, rank, world_size, None, timeout_s), rank)
        if problems:
            raise DisagreementError(problems)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
    elif world_size == 1:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    else:
        raise RuntimeError("WORLD_SIZE > 1 but MASTER_ADDR is not set: start the ranks with torchrun")
    return True


def default_threads() -> int:
    return max(1, (os.cpu_count() or 1) // max(1, _env_int("LOCAL_WORLD_SIZE", 1)))


class _Log:
    """Rank 0's progress lines, metrics.jsonl and TensorBoard scalars."""

    def __init__(self, rank: int, log_dir: Path | None):
        self.on = rank == 0
        self.dir = log_dir if self.on else None
        self.tb = None
        if self.dir is not None:
            self.dir.mkdir(parents=True, exist_ok=True)
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(self.dir))

    def print(self, text: str) -> None:
        """One progress line of rank 0 to the ``torchpp.train`` logger (`torchpp.train` shows it on stdout)."""
        if self.on:
            LOG.info(text)

    def note(self, text: str) -> None:
        """A line that must not be missed (also a ``note`` record in metrics.jsonl)."""
        self.print(text)
        self.event({"event": "note", "message": text, "time": time.time()})

    def event(self, record: dict[str, Any]) -> None:
        if self.dir is not None:
            from ..validate import open_output

            with open_output(self.dir / "metrics.jsonl", "a", "--log-dir") as f:
                f.write(json.dumps(record) + "\n")

    def scalars(self, step: int, values: dict[str, float]) -> None:
        if self.tb is not None:
            for k, v in values.items():
                self.tb.add_scalar(k, v, step)
            self.tb.flush()

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def make_optimizer(name: str, params: list[torch.nn.Parameter], lr: float, weight_decay: float,
                   eps: float = 1e-8, betas: tuple[float, float] = (0.9, 0.999)) -> torch.optim.Optimizer:
    """AdamW (default) or SGD, fused into one kernel where torch has one for these tensors.

    On one CPU thread the fused AdamW step is about 4x faster than the multi-tensor one (7 ms
    against 30 ms for a 4.2 M-parameter stage) and equal to it within float rounding; the
    optimizer step sits on the pipeline's critical path after the last backward, and with a
    large vocabulary the embedding alone makes it a sizeable share of the step."""
    params = list(params)
    kwargs = {"fused": True} if fusable(params) else {}
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, weight_decay=weight_decay, **kwargs)
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, eps=eps, betas=betas, **kwargs)


def optimizer_mismatch(plan: Plan, optimizer: str) -> str | None:
    """The warning for a run whose optimizer is not the one the plan's lossy choices were made for
    (``plan.optimizer``; the PowerSGD rank the planner offers depends on it); None when they agree."""
    if plan.optimizer is None or plan.optimizer == optimizer:
        return None
    return (f"torchpp.train: warning: the plan's lossy choices were made for --optimizer {plan.optimizer} "
            f"(plan.json's optimizer), this run is {optimizer}: plan again with torchpp plan --optimizer "
            f"{optimizer} (the PowerSGD rank it offers depends on it)")


def fusable(params: list[torch.Tensor]) -> bool:
    """Torch's fused optimizers take floating-point tensors on CPU (and on accelerators)."""
    return bool(params) and all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params)


def train(cfg: TrainConfig, prepared: Prepared | None = None) -> TrainSummary:
    """Run ``cfg.steps`` optimizer steps on this rank (all ranks call this together)."""
    rank, world = world_from_env()
    retain_freed_memory()  # before the stage's first allocation
    prep = prepared or prepare(cfg, world)
    torch.set_num_threads(cfg.threads or default_threads())
    from .lifecycle import bounded

    with bounded(f"joining the world of {world} rank(s)", cfg.timeout_s + 5, rank):  # torch's own wait may not end
        created = guarded(rank, f"joining the world of {world} rank(s)", cfg.timeout_s, init_world, rank, world,
                          cfg.timeout_s)
    try:
        return _run(cfg, prep, rank, world)
    finally:
        if created and dist.is_initialized():
            dist.destroy_process_group()


def fingerprint(cfg: TrainConfig, prep: Prepared) -> dict[str, str]:
    """What every rank must have equal before training: the plan, model, data and the options
    that change what is computed or written (short values: the error message quotes them)."""
    from ..data import data_id

    plan = prep.plan
    return {"plan": prep.plan_hash, "model": _model_id(prep), "data": data_id(prep.data),
            "seq_len": str(plan.seq_len), "global_batch": str(plan.global_batch),
            "dtype": f"{plan.model.dtype} autocast {plan.model.autocast or 'none'}",
            "steps": str(cfg.steps), "lr": repr(cfg.lr), "weight_decay": repr(cfg.weight_decay),
            "optimizer": cfg.optimizer, "adam_eps": repr(cfg.adam_eps), "seed": str(cfg.seed),
            "layers": str(cfg.layers), "checkpoint_dir": str(cfg.checkpoint_dir),
            "checkpoint_every": str(cfg.checkpoint_every), "keep_checkpoints": str(cfg.keep_checkpoints),
            "full_checkpoint_every": str(cfg.full_every),
            "resume": str(cfg.resume), "export_dir": str(cfg.export_to),
            "trace_steps": str(list(cfg.trace_steps) if cfg.trace_dir else []),
            "profile_blocks": str(cfg.profile_blocks), "adam_betas": repr(tuple(cfg.adam_betas)),
            "max_grad_norm": repr(cfg.max_grad_norm), "lr_schedule": f"{cfg.lr_schedule} warmup {cfg.warmup_steps}",
            "eval": f"every {cfg.eval_every} x {cfg.eval_batches} on "
                    f"{data_id(prep.eval_data) if prep.eval_data else cfg.eval_fraction}",
            "attn_implementation": str(prep.config._attn_implementation), "text_column": cfg.text_column,
            "tokenizer": Path(prep.tokenizer).name if prep.tokenizer else "none"}


def _short_hash(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()[:16]


def _model_id(prep: Prepared) -> str:
    """Name (a preset) or directory name, and a hash of the config without where it was read from."""
    conf = prep.config.to_dict()
    for k in ("_name_or_path", "transformers_version", "_attn_implementation_autoset"):
        conf.pop(k, None)
    name = prep.model if is_preset(prep.model) else Path(prep.model).name
    digest = _short_hash(json.dumps(conf, sort_keys=True, default=str).encode())
    if not is_preset(prep.model):
        weights = sum(p.stat().st_size for pat in ("*.safetensors", "*.bin") for p in Path(prep.model).glob(pat))
        return f"{name} config {digest} weights {weights} bytes"
    return f"{name} config {digest}"


def _prepare_checkpoints(cfg: TrainConfig, roles: ckpt.Roles, stage: Any) -> int:
    """Check the checkpoint directory on every rank, clean what a killed write left, and agree on
    the step to resume from (0: none). One error on every rank when any rank's directory is unusable
    (or holds another run's checkpoints and the run does not resume)."""
    from .safekeeping import ResumeError, check_fresh_start

    stage_bytes = ckpt.checkpoint_bytes(stage, cfg.optimizer) if roles.writes_stage else 0
    per_stage = {int(s): int(b) for s, b in all_gather_json([roles.stage, stage_bytes]) if b}
    need = sum(per_stage.values()) + (1 << 20)  # rng states, config and indexes
    problem = None
    resumes = cfg.resume or _env_int("TORCHELASTIC_RESTART_COUNT", 0) > 0
    try:
        ckpt.check_dir(cfg.checkpoint_dir, need)
        check_fresh_start(cfg.checkpoint_dir, resumes)
        if roles.writes_manifest:
            for d in ckpt.clean_leftovers(cfg.checkpoint_dir):
                if d.is_dir() or d.name.startswith("step_"):
                    LOG.info(f"torchpp.train: removed {d}: a checkpoint whose write did not finish")
    except (ckpt.CheckpointDirError, ResumeError, OSError) as e:
        problem = str(e)
    require_no_errors(problem)  # also the barrier: nobody writes before every host is clean
    if not resumes:
        return 0
    return max(0, ckpt.agree_on_step(cfg.checkpoint_dir))


@dataclass(kw_only=True)
class _Session:
    """Everything one rank holds while it trains (built by :func:`_setup`, used by every step)."""

    cfg: TrainConfig
    prep: Prepared
    rank: int
    world: int
    g: Any
    """``guarded``: run a collective or a write with the rank's timeout, naming what it waits for."""
    hosts: list[str]
    roles: ckpt.Roles
    stage: Any
    optimizer: torch.optim.Optimizer
    stepper: SteppedOptimizer
    executor: Executor
    evaluator: Evaluator | None
    source: Any
    eval_source: Any
    log: "_Log"
    decisions: list
    saver: ckpt.BackgroundSaver | None
    start: int
    last_checkpoint: int = -1
    """The newest step this run checkpointed (or resumed from): a gradient log must follow it."""
    fp: dict[str, str] = field(default_factory=dict)
    """The run's :func:`fingerprint` (every rank agreed on it); checkpoints record its settings."""
    stop: Any = None
    """``safekeeping.StopRequest``: a signal asked this rank to stop at the next step boundary."""
    stopping: bool = False
    """Some rank was asked to stop: every rank checkpoints this step and leaves the loop."""


def _run(cfg: TrainConfig, prep: Prepared, rank: int, world: int) -> TrainSummary:
    ss = _setup(cfg, prep, rank, world)
    plan = prep.plan
    ss.log.print(f"torchpp.train: {plan.num_stages} stage(s), {world} rank(s), {plan.schedule}, "
                 f"{plan.num_microbatches} x {plan.micro_batch_size} samples x {plan.seq_len} tokens; "
                 f"steps {ss.start + 1}..{cfg.steps}")
    from ..data import describe

    ss.log.print(describe(prep.data, seq_len=plan.seq_len, global_batch=plan.global_batch, steps=cfg.steps))
    ss.log.event({"event": "start", "world_size": world, "plan": str(cfg.plan), "plan_hash": prep.plan_hash,
                  "model": prep.model, "start_step": ss.start,
                  "rank0_params": sum(p.numel() for p in ss.stage.parameters()), "time": time.time()})
    if cfg.checkpoint_dir is not None:
        ss.log.print(f"torchpp.train: outputs in {cfg.checkpoint_dir}/ (checkpoints step_<N>/"
                     + (f", the trained model {cfg.export_to}/" if cfg.export_to else "") + ")")
    summary = TrainSummary(rank=rank, start_step=ss.start, steps_done=ss.start)
    elastic_hooks.heartbeat(cfg.heartbeat_dir, rank, ss.start)
    t0, cpu0 = time.perf_counter(), time.process_time()
    from .safekeeping import StopRequest

    ss.stop = StopRequest(rank=rank).install()
    try:
        for step in range(ss.start + 1, cfg.steps + 1):
            _train_step(ss, step, summary)
            if ss.stopping:
                summary.stopped_by = ss.stop.signum or -1
                break
        _last_checkpoint(ss)
    finally:
        ss.stop.restore()
    if ss.stopping:
        ss.log.note(f"torchpp.train: stopped at step {summary.steps_done} of {cfg.steps} by a signal"
                    + (f"; resume with --resume (checkpoint {ckpt.step_dir(cfg.checkpoint_dir, summary.steps_done)})"
                       if cfg.checkpoint_dir is not None else " (no checkpoint: no --output-dir)"))
    summary.steps_wall_s, summary.steps_cpu_s = time.perf_counter() - t0, time.process_time() - cpu0
    _finish(ss, summary)
    return summary


def _setup(cfg: TrainConfig, prep: Prepared, rank: int, world: int) -> _Session:
    """Agree with every rank, build this rank's stage, optimizer and executor, resume if asked."""
    from .tracing import mark_base_rss

    plan, schedule = prep.plan, prep.schedule
    chunks = plan.stages_of_rank(rank)  # in pipeline order; the first names the rank in traces and statistics
    comm = Comm(rank, cfg.timeout_s, boundaries=plan.num_stages - 1, samples=plan.micro_batch_size)
    g = lambda what, fn, *a, **kw: guarded(rank, what, cfg.timeout_s, fn, *a, **kw)  # noqa: E731
    # the first collective: ranks started with different plans or options must stop here, before any write
    from .safekeeping import output_problem

    fp = fingerprint(cfg, prep)
    g("comparing plan, model, data and options with all ranks", require_agreement, fp)
    # created only once every rank agreed to run (ranks that disagree write nothing)
    problem = output_problem({"--export-dir": cfg.export_to, "--log-dir": cfg.log_dir if rank == 0 else None,
                              "--trace-dir": cfg.trace_dir}, cfg.checkpoint_dir)
    g("checking the output directories with all ranks", require_no_errors, problem)
    g("creating the all-reduce groups", comm.make_groups, schedule)
    comm.wire = wire_links.install(plan, rank)
    names = g("exchanging host names with all ranks", all_gather_json, [host_name(), machine_name()])
    hosts = [str(n[0]) for n in names]  # what traces say (torchpp.hostname's rule)
    roles = _roles(plan, rank, [str(n[1]) for n in names])  # who shares a file system: the machines
    # the data is opened before the baseline: the stage's growth is what the memory model predicts
    source, eval_source = prep.sources if any(c.has_embed or c.has_tail for c in chunks) else (None, None)
    prep.sources = (None, None)  # held by the session from here (or, on a rank that reads no tokens, dropped)
    mark_base_rss()  # what the stage adds to this process is what the planner's memory model predicts
    stage = _build_chunks(prep, plan, [c.index for c in chunks], cfg.seed)
    params = stage.parameters()
    optimizer = make_optimizer(cfg.optimizer, params, cfg.lr, cfg.weight_decay, cfg.adam_eps, tuple(cfg.adam_betas))
    start = 0
    if cfg.checkpoint_dir is not None:
        start = g("checking the checkpoint directory with all ranks", _prepare_checkpoints, cfg, roles, stage)
    log = _Log(rank, cfg.log_dir)
    decisions = elastic_hooks.report_decisions(cfg.elastic_log, log)
    if plan.model.dtype != "float32" and not plan.model.autocast:
        log.print(f"torchpp.train: note: the plan keeps pure {plan.model.dtype} weights and optimizer state (no fp32 "
                  "master weights); plan with --dtype bfloat16 for mixed precision")
    if (warning := optimizer_mismatch(plan, cfg.optimizer)) is not None:
        log.print(warning)
    if start > 0:
        start = _resume(cfg, start, log, g, rank=rank, roles=roles, stage=stage, optimizer=optimizer, fp=fp)
    logs = cfg.checkpoint_dir is not None and cfg.full_every > 1
    stepper = SteppedOptimizer(optimizer, params, cfg.optim_settings(), counts_stage=chunks[0].devices[0].rank == rank,
                               skip=stage.tied_copy_parameter(), done_steps=start, keep_grads=logs and roles.writes_stage)
    outer = diloco.wrap(stepper, optimizer, plan, rank, stage, comm.groups, done_steps=start, timeout_s=cfg.timeout_s,
                        checkpoint_dir=cfg.checkpoint_dir)
    executor = Executor(rank=rank, plan=plan, actions=schedule[rank], stage=stage, comm=comm, optimizer=outer,
                        schedule=schedule)
    executor.step_index = start
    if executor.tied_rows is not None:
        stepper.squares = executor.tied_rows.squares
        if start > 0:  # a replayed gradient log stepped the owner's weight only
            g("sending the tied weight to the first stage", executor.tied_rows.whole)
    if cfg.torch_profiler:
        executor.label_actions()
    evaluator = Evaluator(rank=rank, plan=plan, stage=stage, comm=comm) if cfg.evaluates else None
    saver = (ckpt.BackgroundSaver(cfg.checkpoint_dir, rank=rank, roles=roles, stage=stage, keep=cfg.keep_checkpoints,
                                  timeout_s=cfg.timeout_s, recycle_keep=_recycle_keep(cfg))
             if cfg.checkpoint_background and cfg.checkpoint_dir else None)
    if saver is not None:
        executor.before_backward = saver.before_backward
    calm_gloo_loops()  # the checkpoint writers' group started its own I/O thread
    return _Session(cfg=cfg, prep=prep, rank=rank, world=world, g=g, hosts=hosts, roles=roles, stage=stage,
                    optimizer=optimizer, stepper=stepper, executor=executor, evaluator=evaluator, source=source,
                    eval_source=eval_source, log=log, decisions=decisions, saver=saver, start=start,
                    last_checkpoint=start if start > 0 else -1, fp=fp)


def _train_step(ss: _Session, step: int, summary: TrainSummary) -> None:
    """One optimizer step: its batch, the executor's action list, statistics, traces, checkpoint."""
    cfg, plan, g, rank = ss.cfg, ss.prep.plan, ss.g, ss.rank
    chunks = plan.stages_of_rank(rank)
    S = plan.num_stages
    ids = ss.source.batch(step - 1) if ss.source is not None else None
    n_tokens = count_targets(ids) if ids is not None and chunks[-1].has_tail else None
    rec = _start_trace(ss, step) if cfg.trace_dir is not None and step in cfg.trace_steps else None
    waited0, cpu0 = (ss.saver.waited_s, ss.saver.cpu_s) if ss.saver is not None else (0.0, 0.0)
    t0 = time.perf_counter()
    with _torch_profiler(cfg, rec, step, rank):
        try:
            res = ss.executor.step(ids, n_tokens)
        except Exception as e:
            LOG_FAILURE.error(describe_failure(rank, step, e, ss.prep.schedule))
            raise
    waited, cpu = (ss.saver.waited_s - waited0, ss.saver.cpu_s - cpu0) if ss.saver is not None else (0.0, 0.0)
    stats = g(f"step {step}: statistics all-reduce with all ranks", _reduce_stats, res,
              {c.index: len(c.devices) for c in chunks}, S, waited, cpu, stop=ss.stop is not None and ss.stop.requested)
    ss.stopping = bool(stats[-1] > 0) and step < cfg.steps  # a signal on any rank: all stop after this step
    dt = time.perf_counter() - t0
    if rec is not None:
        summary.traces += _finish_trace(ss, step, rec)
    summary.losses.append(float(stats[0]))
    summary.step_times_s.append(dt)
    summary.steps_done = step
    checkpoints = cfg.checkpoint_dir is not None and ((cfg.checkpoint_every and step % cfg.checkpoint_every == 0)
                                                      or step == cfg.steps or ss.stopping)
    rows = ss.executor.tied_rows  # the first stage's copy is made whole before anything reads it whole
    if rows is not None and (checkpoints or step == cfg.steps or _evaluates(cfg, ss.evaluator, step)):
        g(f"step {step}: sending the tied weight to the first stage", rows.whole)
    extra = _step_extras(cfg, step, ss.stepper, ss.evaluator, ss.eval_source, g, summary)
    _report_step(ss.log, step, cfg.steps, stats, S, dt, plan.global_batch * plan.seq_len, extra,
                 background=ss.saver is not None)
    if checkpoints:
        _checkpoint(ss, step)
    elastic_hooks.heartbeat(cfg.heartbeat_dir, rank, step)


def _start_trace(ss: _Session, step: int) -> Any:
    """Align clocks with rank 0 and record this step (and its blocks with --profile-blocks)."""
    from .tracing import StepRecorder, sync_clocks

    chunks = ss.prep.plan.stages_of_rank(ss.rank)
    clock = ss.g("clock ping-pong with rank 0", sync_clocks, ss.rank, ss.world)
    rec = StepRecorder(rank=ss.rank, world_size=ss.world, stage=chunks[0].index, host=ss.hosts[ss.rank], step=step,
                       clock=clock, chunks={c.index: tuple(c.layers) for c in chunks})
    ss.executor.observer = rec
    ss.stage.set_profiler(rec if ss.cfg.profile_blocks else None)
    return rec


def _finish_trace(ss: _Session, step: int, rec: Any) -> list:
    """This rank's trace of the step (tied to the plan by its hash), gathered on rank 0."""
    from .tracing import write_step

    ss.executor.observer = None
    ss.stage.set_profiler(None)
    trace = rec.finish()
    trace["metadata"]["plan_hash"] = ss.prep.plan_hash  # analyze and replan refuse another plan's traces
    if ss.decisions:
        trace["metadata"]["elastic"] = ss.decisions
    return ss.g(f"step {step}: gathering traces on rank 0", write_step, ss.cfg.trace_dir, step, ss.rank, ss.world,
                trace)


def _last_checkpoint(ss: _Session) -> None:
    """Wait for the last background checkpoint; drop the retired ones kept for recycling."""
    if ss.saver is not None:
        for d in ss.g("writing the last checkpoint", ss.saver.close):
            if d is not None:
                ss.log.print(f"checkpoint {d}")
    if ss.cfg.checkpoint_dir is not None and ss.roles.writes_manifest:
        ckpt.release_recycled(ss.cfg.checkpoint_dir)  # every rank's last checkpoint is complete


def _finish(ss: _Session, summary: TrainSummary) -> None:
    """The HF model directory, the logs."""
    cfg, g, log = ss.cfg, ss.g, ss.log
    if cfg.export_to is not None and summary.steps_done == cfg.steps:
        from .export import copy_tokenizer, export_hf

        d = g("writing the HF model directory", export_hf, cfg.export_to, roles=ss.roles, stage=ss.stage,
              source=None if is_preset(ss.prep.model) else ss.prep.model)
        if d is not None and ss.prep.tokenizer not in (None, ss.prep.model):
            copy_tokenizer(ss.prep.tokenizer, d)  # the tokenizer the corpus was checked against
        if d is not None:
            log.print(f"model {d} (AutoModelForCausalLM.from_pretrained loads it)")
    log.close()


def _roles(plan: Plan, rank: int, hosts: list[str]) -> ckpt.Roles:
    """Who writes which checkpoint files: ranks holding the same chunks are told apart by machine."""
    first = {r: plan.stages_of_rank(r)[0].index for r in range(len(hosts))}
    return ckpt.Roles.decide(rank, first, hosts, chunks=tuple(c.index for c in plan.stages_of_rank(rank)))


def _build_chunks(prep: Prepared, plan: Plan, chunks: list[int], seed: int) -> StageSet:
    """One stage per chunk this rank holds (a tied weight shared in-process where it holds both ends)."""
    specs = {c: StageSpec.from_plan(plan, c) for c in chunks}
    return build_stages(prep.model, prep.config, specs, seed=seed, dtype=plan.model.dtype,
                        autocast=plan.model.autocast)


def _resume(cfg: TrainConfig, start: int, log: _Log, g: Any, *, rank: int, roles: ckpt.Roles, stage,
            optimizer, fp: dict[str, str]) -> int:
    """Load the newest intact checkpoint from ``start`` down under this plan's split (tensors by
    HF name) and say so; returns its step. One that continues another training (other data,
    model, optimizer settings) or lies beyond ``--steps`` is refused on every rank."""
    from .safekeeping import check_resume, check_same_model, settings

    changed: list[str] = []

    def check(step: int, manifest: dict[str, Any], config: dict[str, Any]) -> None:
        check_same_model(cfg.checkpoint_dir, step, config, stage.cfg.to_diff_dict())  # as config.json holds it
        changed[:] = check_resume(cfg.checkpoint_dir, step, manifest, settings(fp), steps=cfg.steps,
                                  accept_changes=cfg.accept_changes)

    t_load = time.perf_counter()
    start, manifest = g("loading the checkpoint with all ranks", ckpt.resume_intact, cfg.checkpoint_dir, start,
                        rank=rank, roles=roles, stage=stage, optimizer=optimizer, report=log.note, check=check)
    if changed:
        log.note(f"torchpp.train: resuming step {start} under changed settings (--accept-changes): {'; '.join(changed)}")
    replayed = manifest["replayed"]
    log.print(f"resumed from {ckpt.step_dir(cfg.checkpoint_dir, start)} (step {start}"
              + (f": {replayed} logged update(s) replayed on step {start - replayed}'s checkpoint)" if replayed else ")"))
    log.event({"event": "resume", "from_step": start, "replayed_updates": replayed,
               "restart_count": _env_int("TORCHELASTIC_RESTART_COUNT", 0),
               "load_s": time.perf_counter() - t_load, "time": time.time()})
    return start


def _checkpoint(ss: _Session, step: int) -> None:
    """Write checkpoint ``step`` (full, or a gradient log on top of the previous step's) now, or
    start writing it in the background."""
    cfg, prep, g, saver = ss.cfg, ss.prep, ss.g, ss.saver
    from .safekeeping import settings

    info = {"plan": str(cfg.plan), "plan_hash": prep.plan_hash, "model": prep.model, "seed": cfg.seed,
            "optimizer": cfg.optimizer, "lr": cfg.lr, "settings": settings(ss.fp)}
    grads = None
    if cfg.full_every > 1:
        kept = ss.stepper.take_grads() if ss.stepper.keep_grads else {}
        if ss.last_checkpoint == step - 1 and step % cfg.full_every and step != cfg.steps:
            # every rank decides alike (same steps, same options); ranks that write no stage log no tensors
            grads = ckpt.gradient_snapshot(step, roles=ss.roles, stage=ss.stage, grads=kept, lrs=ss.stepper.last_lrs)
        del kept
    if saver is not None:
        done = g(f"step {step}: writing the previous checkpoint", saver.wait)
        saver.start(step, ss.optimizer, info, grads=grads)
    else:
        done = [g(f"step {step}: writing the checkpoint", ckpt.save, cfg.checkpoint_dir, step, rank=ss.rank,
                  roles=ss.roles, stage=ss.stage, optimizer=ss.optimizer, info=info, timeout_s=cfg.timeout_s,
                  keep=cfg.keep_checkpoints, grads=grads, recycle_keep=_recycle_keep(cfg))]
    if isinstance(ss.executor.optimizer, diloco.DiLoCo):
        ss.executor.optimizer.save(cfg.checkpoint_dir, step, keep=cfg.keep_checkpoints)
    ss.last_checkpoint = step
    for d in done:
        if d is not None:
            ss.log.print(f"checkpoint {d}")


def _recycle_keep(cfg: TrainConfig) -> int:
    """Retired copies of each checkpoint file kept for overwriting: gradient logs retire a whole
    chain at once, and each later log overwrites one."""
    return max(ckpt.RECYCLE_KEEP, cfg.full_every)


def _evaluates(cfg: TrainConfig, evaluator: Evaluator | None, step: int) -> bool:
    return evaluator is not None and (step == cfg.steps or bool(cfg.eval_every and step % cfg.eval_every == 0))


def _step_extras(cfg: TrainConfig, step: int, stepper: SteppedOptimizer, evaluator: Evaluator | None,
                 eval_source: Any, g: Any, summary: TrainSummary) -> dict[str, float]:
    """Learning rate and gradient norm of the step, and the evaluation loss when it is due
    (every rank evaluates together); recorded in ``summary`` and returned as scalars."""
    extra = {"train/learning_rate": stepper.last_lr, "train/grad_norm": stepper.last_grad_norm}
    if _evaluates(cfg, evaluator, step):
        extra["eval/loss"] = g(f"step {step}: evaluation with all ranks", _evaluate, evaluator, eval_source,
                               cfg.eval_batches)
        summary.eval_losses.append((step, extra["eval/loss"]))
    summary.grad_norms.append(stepper.last_grad_norm)
    return extra


def _torch_profiler(cfg: TrainConfig, rec: Any, step: int, rank: int) -> Any:
    """torch.profiler around a traced step when asked (a no-op context otherwise)."""
    import contextlib

    if rec is None or not cfg.torch_profiler:
        return contextlib.nullcontext()
    from ..trace.kineto import capture

    return capture(cfg.trace_dir / f"torch_step{step}_rank{rank}.json")


def _sources(cfg: TrainConfig, prep: Prepared) -> tuple[Any, Any]:
    """(training, evaluation) token sources; evaluation None without evaluation."""
    from ..data import held_out, open_source

    plan = prep.plan
    kw = dict(seq_len=plan.seq_len, global_batch=plan.global_batch, vocab_size=plan.model.vocab_size, seed=cfg.seed)
    source = open_source(prep.data, **kw)
    if prep.eval_data:
        return source, open_source(prep.eval_data, **kw)
    if cfg.eval_fraction:
        return held_out(source, cfg.eval_fraction)
    return source, None


def _evaluate(evaluator: Evaluator, source: Any, batches: int) -> float:
    """Mean of the global evaluation loss over the first ``batches`` held-out batches."""
    losses = [evaluator.loss(source.batch(i) if source is not None else None) for i in range(batches)]
    return sum(losses) / len(losses)


_JSONL_NAMES = {"train/learning_rate": "lr", "train/grad_norm": "grad_norm", "eval/loss": "eval_loss"}


def _report_step(log: _Log, step: int, steps: int, stats: torch.Tensor, S: int, dt: float,
                 tokens_per_step: int, extra: dict[str, float], background: bool = False) -> None:
    """Rank 0's progress line, metrics.jsonl record and TensorBoard scalars of one step
    (``extra``: learning rate, gradient norm and evaluation loss, named as their scalars).
    With background checkpoints, each stage's wait for the writer inside the step (part of its
    compute) and the CPU seconds of the writer that finished during the step are recorded too:
    what a checkpoint every step costs, and where."""
    loss = float(stats[0])
    comp = [float(x) for x in stats[1:1 + S]]
    wait = [float(x) for x in stats[1 + S:1 + 2 * S]]
    ck = {"checkpoint_wait_s": [float(x) for x in stats[1 + 2 * S:1 + 3 * S]],
          "checkpoint_cpu_s": [float(x) for x in stats[1 + 3 * S:1 + 4 * S]]} if background else {}
    ev = f"  eval {extra['eval/loss']:.4f}" if "eval/loss" in extra else ""
    log.print(f"step {step:>5}/{steps}  loss {loss:.4f}{ev}  lr {extra['train/learning_rate']:.3g}  "
              f"|g| {extra['train/grad_norm']:.3g}  {dt:.3f} s  {tokens_per_step / dt:,.0f} tok/s  "
              f"compute/stage {' '.join(f'{c:.3f}' for c in comp)} s")
    log.event({"step": step, "loss": loss, "step_time_s": dt, "tokens_per_s": tokens_per_step / dt,
               "compute_s": comp, "comm_wait_s": wait, **ck, **{_JSONL_NAMES[k]: v for k, v in extra.items()},
               "time": time.time()})  # wall clock: the period between steps includes what follows a step
    log.scalars(step, {"train/loss": loss, "perf/step_time_s": dt, "perf/tokens_per_s": tokens_per_step / dt, **extra,
                       **{f"stage{s}/compute_s": comp[s] for s in range(S)},
                       **{f"stage{s}/comm_wait_s": wait[s] for s in range(S)},
                       **{f"stage{s}/{k}": w for k, ws in ck.items() for s, w in enumerate(ws)}})


def _reduce_stats(res: StepResult, groups: dict[int, int], num_stages: int,
                  checkpoint_wait_s: float = 0.0, checkpoint_cpu_s: float = 0.0, stop: bool = False) -> torch.Tensor:
    """[global loss, mean compute s per stage..., mean comm-wait s per stage..., mean wait for the
    background checkpoint writer per stage..., mean writer CPU s per stage...] on every rank.

    ``groups``: each chunk this rank holds (the first names it) and its group's size. Compute and
    waits go to the chunk whose action they were; the writer's figures, which are the rank's, to
    its first chunk. The last element counts the ranks a signal asked to stop (``stop``)."""
    v = torch.zeros(2 + 4 * num_stages, dtype=torch.float64)
    v[-1] = float(stop)
    v[0] = res.loss
    first = next(iter(groups))
    per_chunk = res.chunk_compute_s or {first: res.compute_s}
    waits = res.chunk_wait_s or {first: res.comm_wait_s}
    for c, n in groups.items():
        v[1 + c] = per_chunk.get(c, 0.0) / n
        v[1 + num_stages + c] = waits.get(c, 0.0) / n
    v[1 + 2 * num_stages + first] = checkpoint_wait_s / groups[first]
    v[1 + 3 * num_stages + first] = checkpoint_cpu_s / groups[first]
    if dist.get_world_size() > 1:
        dist.all_reduce(v)
    return v
