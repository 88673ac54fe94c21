"""Atomic, per-step checkpoints that the HF model can load, and resuming from the last one.

Layout of ``<dir>/step_<N>/`` (N = optimizer steps done):

- ``model-stage<S>.safetensors``: stage S's parameters under their HF names; with
  ``config.json`` and ``model.safetensors.index.json`` the directory loads with
  ``AutoModelForCausalLM.from_pretrained``.
- ``optim-stage<S>.safetensors`` (+ ``optim.safetensors.index.json``): optimizer state keyed
  ``<param name>::<state key>``, so a resumed run may even use another split.
- ``rng-rank<R>.pt``: each rank's torch RNG state.
- ``manifest.json``: written last, after every rank's files are in place. A step directory
  without it is incomplete and ignored. It names every file with its size and digest
  (``digests``, hashed while the file was written); loading reads each file a rank needs back
  against it first, so a flipped byte or a cut file is found, never trained on. Index entries
  must be plain file names of the step directory (nothing outside it is ever read).

A checkpoint is *full* (the files above) or a *gradient log* (``kind: "gradients"``): the
gradients step N's update applied (``grads-stage<S>.safetensors``, after all-reduce and
clipping, keyed by HF name) and the learning rates it used, on top of checkpoint N-1. Loading it
loads the full checkpoint the chain starts from and replays each logged update, which gives the
same parameters and optimizer state as the run had (the optimizer's update is elementwise, so
under any split). A log is a third of AdamW's full checkpoint, which is what makes a checkpoint
every step cheap (``--checkpoint-every 1`` writes a full one every ``--full-checkpoint-every``
steps and logs between). Only a full checkpoint loads with ``from_pretrained``; a run's last
checkpoint is always full.

Every file is written to a temporary name and renamed; tensors go from their own memory to
the file (``tensor_files``), into the blocks of a file retired by pruning when there is one.
Files and renames reach the disk (``fdatasync``/``fsync``) before the manifest names them, so a
power cut never leaves a manifest over lost data (and a small host's memory limit reclaims the
clean cached pages without writing them). A stage's files are written by the
lowest rank of its group on each host, and each host's lowest rank writes the index and the
manifest, so a run on hosts without a shared file system can still resume.

A write that fails (a full disk: ENOSPC) fails on every rank at once with one line, and the
step's partial directory is removed. Resuming tries the newest checkpoint every rank has; one
that is damaged (a digest, size or format that does not match) is reported in one line and set
aside (renamed ``step_<N>.damaged``), and the one before is tried, until one loads on every rank.

Before the first step the directory is checked (a directory, writable, room for one
checkpoint) so a bad path fails at once rather than at the first write, and what a killed
write left (``.*.tmp`` files, step directories without a manifest, ``.recycle``) is removed.
Once a new checkpoint is complete on every rank, all but the newest ``keep`` complete ones are
retired: renamed into ``.recycle`` (no longer a checkpoint at once), whose files the next
checkpoints overwrite; the end of a run deletes it.
"""
from __future__ import annotations

import datetime
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..formats import file_hash, read_json, write_json
from ..models.stages import Stage, StageSet, read_tensors
from . import tensor_files
from .exchange import DisagreementError

MANIFEST = "manifest.json"
RECYCLE = ".recycle"
"""Where pruned checkpoints wait to have their files' pages overwritten by the next ones."""
RECYCLE_KEEP = 2
CKPT_FORMAT = "torchpp.checkpoint/1"
LOG_FORMAT = "torchpp.checkpoint-log/1"
"""A gradient log's manifest format: a reader that knows only full checkpoints skips it (and
resumes from the newest full one) instead of failing on files it does not expect."""
FULL, GRADIENTS = "full", "gradients"
"""A manifest's ``kind``: parameters and optimizer state, or one step's gradients on top of the step before."""
GRADS_INDEX = "grads.safetensors.index.json"
_STEP_RE = re.compile(r"^step_(\d+)$")
OPTIMIZER_STATES = {"adamw": 2, "sgd": 0}
"""Tensors of a parameter's size the optimizer keeps per parameter (AdamW: both moments)."""


class CheckpointDirError(ValueError):
    """The checkpoint directory cannot hold a checkpoint (a file in the way, not writable, full)."""


class CheckpointWriteError(DisagreementError):
    """Writing a checkpoint failed on some rank (the same one line on every rank; exit 2)."""


class CheckpointDamaged(ValueError):
    """A checkpoint's manifest, index or file does not hold what it should (one line naming it)."""


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step_{step:08d}"


def _atomic(path: Path, write, durable: bool = False) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        if durable:
            _fsync(Path(tmp))
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _fsync(path: Path) -> None:
    """Flush a file, or a directory's entries (its renames), to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _save_safetensors(path: Path, tensors: dict[str, torch.Tensor], meta: dict[str, str] | None = None) -> None:
    from safetensors.torch import save_file

    clean = {k: v.detach().contiguous() for k, v in tensors.items()}
    _atomic(path, lambda tmp: save_file(clean, tmp, metadata=meta or {"format": "pt"}))


def _write_tensors(root: str | Path, path: Path, tensors: dict[str, torch.Tensor]) -> tensor_files.FileDigest:
    """``tensor_files.write`` under a temporary name, renamed when complete; the file's digest."""
    reuse = _recycled(root, path.name)
    out: list[tensor_files.FileDigest] = []
    _atomic(path, lambda tmp: out.append(tensor_files.write(tmp, tensors, reuse=reuse, durable=True)))
    return out[0]


@dataclass(frozen=True)
class Roles:
    """Who writes what on this rank (decided once from the hosts of all ranks)."""

    stage: int
    writes_stage: bool
    writes_manifest: bool
    chunks: tuple[int, ...] = ()
    """Every chunk this rank holds (its files are written together); empty: just ``stage``."""

    @staticmethod
    def decide(rank: int, stage_of: dict[int, int], hosts: list[str], chunks: tuple[int, ...] = ()) -> "Roles":
        """``stage_of``: each rank's first chunk (ranks holding the same chunks share it)."""
        mine = hosts[rank]
        same_host = [r for r in range(len(hosts)) if hosts[r] == mine]
        writes_stage = rank == min(r for r in same_host if stage_of[r] == stage_of[rank])
        return Roles(stage=stage_of[rank], writes_stage=writes_stage, writes_manifest=rank == min(same_host),
                     chunks=chunks or (stage_of[rank],))


def _chunks(stage: Stage | StageSet, roles: "Roles") -> dict[int, list[tuple[str, torch.nn.Parameter]]]:
    """Chunk -> the parameters its file holds (a tensor shared by two chunks is written once)."""
    if isinstance(stage, StageSet):
        return {c: stage.owned(c) for c in stage.chunks}
    return {roles.stage: list(stage.named_parameters())}


def optimizer_tensors(stage: Stage | StageSet, optimizer: torch.optim.Optimizer,
                      only: list[tuple[str, torch.nn.Parameter]] | None = None) -> dict[str, torch.Tensor]:
    """Optimizer state keyed ``<param name>::<state key>`` (of ``only`` when given)."""
    names = {id(p): n for n, p in (only if only is not None else stage.named_parameters())}
    out: dict[str, torch.Tensor] = {}
    for p, st in optimizer.state.items():
        if id(p) not in names:
            continue
        for k, v in st.items():
            t = v if torch.is_tensor(v) else torch.tensor(v, dtype=torch.float64)
            out[f"{names[id(p)]}::{k}"] = t
    return out


@dataclass
class Snapshot:
    """What a checkpoint holds, taken between two steps: the tensors themselves (written before
    the next update, see :class:`BackgroundSaver`) or copies of them."""

    step: int
    stage: int
    params: dict[int, dict[str, torch.Tensor]]
    """Per chunk written by this rank, its parameters (a gradient log: their gradients) by HF name."""
    optim: dict[int, dict[str, torch.Tensor]]
    rng: torch.Tensor
    kind: str = FULL
    lrs: tuple[float, ...] = ()
    """A gradient log's learning rate per parameter group (what its replay must use)."""


def snapshot(step: int, *, roles: Roles, stage: Stage | StageSet, optimizer: torch.optim.Optimizer,
             copy: bool) -> Snapshot:
    """This rank's share of checkpoint ``step``; ``copy`` clones the tensors (needed when they are
    written in the background)."""
    take = (lambda t: t.detach().clone()) if copy else (lambda t: t.detach())
    params: dict[int, dict[str, torch.Tensor]] = {}
    optim: dict[int, dict[str, torch.Tensor]] = {}
    if roles.writes_stage:
        for c, named in _chunks(stage, roles).items():
            params[c] = {n: take(p) for n, p in named}
            optim[c] = {k: take(v) for k, v in optimizer_tensors(stage, optimizer, named).items()}
    return Snapshot(step=step, stage=roles.stage, params=params, optim=optim, rng=torch.get_rng_state())


def gradient_snapshot(step: int, *, roles: Roles, stage: Stage | StageSet, grads: dict[int, torch.Tensor],
                      lrs: tuple[float, ...]) -> Snapshot:
    """This rank's share of gradient log ``step``: ``grads`` are the gradients the update used
    (by parameter id; the optimizer has since dropped them, so they are no longer live)."""
    params: dict[int, dict[str, torch.Tensor]] = {}
    if roles.writes_stage:
        for c, named in _chunks(stage, roles).items():
            params[c] = {n: grads[id(p)].detach() for n, p in named if id(p) in grads}
    return Snapshot(step=step, stage=roles.stage, params=params, optim={}, rng=torch.get_rng_state(),
                    kind=GRADIENTS, lrs=tuple(lrs))


def write_files(root: str | Path, snap: Snapshot, rank: int) -> dict[str, Any]:
    """Write this rank's files of ``snap`` (each atomically, into the pages of a retired
    checkpoint's file when there is one); returns its part of the index, with each file's digest.
    A failed write (a full disk) is returned as the part's ``error`` (one line), not raised: every
    rank must learn of it in :func:`finalize`, or the others would wait for this one."""
    d = step_dir(root, snap.step)
    mine: dict[str, Any] = {"chunks": [], "kind": snap.kind, "lrs": list(snap.lrs), "digests": {}}
    digests = mine["digests"]
    name = ""
    try:
        d.mkdir(parents=True, exist_ok=True)
        for c, params in snap.params.items():
            if snap.kind == GRADIENTS:
                name = f"grads-stage{c}.safetensors"
                digests[name] = _write_tensors(root, d / name, params).to_json()
                mine["chunks"].append({"stage": c, "grads": sorted(params)})
                continue
            name = f"model-stage{c}.safetensors"
            digests[name] = _write_tensors(root, d / name, params).to_json()
            name = f"optim-stage{c}.safetensors"
            digests[name] = _write_tensors(root, d / name, snap.optim[c]).to_json()
            mine["chunks"].append({"stage": c, "params": sorted(params), "optim": sorted(snap.optim[c])})
        name = f"rng-rank{rank}.pt"
        _atomic(d / name, lambda tmp: torch.save(snap.rng, tmp), durable=True)
        digests[name] = tensor_files.digest_of(d / name).to_json()
        _fsync(d)  # the renames too: the manifest that follows may name only files on the disk
    except OSError as e:
        mine["error"] = _write_failure(root, snap.step, rank, d / name if name else d, e)
    return mine


def _write_failure(root: str | Path, step: int, rank: int, path: Path, e: OSError) -> str:
    """One line for a checkpoint write that failed (a full disk says how much is free)."""
    import errno

    why = e.strerror or str(e)
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        try:
            why += f" ({shutil.disk_usage(root).free / 1e6:,.1f} MB free)"
        except OSError:
            pass
    return f"--checkpoint-dir {root}: writing checkpoint step {step} failed on rank {rank} at {path.name}: {why}"


def _agree_written(root: str | Path, step: int, error: str | None, *, writes_manifest: bool, group: Any) -> None:
    """Collective: :func:`_fail_step` on every rank when any rank's write of ``step`` failed."""
    from .exchange import all_gather_json

    every = all_gather_json(error or "", group=group) if (dist.is_initialized()
                                                          and dist.get_world_size(group) > 1) else [error or ""]
    _fail_step(root, step, next((e for e in every if e), None), writes_manifest=writes_manifest)


def _fail_step(root: str | Path, step: int, error: str | None, *, writes_manifest: bool) -> None:
    """With an ``error`` (every rank holds the same one): remove step ``step``'s partial directory
    (the newest complete checkpoint stays) and raise :class:`CheckpointWriteError`."""
    if error is None:
        return
    d = step_dir(root, step)
    if writes_manifest:
        shutil.rmtree(d, ignore_errors=True)
    steps = [s for s in complete_steps(root) if s != step]
    newest = f"the newest complete checkpoint is step {steps[-1]}" if steps else "no complete checkpoint is left"
    raise CheckpointWriteError(f"{error}; the partial {d.name} was removed, {newest}: free space and run again "
                               "with --resume")


def finalize(root: str | Path, step: int, mine: dict[str, Any], *, roles: Roles, stage: Stage,
             info: dict[str, Any], keep: int = 0, group: Any = None, recycle_keep: int = RECYCLE_KEEP) -> Path | None:
    """Collective: once every rank's files of ``step`` are in place, write the index and the
    manifest (the mark of a complete checkpoint) and prune; the step directory on manifest writers."""
    from .exchange import all_gather_json

    d = step_dir(root, step)
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    parts = all_gather_json(mine, group=group)  # also the barrier: every rank's files are in place
    _fail_step(root, step, next((p["error"] for p in parts if p.get("error")), None),
               writes_manifest=roles.writes_manifest)
    error = None
    if roles.writes_manifest:
        try:
            _write_index_and_manifest(d, step, parts, stage, world, info)
        except OSError as e:
            error = _write_failure(root, step, dist.get_rank() if dist.is_initialized() else 0, d / MANIFEST, e)
    # every host's manifest is written (older checkpoints are no longer needed), or none is
    _agree_written(root, step, error, writes_manifest=roles.writes_manifest, group=group)
    if keep > 0 and roles.writes_manifest:
        prune(root, keep, recycle_keep)
    return d if roles.writes_manifest else None


def save(root: str | Path, step: int, *, rank: int, roles: Roles, stage: Stage, optimizer: torch.optim.Optimizer,
         info: dict[str, Any], timeout_s: float, keep: int = 0, grads: Snapshot | None = None,
         recycle_keep: int = RECYCLE_KEEP) -> Path | None:
    """All ranks call this after step ``step``; returns the step directory on manifest writers.
    ``grads``: write this gradient log (:func:`gradient_snapshot`) instead of a full checkpoint.

    With ``keep`` > 0, once every rank's manifest is written, manifest writers delete all but
    the newest ``keep`` complete checkpoints (0 keeps every one)."""
    snap = grads or snapshot(step, roles=roles, stage=stage, optimizer=optimizer, copy=False)
    mine = write_files(root, snap, rank)
    return finalize(root, step, mine, roles=roles, stage=stage, info=info, keep=keep, recycle_keep=recycle_keep)


class BackgroundSaver:
    """Checkpoints written during the next step, without copying a tensor (CheckFreq's
    snapshot/persist pipeline, with the snapshot free): parameters and optimizer state change
    only in the optimizer's update, so a thread writes them straight from the live tensors and
    the next update waits (an optimizer step pre-hook) until their bytes are in the files. The
    thread runs at the lowest priority, so it fills the time the pipeline leaves the CPU idle
    instead of competing with compute; an update that must wait for it lifts it back to the
    training thread's priority. It then gathers every rank's part on a process group of its own
    (so its collectives never interleave with the step's) and writes the manifest last: a
    checkpoint killed half-way has no manifest, so ``--resume`` never loads it. ``wait``
    re-raises what the thread raised.

    A gradient log's tensors are no longer live (the optimizer dropped them), so the update need
    not wait for it; the next step's first backward does (:meth:`before_backward`), so that the
    old gradients are freed before new ones are made and the step's peak memory is unchanged."""

    def __init__(self, root: str | Path, *, rank: int, roles: Roles, stage: Stage, keep: int, timeout_s: float,
                 recycle_keep: int = RECYCLE_KEEP):
        import datetime as _dt
        import threading

        self.root, self.rank, self.roles, self.stage, self.keep = Path(root), rank, roles, stage, keep
        self.recycle_keep = recycle_keep
        world = dist.get_world_size() if dist.is_initialized() else 1
        self.group = dist.new_group(backend="gloo", timeout=_dt.timedelta(seconds=timeout_s)) if world > 1 else None
        self._thread: Any = None
        self._tid: int | None = None
        self._urgent = False
        self._prio = threading.Lock()
        self._idle_nice = 19 if _can_renice() else None
        """Only a thread whose priority can be raised back is lowered (else an update could wait
        on a starved writer)."""
        self._written = threading.Event()
        self._written.set()
        self._live = True
        """The checkpoint in flight reads live tensors (a full one), not a gradient log's."""
        self._hooked: Any = None
        self._error: BaseException | None = None
        self.done: list[Path | None] = []
        self.waited_s = 0.0
        """Seconds updates spent waiting for the writer (the part of the checkpoint in the step)."""
        self.cpu_s = 0.0
        """CPU seconds the writer threads have used (files, gathering, manifest): what a checkpoint
        takes from the host even when no update waits for it."""

    def start(self, step: int, optimizer: torch.optim.Optimizer, info: dict[str, Any],
              grads: Snapshot | None = None) -> None:
        """Wait for the previous checkpoint, then write this one (or gradient log ``grads``) in
        the background."""
        import threading

        self.wait()
        if self._hooked is None:
            self._hooked = optimizer.register_step_pre_hook(self._before_update)
        snap = grads or snapshot(step, roles=self.roles, stage=self.stage, optimizer=optimizer, copy=False)
        self._live = snap.kind == FULL
        self._written.clear()
        self._tid, self._urgent = None, False
        self._thread = threading.Thread(target=self._write, args=(snap, info), name=f"checkpoint-{step}", daemon=True)
        self._thread.start()

    def _before_update(self, *_: Any) -> None:
        """The update may change the tensors only once the writer has read them."""
        if self._live:
            self._wait_written()

    def before_backward(self) -> None:
        """The executor calls this before a step's first backward: a gradient log in flight must
        be written before the new gradients are made."""
        if not self._live:
            self._wait_written()

    def _wait_written(self) -> None:
        if self._written.is_set():
            return
        import time

        t0 = time.perf_counter()
        self._hurry()
        self._written.wait()
        self.waited_s += time.perf_counter() - t0

    def _write(self, snap: Snapshot, info: dict[str, Any]) -> None:
        import threading
        import time

        cpu0 = time.thread_time()
        try:
            self._write_files(snap, info)
        finally:
            self.cpu_s += time.thread_time() - cpu0

    def _write_files(self, snap: Snapshot, info: dict[str, Any]) -> None:
        import threading

        with self._prio:
            self._tid = threading.get_native_id()
            if not self._urgent and self._idle_nice is not None:
                _set_nice(self._tid, self._idle_nice)
        try:
            try:
                mine = write_files(self.root, snap, self.rank)
            finally:
                snap.params.clear()  # a gradient log's tensors are held only by the snapshot: free them now
                snap.optim.clear()
                self._written.set()
            self.done.append(finalize(self.root, snap.step, mine, roles=self.roles, stage=self.stage, info=info,
                                      keep=self.keep, group=self.group, recycle_keep=self.recycle_keep))
        except BaseException as e:  # noqa: BLE001 (re-raised by wait() on the training thread)
            self._error = e

    def wait(self) -> list[Path | None]:
        """Block until the checkpoint in flight is complete; the directories finished since the last call."""
        if self._thread is not None:
            if self._thread.is_alive():
                self._hurry()
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise err
        out, self.done = self.done, []
        return out

    def _hurry(self) -> None:
        """The training thread waits for the writer: give it the training thread's priority."""
        with self._prio:
            self._urgent = True
            if self._tid is not None and self._idle_nice is not None:
                _set_nice(self._tid, _nice(None))

    def close(self) -> list[Path | None]:
        """``wait``, then stop watching the optimizer's updates."""
        try:
            return self.wait()
        finally:
            if self._hooked is not None:
                self._hooked.remove()
                self._hooked = None


def _can_renice() -> bool:
    """Whether a thread of this process may lower its priority and raise it back (Linux, and
    root or a large enough RLIMIT_NICE); tried on a throwaway thread."""
    import threading

    ok: list[bool] = []

    def probe() -> None:
        tid, base = threading.get_native_id(), _nice(None)
        try:
            os.setpriority(os.PRIO_PROCESS, tid, min(base + 1, 19))
            os.setpriority(os.PRIO_PROCESS, tid, base)
            ok.append(_nice(None) == base)
        except (OSError, AttributeError):
            ok.append(False)

    t = threading.Thread(target=probe, name="renice-probe")
    t.start()
    t.join()
    return bool(ok and ok[0])


def _nice(tid: int | None) -> int:
    """A thread's nice value (the calling thread's with None; 0 where unknown)."""
    try:
        return os.getpriority(os.PRIO_PROCESS, tid or 0)
    except (OSError, AttributeError):
        return 0


def _set_nice(tid: int | None, value: int) -> None:
    """Best effort: Linux sets one thread's priority by its id; raising it back may be refused."""
    if tid is None:
        return
    try:
        os.setpriority(os.PRIO_PROCESS, tid, value)
    except (OSError, AttributeError):
        pass


def _write_index_and_manifest(d: Path, step: int, parts: list[dict[str, Any]], stage: Stage, world: int,
                              info: dict[str, Any]) -> None:
    if parts and parts[0].get("kind") == GRADIENTS:
        grads_map = {n: f"grads-stage{part['stage']}.safetensors"
                     for part in (chunk for rank in parts for chunk in rank["chunks"]) for n in part["grads"]}
        write_json(d / GRADS_INDEX, {"metadata": {"step": step}, "weight_map": grads_map})
        _write_manifest(d, {"format": LOG_FORMAT, "kind": GRADIENTS, "step": step, "after": step - 1,
                            "lrs": parts[0]["lrs"], "files": sorted(set(grads_map.values())),
                            "world_size": world, **info, "digests": _digests(d, parts, [GRADS_INDEX])})
        return
    weight_map, optim_map = {}, {}
    for part in (chunk for rank in parts for chunk in rank["chunks"]):
        for n in part["params"]:
            weight_map[n] = f"model-stage{part['stage']}.safetensors"
        for n in part["optim"]:
            optim_map[n] = f"optim-stage{part['stage']}.safetensors"
    cfg = stage.cfg
    _atomic(d / "config.json", lambda tmp: cfg.to_json_file(tmp))
    write_json(d / "model.safetensors.index.json", {"metadata": {"step": step}, "weight_map": weight_map})
    write_json(d / "optim.safetensors.index.json", {"metadata": {"step": step}, "weight_map": optim_map})
    files = sorted(set(weight_map.values()) | set(optim_map.values()))
    _write_manifest(d, {"format": CKPT_FORMAT, "kind": FULL, "step": step, "files": files, "world_size": world,
                        **info, "digests": _digests(d, parts, ["config.json", "model.safetensors.index.json",
                                                               "optim.safetensors.index.json"])})


def _digests(d: Path, parts: list[dict[str, Any]], own: list[str]) -> dict[str, Any]:
    """Every rank's files' digests and those of the files the manifest writer just wrote."""
    out = {name: dig for part in parts for name, dig in part.get("digests", {}).items()}
    out.update({name: tensor_files.digest_of(d / name).to_json() for name in own})
    return dict(sorted(out.items()))


def _write_manifest(d: Path, manifest: dict[str, Any]) -> None:
    """The mark of a complete checkpoint: written once everything it names is on the disk."""
    _fsync(d)
    manifest["written"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    write_json(d / MANIFEST, manifest)
    _fsync(d / MANIFEST)
    _fsync(d)


def is_complete(d: Path) -> bool:
    """A step directory whose manifest is readable and whose listed files are all present."""
    return _complete_manifest(d) is not None


def _complete_manifest(d: Path) -> dict[str, Any] | None:
    """``d``'s manifest when the checkpoint is complete (else None). Another rank of this host may
    set ``d`` aside while it is read (:func:`resume_intact`): a manifest gone midway is none."""
    if not (d / MANIFEST).is_file():
        return None
    try:
        data = read_json(d / MANIFEST)
    except (ValueError, OSError):
        return None
    ok = data.get("format") in (CKPT_FORMAT, LOG_FORMAT) and all((d / f).is_file() for f in data.get("files", []))
    return data if ok else None


def _kinds(root: str | Path) -> dict[int, str]:
    """Each complete step directory's kind (full or gradients)."""
    r = Path(root)
    if not r.is_dir():
        return {}
    out = {}
    for p in r.iterdir():
        if (m := _STEP_RE.match(p.name)) and (data := _complete_manifest(p)) is not None:
            out[int(m.group(1))] = data.get("kind", FULL)
    return out


def _chain(kinds: dict[int, str], step: int) -> list[int] | None:
    """The steps loading ``step`` reads: its full checkpoint, then every gradient log up to it
    (None when a link is missing)."""
    out = []
    while step in kinds:
        out.append(step)
        if kinds[step] == FULL:
            return out[::-1]
        step -= 1
    return None


def complete_steps(root: str | Path) -> list[int]:
    """Steps a run can resume from in ``root`` (a complete full checkpoint, or a complete gradient
    log whose whole chain back to a full one is complete), oldest first."""
    kinds = _kinds(root)
    return sorted(s for s in kinds if _chain(kinds, s) is not None)


def prune(root: str | Path, keep: int, recycle_keep: int = RECYCLE_KEEP) -> list[Path]:
    """Retire all but the newest ``keep`` complete checkpoints (and the chains they load from);
    returns what was retired.

    A retired directory is renamed (at once it is no checkpoint) into ``<root>/.recycle``, whose
    files the next checkpoints overwrite in place (:func:`_recycled`); only the newest
    ``recycle_keep`` copies of each file wait there, and :func:`release_recycled` drops them at the end of a run."""
    if keep <= 0:
        return []
    kinds = _kinds(root)
    resumable = sorted(s for s in kinds if _chain(kinds, s) is not None)
    needed = {t for s in resumable[-keep:] for t in _chain(kinds, s) or ()}
    gone = [step_dir(root, s) for s in sorted(kinds) if s not in needed and s < max(needed, default=-1)]
    bin_ = Path(root) / RECYCLE
    for d in gone:
        try:
            bin_.mkdir(exist_ok=True)
            target = bin_ / d.name
            if target.exists():
                shutil.rmtree(target, ignore_errors=True)
            os.replace(d, target)
        except OSError:  # a host sharing the file system retired it first
            shutil.rmtree(d, ignore_errors=True)
    if bin_.is_dir():
        _trim_recycle(bin_, recycle_keep)
    return gone


def _trim_recycle(bin_: Path, keep: int) -> None:
    """Keep the newest ``keep`` retired copies of each file name (gradient logs retire many at
    once, and each later log overwrites one of them)."""
    seen: dict[str, int] = {}
    for old in sorted(bin_.iterdir(), reverse=True):
        names = [f.name for f in old.iterdir() if f.name.endswith(".safetensors")] if old.is_dir() else []
        useful = [n for n in names if seen.get(n, 0) < keep]
        for n in names:
            seen[n] = seen.get(n, 0) + 1
        if not useful:
            shutil.rmtree(old, ignore_errors=True)


def _recycled(root: str | Path, name: str) -> Path | None:
    """A retired checkpoint's file called ``name`` (newest first), to be overwritten; None if none."""
    bin_ = Path(root) / RECYCLE
    try:
        olds = sorted(bin_.iterdir(), reverse=True)
    except OSError:
        return None
    return next((o / name for o in olds if (o / name).is_file()), None)


def release_recycled(root: str | Path) -> None:
    """Delete the retired checkpoints kept for recycling (the run writes no more checkpoints)."""
    shutil.rmtree(Path(root) / RECYCLE, ignore_errors=True)


def clean_leftovers(root: str | Path) -> list[Path]:
    """Remove what a killed write left: ``.*.tmp`` files and step directories without a complete
    manifest (never loaded anyway). Call before any rank writes; returns what was removed."""
    r = Path(root)
    if not r.is_dir():
        return []
    removed: list[Path] = []
    for p in sorted(r.iterdir()):
        if p.name == RECYCLE and p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
            continue
        if _STEP_RE.match(p.name) and p.is_dir():
            if not is_complete(p):
                shutil.rmtree(p, ignore_errors=True)
                removed.append(p)
                continue
            tmps = sorted(p.glob(".*.tmp"))
        elif p.name.startswith(".") and p.name.endswith(".tmp") and p.is_file():
            tmps = [p]
        else:
            continue
        for t in tmps:
            t.unlink(missing_ok=True)
            removed.append(t)
    return removed


def checkpoint_bytes(stage: Stage, optimizer: str) -> int:
    """Bytes this stage's parameters and optimizer state take in a checkpoint."""
    params = sum(p.numel() * p.element_size() for p in stage.parameters())
    return params * (1 + OPTIMIZER_STATES.get(optimizer, 2))


def check_dir(root: str | Path, need_bytes: int) -> None:
    """Raise :class:`CheckpointDirError` unless ``root`` is (or can be made) a writable directory
    with ``need_bytes`` free; creates it."""
    root = Path(root)
    for p in (root, *root.parents):
        if p.exists() or p.is_symlink():
            if not p.is_dir():
                what = "is a file" if p == root else f"lies under {p}, which is a file"
                raise CheckpointDirError(f"--checkpoint-dir {root}: {what}, not a directory")
            break
    try:
        root.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=root, prefix=".writable-", suffix=".probe")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise CheckpointDirError(f"--checkpoint-dir {root}: not writable: {e.strerror or e}") from None
    free = shutil.disk_usage(root).free
    if free < need_bytes:
        raise CheckpointDirError(f"--checkpoint-dir {root}: {free / 1e6:,.1f} MB free, one checkpoint needs about "
                                 f"{need_bytes / 1e6:,.1f} MB")


def latest_local(root: str | Path, below: int | None = None) -> int:
    """The highest step (under ``below`` when given) with a complete checkpoint in ``root`` (-1 when none)."""
    steps = [s for s in complete_steps(root) if below is None or s < below]
    return steps[-1] if steps else -1


def agree_on_step(root: str | Path, below: int | None = None) -> int:
    """The newest step (under ``below`` when given) every rank can load (-1 when any rank has none)."""
    step = torch.tensor([latest_local(root, below)], dtype=torch.int64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(step, op=dist.ReduceOp.MIN)
    return int(step)


class CheckpointLoadError(DisagreementError):
    """No checkpoint left to resume from loads on every rank (the same line on every rank; exit 2)."""


def _plain(name: Any, where: Path) -> str:
    """``name`` when it is a file of the step directory itself (no path, no ``..``)."""
    if not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\\" in name or "\0" in name:
        raise CheckpointDamaged(f"{where}: names {name!r}, not a file of its own directory")
    return name


class _StepFiles:
    """One step directory's files as its manifest describes them: each file is checked against
    its size and digest the first time it is read (none are in a checkpoint written before
    digests: those files are only read)."""

    def __init__(self, d: Path):
        self.d = d
        try:
            self.manifest = read_json(d / MANIFEST)
            digests = self.manifest.get("digests")
            self.digests = (None if digests is None else
                            {_plain(k, d / MANIFEST): tensor_files.FileDigest.from_json(v) for k, v in digests.items()})
        except (ValueError, AttributeError) as e:
            raise CheckpointDamaged(f"{d / MANIFEST}: {str(e).splitlines()[0][:200]}") from None
        self._verified: set[str] = set()

    def path(self, name: str, where: Path | None = None) -> Path:
        """The file ``name`` of the step, verified."""
        p = self.d / _plain(name, where or self.d / MANIFEST)
        if name in self._verified:
            return p
        if self.digests is not None:
            if name not in self.digests:
                raise CheckpointDamaged(f"{p}: not in the manifest's digests")
            try:
                tensor_files.verify(p, self.digests[name])
            except tensor_files.DamagedFileError as e:
                raise CheckpointDamaged(str(e)) from None
        elif not p.is_file():
            raise CheckpointDamaged(f"{p}: missing")
        self._verified.add(name)
        return p

    def has(self, name: str) -> bool:
        return (self.d / name).is_file() or bool(self.digests and name in self.digests)

    def index(self, name: str, wanted) -> dict[str, Path]:
        """Index ``name``'s key -> file map; the files holding keys for which ``wanted(key)`` is
        true are verified (the others belong to other ranks)."""
        p = self.path(name)
        try:
            wm = read_json(p).get("weight_map")
        except (ValueError, AttributeError) as e:
            raise CheckpointDamaged(f"{p}: {str(e).splitlines()[0][:200]}") from None
        if not isinstance(wm, dict):
            raise CheckpointDamaged(f"{p}: field 'weight_map': expected an object name -> file")
        out = {k: self.d / _plain(v, p) for k, v in wm.items()}
        for f in sorted({wm[k] for k in wm if wanted(k)}):
            self.path(f, p)
        return out


@torch.no_grad()
def load(root: str | Path, step: int, *, rank: int, stage: Stage, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Load this rank's parameters, optimizer state and RNG from step ``step`` (a gradient log:
    its chain's full checkpoint, then each logged update replayed); returns the manifest, with
    ``replayed`` the number of updates replayed. Every file read is verified first; anything
    wrong with the checkpoint is a :class:`CheckpointDamaged` naming the file."""
    from safetensors import SafetensorError

    chain = _chain(_kinds(root), step)
    if chain is None:
        raise CheckpointDamaged(f"{step_dir(root, step)}: no complete checkpoint chain ends at step {step}")
    try:
        _load_full(root, chain[0], stage=stage, optimizer=optimizer)
        _replay(root, chain[1:], stage=stage, optimizer=optimizer)
        files = _StepFiles(step_dir(root, step))
        if files.has(f"rng-rank{rank}.pt"):  # a rank of a larger world than the checkpoint's has none
            torch.set_rng_state(torch.load(files.path(f"rng-rank{rank}.pt"), weights_only=True))
    except CheckpointDamaged:
        raise
    except (OSError, ValueError, KeyError, RuntimeError, SafetensorError) as e:
        text = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        raise CheckpointDamaged(f"{step_dir(root, step)}: cannot be loaded: {text}") from None
    return {**files.manifest, "replayed": len(chain) - 1}


def set_aside(d: Path) -> Path | None:
    """Rename a damaged step directory out of the checkpoints (``<name>.damaged``, numbered when
    taken); None when another host did it first."""
    target = d.with_name(d.name + ".damaged")
    n = 1
    while target.exists():
        n += 1
        target = d.with_name(f"{d.name}.damaged{n}")
    try:
        os.replace(d, target)
    except OSError:
        return None
    return target


def resume_intact(root: str | Path, step: int, *, rank: int, roles: Roles, stage: Stage,
                  optimizer: torch.optim.Optimizer, report, check=None) -> tuple[int, dict[str, Any]]:
    """Collective: load the newest checkpoint, from ``step`` down, that loads on every rank; returns
    its step and manifest. Each damaged one is reported (``report``, one line) and set aside by
    each host's manifest writer; every rank tries the same steps in the same order. None left:
    :class:`CheckpointLoadError` on every rank (a partly loaded stage is no fresh start).

    ``check(step, manifest, config)`` (the HF config dict of the model the checkpoint holds) runs
    before anything is loaded; what it raises as a :class:`DisagreementError` (this run must
    not continue that checkpoint) is raised on every rank."""
    first = None
    while step > 0:
        try:
            return step, _agreed_load(root, step, rank=rank, stage=stage, optimizer=optimizer, check=check)
        except CheckpointDamaged as e:
            why = str(e)
        first = first or why
        d = step_dir(root, step)
        if roles.writes_manifest:
            set_aside(d)
        nxt = agree_on_step(root, below=step)
        report(f"checkpoint {d} is damaged: {why}; set aside as {d.name}.damaged"
               + (f", trying step {nxt}" if nxt > 0 else ""))
        step = nxt
    raise CheckpointLoadError(f"--checkpoint-dir {root}: no intact checkpoint to resume from ({first}); "
                              "start without --resume (or with another --checkpoint-dir)")


def model_config(root: str | Path, step: int) -> dict[str, Any]:
    """The HF config (``config.json``) of the model checkpoint ``step`` holds (a gradient log's is
    its chain's full checkpoint's)."""
    chain = _chain(_kinds(root), step)
    if chain is None:
        raise CheckpointDamaged(f"{step_dir(root, step)}: no complete checkpoint chain ends at step {step}")
    path = _StepFiles(step_dir(root, chain[0])).path("config.json")
    try:
        data = read_json(path)
    except ValueError as e:
        raise CheckpointDamaged(f"{path}: {str(e).splitlines()[0][:200]}") from None
    if not isinstance(data, dict):
        raise CheckpointDamaged(f"{path}: expected a JSON object")
    return data


def _agreed_load(root: str | Path, step: int, *, rank: int, stage: Stage,
                 optimizer: torch.optim.Optimizer, check=None) -> dict[str, Any]:
    """Collective: ``check``, then :func:`load`, on every rank; what ``check`` refused (a
    :class:`DisagreementError`) or :class:`CheckpointDamaged` on every rank (naming the first
    rank's problem) when either failed on any."""
    from .exchange import all_gather_json

    manifest, err = {}, ["", ""]
    try:
        if check is not None:
            check(step, _StepFiles(step_dir(root, step)).manifest, model_config(root, step))
        manifest = load(root, step, rank=rank, stage=stage, optimizer=optimizer)
    except CheckpointDamaged as e:
        err = ["damaged", str(e)]
    except DisagreementError as e:
        err = ["refused", str(e)]
    every = all_gather_json(err) if dist.is_initialized() and dist.get_world_size() > 1 else [err]
    for kind in ("refused", "damaged"):
        bad = [(r, e) for r, (k, e) in enumerate(every) if k == kind]
        if bad and kind == "refused":
            raise DisagreementError(bad[0][1])
        if bad:
            r, e = bad[0]
            raise CheckpointDamaged(e if len(every) == 1 else f"rank {r}: {e}")
    return manifest


def _replay(root: str | Path, steps: list[int], *, stage: Stage, optimizer: torch.optim.Optimizer) -> None:
    """Apply each logged update again: the logged gradients at the logged learning rates."""
    if not steps:
        return
    params = dict(stage.named_parameters())
    aliases = {n: stage.source_name(n) for n in params if stage.source_name(n) != n}
    lrs = [g["lr"] for g in optimizer.param_groups]
    mine = set(params) | set(aliases.values())
    try:
        for s in steps:
            files = _StepFiles(step_dir(root, s))
            manifest = files.manifest
            index = files.index(GRADS_INDEX, mine.__contains__)
            d = files.d
            # a parameter the update gave no gradient is absent: the replay skips it too
            grads = read_tensors(d, list(params), aliases, index=index, missing_ok=True)
            for p in params.values():
                p.grad = None
            for n, g in grads.items():  # copied: a mapped file may be recycled in place later
                params[n].grad = g.to(params[n].dtype, copy=True)
            for g, lr in zip(optimizer.param_groups, manifest["lrs"]):
                g["lr"] = lr
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    finally:
        for g, lr in zip(optimizer.param_groups, lrs):
            g["lr"] = lr


def _load_full(root: str | Path, step: int, *, stage: Stage, optimizer: torch.optim.Optimizer) -> None:
    files = _StepFiles(step_dir(root, step))
    d = files.d
    params = dict(stage.named_parameters())
    aliases = {n: stage.source_name(n) for n in params if stage.source_name(n) != n}
    mine = set(params) | set(aliases.values())
    index = files.index("model.safetensors.index.json", mine.__contains__)
    # every file is verified before the first parameter changes
    optim_paths = files.index("optim.safetensors.index.json", lambda k: k.split("::", 1)[0] in mine)
    optim_index = {k: p.name for k, p in optim_paths.items()}
    tensors = read_tensors(d, list(params), aliases, index=index)
    for n, p in params.items():
        p.copy_(tensors[n].to(p.dtype))
    state: dict[int, dict[str, Any]] = {}
    order = [p for group in optimizer.param_groups for p in group["params"]]
    names = {id(p): n for n, p in stage.named_parameters()}
    from safetensors import safe_open

    handles: dict[str, Any] = {}
    try:
        for i, p in enumerate(order):
            n = names[id(p)]
            src = n if any(k.startswith(n + "::") for k in optim_index) else aliases.get(n, n)
            keys = [k for k in optim_index if k.startswith(src + "::")]
            if not keys:
                continue
            st: dict[str, Any] = {}
            for k in keys:
                f = optim_index[k]
                if f not in handles:
                    handles[f] = safe_open(str(d / f), framework="pt").__enter__()
                # a copy: the tensor would map the file, which a later checkpoint recycles in place
                st[k.split("::", 1)[1]] = handles[f].get_tensor(k).clone()
            state[i] = st
    finally:
        for h in handles.values():
            h.__exit__(None, None, None)
    sd = optimizer.state_dict()
    sd["state"] = state
    optimizer.load_state_dict(sd)


def plan_fingerprint(plan_path: str | Path) -> str:
    return file_hash(plan_path)
