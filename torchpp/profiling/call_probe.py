"""The runtime's own seconds per compute call on this host, measured by running the runtime.

Block timings (``measure_layers``) time each block's forward and backward alone. A pipeline
rank also spends time between two compute calls of its own: dispatching actions, posting sends
and receives, the waiter threads of traced steps, copies. The cost model prices that per call
(``LayersFile.call_overhead_s``); left at 0 a first plan under-predicts its steps and favours
many small micro-batches. The probe runs the same trainer ``torchpp train`` runs, traced as
training runs are, on a small two-stage pipeline of local processes over gloo, and reads the
per-call time off its timelines exactly as ``torchpp replan`` reads it off a real run
(:func:`torchpp.trace.call_gaps.call_gaps`). It runs inside the host (inside its cgroup on an
emulated cluster), so a slow host measures its own slowdown. Both ranks share the host, so the
pipeline runs one micro-batch per step: then one rank computes while the other waits for it,
never both at once. With 8 micro-batches in flight each rank's gaps had taken the CPU the other
computed with: on the emulated homelab the laptop read 4.2 ms per call that way against 0.9-1.2
ms with one micro-batch, and its real runs 1.2-2.5 ms (the Pi 4s 4.9 against 2.8-4.0 and
2.0-5.8 in real runs). The ranks are
forked from the profile, so they share its imports: they add about 50 MiB, which hosts of
750 MiB can spare (spawned, they needed 560 MiB).
"""
from __future__ import annotations

import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True, kw_only=True)
class CallProbeConfig:
    """The probe's pipeline: small enough to take seconds, long enough for a steady mean."""

    model: str = "qwen3-tiny"
    """Preset to train (its layers split in two stages)."""
    seq_len: int = 16
    microbatches: int = 1
    """Micro-batches of one sample each: 2 × microbatches compute calls per rank and step; one
    keeps the two ranks from computing at once (see the module docstring)."""
    steps: int = 64
    """Steps to run; the first warms up and is not traced, the others are measured. The gaps are
    heavy-tailed on a small CPU quota (a few throttled ones carry the mean a real run pays), so
    the mean needs many: with 24 steps the emulated Pi 3's read 5.2 to 9.3 ms over six profiles.
    The probe's time is its start (about 15 s here with 24 or 64 steps)."""
    threads: int = 1
    """Torch intra-op threads per rank (the profile's ``--threads``)."""
    timeout_s: float = 90.0
    """Deadline of the whole run (starting both processes included); past it both are killed."""
    fork: bool = True
    """Start the ranks as copies of this process (torch, transformers and the runtime, imported
    here once, are shared with them: 48 MiB of new memory instead of 559) rather than as fresh
    interpreters that import them again. `torchpp profile` probes before any torch work, as a
    forked rank needs (OpenMP's threads do not survive a fork)."""

    def __post_init__(self) -> None:
        if self.steps < 2:
            raise ValueError(f"steps: expected >= 2 (the first is not measured), got {self.steps}")
        if self.microbatches < 1:
            raise ValueError(f"microbatches: expected >= 1, got {self.microbatches}")
        if self.threads < 1 or self.timeout_s <= 0 or self.seq_len < 1:
            raise ValueError(f"threads, seq_len and timeout_s must be positive, got {self.threads}, "
                             f"{self.seq_len}, {self.timeout_s}")


@dataclass
class CallProbeResult:
    """What the probe measured: the mean gap and the numbers it is the mean of."""

    call_overhead_s: float
    """Mean over every rank and traced step of the runtime's seconds between two compute calls."""
    gaps_s: list[float]
    steps: list[int]
    """The traced (measured) steps."""
    wall_s: float
    """Seconds the probe took, starting its processes included."""


class CallProbeError(RuntimeError):
    """The probe's run failed or its timelines held no gap to measure."""


def _probe_rank(rank: int, world: int, config: dict[str, Any]) -> None:
    from ..runtime.trainer import TrainConfig, train

    train(TrainConfig(**config))


def _probe_plan(cfg: CallProbeConfig, path: Path) -> Path:
    from ..models.presets import load_config, model_info
    from ..plans import even_layer_ranges, make_plan

    info = model_info(load_config(cfg.model), cfg.model)
    make_plan(info, seq_len=cfg.seq_len, global_batch=cfg.microbatches, num_microbatches=cfg.microbatches,
              layer_ranges=even_layer_ranges(info.num_layers, 2), group_sizes=[1, 1], schedule="1f1b",
              hosts=["probe0", "probe1"], strategy="call-probe").save(path)
    return path


def _loopback_env() -> dict[str, str]:
    """Both ranks are on this host: keep gloo on loopback (a host's name may resolve elsewhere)."""
    return {"GLOO_SOCKET_IFNAME": "lo"} if Path("/sys/class/net/lo").exists() else {}


def _first_line(e: BaseException) -> str:
    return str(e).splitlines()[0] if str(e) else type(e).__name__


def _log_tail(log: Path, e: BaseException, lines: int = 5) -> str:
    """The last lines the failing rank wrote (its traceback ends there)."""
    rank = getattr(e, "rank", 0)
    path = Path(str(log).format(rank=rank))
    try:
        tail = path.read_text(errors="replace").strip().splitlines()[-lines:]
    except OSError:
        return ""
    return f"\n  rank {rank}'s last lines:\n    " + "\n    ".join(tail) if tail else ""


def read_call_gaps(trace_dir: Path) -> tuple[list[float], list[int]]:
    """Every rank's gaps between compute calls in every merged timeline of ``trace_dir``, and
    the steps they came from."""
    from ..trace.analyze import events_from_trace
    from ..trace.call_gaps import call_gaps
    from ..trace.chrome import load_trace
    from ..trace.report import find_timelines

    gaps, steps = [], []
    for step, path in find_timelines(trace_dir):
        steps.append(step)
        for g in call_gaps(events_from_trace(load_trace(path))).values():
            gaps.extend(g)
    return gaps, steps


def memory_room() -> float:
    """Bytes this process may still add: the machine's available memory, or less where its
    memory cgroup (v2, or v1's memory controller) has a limit (an emulated host, a container)."""
    import psutil

    room = float(psutil.virtual_memory().available)
    host_limit = os.environ.get("TORCHPP_HOST_MEMORY")  # an emulated host (`torchpp cluster run`)
    if host_limit and host_limit.isdigit():
        room = min(room, float(host_limit) - psutil.Process().memory_info().rss)
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return room
    for line in lines:
        _, controllers, rel = line.split(":", 2)
        if controllers == "":
            d, limit, used = Path("/sys/fs/cgroup") / rel.lstrip("/"), "memory.max", "memory.current"
        elif "memory" in controllers.split(","):
            d, limit, used = Path("/sys/fs/cgroup/memory") / rel.lstrip("/"), "memory.limit_in_bytes", "memory.usage_in_bytes"
        else:
            continue
        try:
            cap = (d / limit).read_text().strip()
            if cap != "max" and float(cap) < 2**60:  # v1 writes "no limit" as a huge number
                room = min(room, float(cap) - float((d / used).read_text()))
        except (OSError, ValueError):
            continue  # that hierarchy is not mounted here: the other figures stand
    return room


PROBE_RANKS_BYTES = 900 * 2**20
"""Resident size of two fresh (spawned) ranks together at their peak (torch, transformers, gloo
and the tiny model each; 793 MiB RSS, 559 MiB unshared, measured on the development machine) and
a margin: with 883 MiB free under an 0.88 GiB limit the kernel killed a profile."""
PROBE_FORKED_BYTES = 160 * 2**20
"""The same for two ranks forked from the profile (its imports shared, copy-on-write): 48 MiB
unshared at their peak on the development machine (639 MiB RSS, nearly all of it the parent's
pages), with a margin for the pages a longer run would touch."""


def probe_memory_needed(cfg: CallProbeConfig | None = None) -> float:
    """What starting the probe's two ranks adds to this host's memory."""
    return float(PROBE_FORKED_BYTES if cfg is None or _forks(cfg) else PROBE_RANKS_BYTES)


def _forks(cfg: CallProbeConfig) -> bool:
    """Fork only a process that no process group is set up in (the ranks would inherit it)."""
    import torch.distributed as dist

    return cfg.fork and not (dist.is_available() and dist.is_initialized())


def probe_call_overhead(cfg: CallProbeConfig = CallProbeConfig(), workdir: Path | None = None) -> CallProbeResult:
    """Train ``cfg``'s pipeline on two local ranks and return the mean runtime time per call.

    ``workdir`` keeps the plan and the traces (default: a temporary folder, removed after).
    Raises :class:`CallProbeError` when the run fails, overruns ``cfg.timeout_s`` or measures nothing.
    """
    from ..runtime.launch import RankError, RankPool, RanksTimedOut

    need, room = probe_memory_needed(cfg), memory_room()
    if need > room:  # two more processes would have the kernel kill this one (a small host's memory limit)
        raise CallProbeError(f"two more processes need ~{need / 2**20:.0f} MiB, this host has {room / 2**20:.0f} MiB "
                             "free; hosts priced from capacities.json then take the reference host's value "
                             "scaled by their capacity")
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="torchpp-call-probe-") as tmp:
        root = Path(workdir) if workdir is not None else Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        plan = _probe_plan(cfg, root / "call_probe_plan.json")
        trace_dir = root / "call_probe_traces"
        run = dict(plan=plan, steps=cfg.steps, threads=cfg.threads, timeout_s=cfg.timeout_s, seed=0,
                   trace_dir=trace_dir, trace_steps=tuple(range(2, cfg.steps + 1)))
        log = root / "call_probe_rank{rank}.log"
        try:
            fork = _forks(cfg)
            if fork:
                from ..runtime import trainer  # noqa: F401  (imported once, here, for both ranks)
            with RankPool(2, threads=cfg.threads, env=_loopback_env(), log=str(log),
                          start_method="fork" if fork else "spawn") as pool:
                pool.run(_probe_rank, run, timeout_s=max(1.0, cfg.timeout_s - (time.monotonic() - t0)),
                         pg_timeout_s=cfg.timeout_s)
        except (RankError, RanksTimedOut, OSError) as e:
            raise CallProbeError(f"the runtime's pipeline run failed: {_first_line(e)}{_log_tail(log, e)}") from e
        gaps, steps = read_call_gaps(trace_dir)
    if not gaps:
        raise CallProbeError(f"no gaps between compute calls in the traces of steps {steps} ({trace_dir})")
    return CallProbeResult(call_overhead_s=float(statistics.fmean(gaps)), gaps_s=gaps, steps=steps,
                           wall_s=time.monotonic() - t0)
