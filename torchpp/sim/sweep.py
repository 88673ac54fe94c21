"""Sweeps: every configuration of an experiment file under every priority scenario, into a CSV.

Scenarios per configuration (seed 002): no exclusive tier, ``fwd_prop`` exclusive, or
``grad_prop`` exclusive, crossed with every tuple of shared priorities on a grid of
``priority_step`` whose entries sum to 1 (66 + 11 + 11 = 88 at step 0.1). The work is split
over processes; rows are written in job order, so a parallel run writes the same file as a
single-process one. A re-run skips the rows its CSV already holds.
"""
from __future__ import annotations

import csv
import multiprocessing as mp
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from ..formats import SIM_COMM_TYPES, SIM_PARAMS, ExperimentConfig, FormatError, SimParams, SimSettings
from .model import Priorities
from .parametric import completion_time
from .seed002 import LivelockError

SETTING_COLUMNS = ("policy", "schedule", "congestion", "ideal_sync")
PRIORITY_COLUMNS = tuple(f"p_{t}" for t in SIM_COMM_TYPES)
COLUMNS = (*SIM_PARAMS, *SETTING_COLUMNS, *PRIORITY_COLUMNS, "completion_time")
KEY_COLUMNS = COLUMNS[:-1]


@dataclass(frozen=True)
class Scenario:
    """One priority setting: a shared value per comm type, or one type exclusive ('a')."""

    shared: tuple[float, float, float]
    exclusive: str | None = None

    @property
    def priorities(self) -> Priorities:
        return Priorities(shared=dict(zip(SIM_COMM_TYPES, self.shared)),
                          exclusive={self.exclusive: "a"} if self.exclusive else {})

    def labels(self) -> tuple[str, str, str]:
        return tuple("a" if t == self.exclusive else fmt(v) for t, v in zip(SIM_COMM_TYPES, self.shared))


def scenarios(step: float = 0.1) -> list[Scenario]:
    """The seed's scenarios; a zero share means zero priority."""
    k = int(round(1 / step))
    if k < 1 or abs(k * step - 1) > 1e-9:
        raise ValueError(f"--priority-step: expected a step that divides 1 (e.g. 0.1, 0.25), got {step}")
    v = [round(i / k, 10) for i in range(k + 1)]
    out = [Scenario((v[i], v[j], v[k - i - j])) for i in range(k + 1) for j in range(k + 1 - i)]
    out += [Scenario((0.0, v[j], v[k - j]), "fwd_prop") for j in range(k + 1)]
    out += [Scenario((v[i], 0.0, v[k - i]), "grad_prop") for i in range(k + 1)]
    return out


def fmt(v: object) -> str:
    """One spelling per value, so that a re-run recognises the rows it already has."""
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, float):
        return repr(round(v, 12))
    return str(v)


def row_key(p: SimParams, s: SimSettings, sc: Scenario) -> tuple[str, ...]:
    return (*(fmt(getattr(p, k)) for k in SIM_PARAMS), s.policy, s.schedule, fmt(s.congestion),
            fmt(s.ideal_sync), *sc.labels())


# ------------------------------------------------------------------ the work
_settings: SimSettings | None = None


def _init(settings: SimSettings) -> None:
    global _settings
    _settings = settings


def _one(p: SimParams, sc: Scenario) -> float:
    try:
        return completion_time(p, _settings, sc.priorities)
    except LivelockError:
        return float("nan")  # the original never finishes this scenario (seed002 policy only)


def _run_chunk(chunk: list[tuple[SimParams, Scenario]]) -> list[float]:
    if _settings is None:
        raise RuntimeError("sweep worker used before its settings were set")
    return [_one(p, sc) for p, sc in chunk]


def jobs(cfg: ExperimentConfig, step: float | None = None) -> list[tuple[SimParams, Scenario]]:
    scs = scenarios(step if step is not None else cfg.priority_step)
    return [(p, sc) for p in cfg.points() for sc in scs]


def read_done(path: Path) -> set[tuple[str, ...]]:
    """Keys of the rows an earlier (maybe interrupted) run wrote."""
    if not path.exists() or path.stat().st_size == 0:
        return set()
    with path.open(newline="") as f:
        rd = csv.reader(f)
        header = next(rd, None)
        if header is None:
            return set()
        if tuple(header) != COLUMNS:
            raise FormatError(str(path), "<header>", f"the sweep columns {','.join(COLUMNS)} (to resume into it)",
                              ",".join(header))
        return {tuple(r[:-1]) for r in rd if len(r) == len(COLUMNS) and r[-1] != ""}


def _chunks(items: list, size: int) -> Iterator[list]:
    for i in range(0, len(items), size):
        yield items[i:i + size]


def map_chunks(chunks: list[list[tuple[SimParams, Scenario]]], settings: SimSettings,
               workers: int = 1) -> Iterator[list[float]]:
    """Completion times chunk by chunk, in order, over ``workers`` processes."""
    if workers <= 1 or len(chunks) <= 1:
        _init(settings)
        yield from map(_run_chunk, chunks)
        return
    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    pool = ctx.Pool(workers, initializer=_init, initargs=(settings,))
    try:
        yield from pool.imap(_run_chunk, chunks)
    finally:
        pool.terminate()
        pool.join()


def run_sweep(cfg: ExperimentConfig, output: str | os.PathLike, *, workers: int | None = None,
              step: float | None = None, settings: SimSettings | None = None, progress: bool = True,
              chunk_size: int = 64) -> dict[str, int]:
    """Write one CSV row per (configuration, scenario); returns counts of done/skipped rows."""
    settings = settings or cfg.settings
    path = Path(output)
    path.parent.mkdir(parents=True, exist_ok=True)
    done = read_done(path)
    todo = [(p, sc) for p, sc in jobs(cfg, step) if row_key(p, settings, sc) not in done]
    total = len(todo) + len(done)
    workers = max(1, workers or os.cpu_count() or 1)
    new_file = not path.exists() or path.stat().st_size == 0
    from tqdm import tqdm

    bar = tqdm(total=total, initial=total - len(todo), unit="sim", disable=not progress, file=sys.stderr,
               dynamic_ncols=True, desc=path.name)
    with path.open("a", newline="") as f:
        w = csv.writer(f)
        if new_file:
            w.writerow(COLUMNS)
        chunks = list(_chunks(todo, chunk_size))
        results = map_chunks(chunks, settings, workers)
        try:
            for chunk, times in zip(chunks, results):
                for (p, sc), t in zip(chunk, times):
                    w.writerow((*row_key(p, settings, sc), repr(t)))
                f.flush()
                bar.update(len(chunk))
        finally:
            results.close()  # stops the worker pool, also on Ctrl-C
            bar.close()
    return {"rows": total, "computed": len(todo), "skipped": len(done)}


def read_results(path: str | os.PathLike) -> list[dict[str, str]]:
    p = Path(path)
    if not p.is_file():
        raise FormatError(str(p), "<file>", "an existing CSV written by `torchpp simulate sweep`")
    with p.open(newline="") as f:
        rows = list(csv.DictReader(f))
    if rows and not set(COLUMNS) <= set(rows[0]):
        missing = sorted(set(COLUMNS) - set(rows[0]))
        raise FormatError(str(p), "<header>", f"the sweep columns (missing {', '.join(missing)})")
    return rows
