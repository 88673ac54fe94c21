"""Seed 002 reference cases (the original simulator's completion times) and their replay."""
from __future__ import annotations

import csv
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from ...formats import FormatError
from ..model import Priorities, SimError
from .loop import simulate_seed002

CASE_COLUMNS = ("case", "num_gpus", "n", "sync_freq", "is_ideal", "use_recv_congestion", "fwd_impact", "bwd_impact",
                "lengths_json", "priorities_json", "exclusive_tiers_json", "completion_time")


@dataclass(kw_only=True, frozen=True)
class ReferenceCase:
    case: str
    num_gpus: int
    n: int
    sync_freq: int
    is_ideal: bool
    use_recv_congestion: bool
    fwd_impact: float
    bwd_impact: float
    lengths: dict
    priorities: dict
    exclusive_tiers: dict
    completion_time: float

    def run(self) -> float:
        pr = Priorities.of(self.priorities, self.exclusive_tiers)
        return simulate_seed002(num_gpus=self.num_gpus, n=self.n, sync_freq=self.sync_freq, lengths=self.lengths,
                                priorities=pr, fwd_impact=self.fwd_impact, bwd_impact=self.bwd_impact,
                                is_ideal=self.is_ideal, use_recv_congestion=self.use_recv_congestion).completion_time


def _bool(v: str, path: str, field: str) -> bool:
    if v in ("True", "true", "1"):
        return True
    if v in ("False", "false", "0"):
        return False
    raise FormatError(path, field, "True or False", v)


def load_cases(path: str | os.PathLike) -> list[ReferenceCase]:
    p = Path(path)
    if not p.is_file():
        raise FormatError(str(p), "<file>", "an existing CSV of reference cases")
    out = []
    with p.open(newline="") as f:
        rd = csv.DictReader(f)
        missing = [c for c in CASE_COLUMNS if c not in (rd.fieldnames or [])]
        if missing:
            raise FormatError(str(p), "<header>", f"columns {', '.join(CASE_COLUMNS)}", f"missing {missing}")
        for i, r in enumerate(rd):
            where = f"row {i + 1}"
            try:
                out.append(ReferenceCase(
                    case=r["case"], num_gpus=int(r["num_gpus"]), n=int(r["n"]), sync_freq=int(r["sync_freq"]),
                    is_ideal=_bool(r["is_ideal"], str(p), f"{where}.is_ideal"),
                    use_recv_congestion=_bool(r["use_recv_congestion"], str(p), f"{where}.use_recv_congestion"),
                    fwd_impact=float(r["fwd_impact"]), bwd_impact=float(r["bwd_impact"]),
                    lengths=json.loads(r["lengths_json"]), priorities=json.loads(r["priorities_json"]),
                    exclusive_tiers=json.loads(r["exclusive_tiers_json"]),
                    completion_time=float(r["completion_time"])))
            except (ValueError, json.JSONDecodeError) as e:
                if isinstance(e, FormatError):
                    raise
                raise FormatError(str(p), where, "numbers and JSON objects in the case columns", str(e)) from None
    return out


def check_cases(cases: list[ReferenceCase]) -> Iterator[tuple[ReferenceCase, float, str | None]]:
    """(case, completion time, error) for each case; error is the simulator's refusal, if any."""
    for c in cases:
        try:
            yield c, c.run(), None
        except SimError as e:
            yield c, float("nan"), f"{type(e).__name__}: {e}"
