"""What a training rank does for the elastic driver: a heartbeat per step, and showing the
driver's decisions (failure seen, new plan, resumed step) where a run is looked at.

The driver (torchpp/elastic/driver.py) and the ranks share only files: the driver appends one JSON
record per decision to ``decisions.jsonl`` and passes it with ``--elastic-log``; each rank
overwrites ``<heartbeat dir>/rank<R>`` with the number of steps done after every step. Files
keep the ranks free of any connection to the driver, so the same ranks run under torchrun or
`torchpp cluster run`.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

SCALARS = {"failure": "elastic/failures", "plan": "elastic/world_size", "resume": "elastic/resumed_step"}
"""TensorBoard scalar of each decision kind (value: the count, the new world size, the step)."""


def heartbeat(directory: Path | None, rank: int, step: int) -> None:
    """Record that this rank finished ``step`` (atomic: the driver never reads a torn number)."""
    if directory is None:
        return
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f".rank{rank}.tmp"
    tmp.write_text(str(step))
    os.replace(tmp, directory / f"rank{rank}")


def read_heartbeats(directory: Path) -> dict[int, tuple[int, float]]:
    """``{rank: (steps done, mtime)}`` of every heartbeat file in ``directory``."""
    out: dict[int, tuple[int, float]] = {}
    if not directory.is_dir():
        return out
    for p in directory.glob("rank*"):
        try:
            out[int(p.name[4:])] = (int(p.read_text() or 0), p.stat().st_mtime)
        except (ValueError, OSError):
            continue
    return out


def read_decisions(path: Path | None) -> list[dict[str, Any]]:
    """The driver's decisions so far (empty without a log)."""
    if path is None or not Path(path).is_file():
        return []
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def report_decisions(path: Path | None, log: Any) -> list[dict[str, Any]]:
    """Copy the driver's decisions into this run's metrics.jsonl and TensorBoard (rank 0's ``log``:
    ``event``, ``scalars`` and its ``tb`` writer); returns them for the traces' metadata."""
    decisions = read_decisions(path)
    failures = 0
    for i, d in enumerate(decisions):
        log.event({"event": f"elastic_{d.get('kind', 'decision')}", **d})
        kind = d.get("kind")
        if kind == "failure":
            failures += 1
        value = {"failure": failures, "plan": d.get("world_size", 0), "resume": d.get("step", 0)}.get(kind)
        if value is not None:
            log.scalars(i, {SCALARS[kind]: float(value)})
        if getattr(log, "tb", None) is not None:
            log.tb.add_text("elastic/decisions", json.dumps(d), i)
    if decisions and getattr(log, "tb", None) is not None:
        log.tb.flush()
    return decisions
