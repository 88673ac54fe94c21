"""Nothing lost by default: where a run's outputs go, a checkpoint when the run is told to stop,
and a resume that continues the same training or says what changed.

- **Output directory.** ``torchpp.train`` writes its checkpoints (``step_<N>/``) and the final
  model (``final/``) to ``runs/<plan stem>/`` beside the plan unless told otherwise, as HF
  Trainer writes to its ``output_dir``; one start-up line says where.
- **Stop at a step boundary.** SIGTERM (a scheduler's preemption, torchrun shutting down) or
  SIGINT (Ctrl-C) sets a flag; every rank learns of any rank's flag in the step's statistics
  all-reduce (no extra collective), so all ranks checkpoint the same step and exit with
  128 + the signal's number. A second signal stops at once.
- **Resume the same training.** A checkpoint records the settings that decide what is trained
  (data, tokenizer, model, optimizer, seed); resuming under other settings is refused with
  every difference named, unless ``--accept-changes``; ``--steps`` below the checkpoint's step
  is an error.
"""
from __future__ import annotations

import os
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .exchange import DisagreementError

RUNS = "runs"
"""Default outputs: ``<plan folder>/runs/<plan stem>/`` (``./runs/plan/`` for ``--plan plan.json``)."""


class ResumeError(DisagreementError):
    """Resuming would continue another training than the checkpoint's (the same line on every rank; exit 2)."""


def default_output_dir(plan: str | Path) -> Path:
    """Where a run of ``plan`` keeps its checkpoints and final model unless told otherwise."""
    plan = Path(plan)
    return plan.parent / RUNS / plan.stem


@dataclass
class StopRequest:
    """SIGTERM/SIGINT seen by this process: the run checkpoints at the next step boundary and exits."""

    signum: int = 0
    rank: int = 0
    _old: dict[int, Any] = field(default_factory=dict)

    def install(self) -> "StopRequest":
        """Catch SIGTERM and SIGINT (main thread only; elsewhere signals keep their handlers)."""
        import threading

        if threading.current_thread() is not threading.main_thread():
            return self
        for s in (signal.SIGTERM, signal.SIGINT):
            self._old[s] = signal.signal(s, self._handle)
        return self

    def _handle(self, signum: int, _frame: Any) -> None:
        self.signum = signum
        self.restore()  # a second signal acts at once
        # os.write, not print or logging: both take locks the interrupted code may hold
        os.write(2, (f"torchpp.train: rank {self.rank}: {signal.Signals(signum).name}: stopping after this step "
                     "(with a checkpoint when the run keeps them); send it again to stop now\n").encode())

    def restore(self) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)
        self._old.clear()

    @property
    def requested(self) -> bool:
        return self.signum != 0

    @property
    def exit_code(self) -> int:
        return 128 + self.signum if self.signum else 0


SETTINGS = ("data", "eval", "tokenizer", "model", "optimizer", "lr", "weight_decay", "adam_eps", "adam_betas",
            "max_grad_norm", "lr_schedule", "seed")
"""What a resumed run must share with its checkpoint (the plan may change: tensors are by name)."""


def settings(fp: dict[str, str]) -> dict[str, str]:
    """The settings a checkpoint records, from the run's fingerprint (``trainer.fingerprint``, which
    every rank has agreed on)."""
    return {k: fp[k] for k in SETTINGS if k in fp}


def check_resume(root: Path, step: int, manifest: dict[str, Any], now: dict[str, str], *, steps: int,
                 accept_changes: bool) -> list[str]:
    """Raise :class:`ResumeError` when checkpoint ``step`` was trained under other settings than
    ``now`` (unless ``accept_changes``) or lies beyond ``steps``; returns the differences accepted."""
    where = f"--checkpoint-dir {root}: step {step}"
    if step > steps:
        raise ResumeError(f"{where} is beyond --steps {steps}: pass --steps above {step} to train on, or start "
                          "from scratch in another --output-dir")
    then = manifest.get("settings")
    if not isinstance(then, dict):
        return []  # written before settings were recorded: nothing to compare
    diffs = [f"{k} {then.get(k, '<none>')!s} -> {now.get(k, '<none>')!s}" for k in sorted(set(then) | set(now))
             if str(then.get(k)) != str(now.get(k))]
    if diffs and not accept_changes:
        raise ResumeError(f"{where} was trained with other settings: {'; '.join(diffs)}: resume with the same "
                          "ones, or pass --accept-changes to continue under the new ones")
    return diffs


def check_fresh_start(root: Path, resume: bool) -> None:
    """A run that does not resume must not write over another run's checkpoints."""
    from . import checkpoint as ckpt

    if resume:
        return
    steps = ckpt.complete_steps(root)
    if steps:
        raise ResumeError(f"--checkpoint-dir {root}: holds another run's checkpoints (up to step {steps[-1]}): "
                          "pass --resume to continue it, or choose another --output-dir/--checkpoint-dir")


MODEL_SHAPE = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim", "vocab_size", "tie_word_embeddings", "n_embd", "n_layer", "n_head")
"""Config fields that decide the tensors' shapes: a checkpoint of another model never loads."""


def check_same_model(root: Path, step: int, then: dict[str, Any], now: dict[str, Any]) -> None:
    """Raise :class:`ResumeError` when checkpoint ``step`` holds a model of other shapes than the
    one this run builds (``--accept-changes`` cannot change that: its tensors do not fit)."""
    diffs = [f"{k} {then.get(k)} -> {now.get(k)}" for k in MODEL_SHAPE
             if (k in then or k in now) and then.get(k) != now.get(k)]
    if diffs:
        raise ResumeError(f"--checkpoint-dir {root}: step {step} holds another model ({'; '.join(diffs)}): resume "
                          "with that model, or start in another --output-dir")


def output_problem(dirs: dict[str, Path | None], checkpoint_dir: Path | None = None) -> str | None:
    """Create each output directory (``--flag`` -> path) and write a probe into it; the first
    problem as one line (None: all usable). Checked on every rank before the first step, so an
    unwritable ``--export-dir`` fails at once, not after training. ``checkpoint_dir`` (which
    holds the default export directory) is checked first, as ``checkpoint.check_dir`` says it."""
    import os
    import tempfile

    from ..validate import output_dir
    from .checkpoint import CheckpointDirError, check_dir

    if checkpoint_dir is not None:
        try:
            check_dir(checkpoint_dir, 0)
        except CheckpointDirError as e:
            return str(e)
    for flag, d in dirs.items():
        if d is None:
            continue
        try:
            output_dir(d, flag)
            Path(d).mkdir(parents=True, exist_ok=True)
            fd, probe = tempfile.mkstemp(dir=d, prefix=".writable-", suffix=".probe")
            os.close(fd)
            os.unlink(probe)
        except ValueError as e:
            return str(e)
        except OSError as e:
            return f"{flag} {d}: not writable: {e.strerror or e}"
    return None
