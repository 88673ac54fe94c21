"""Planning over the survivors, for the elastic driver: the same measurements, only the hosts still alive.

Not to be confused with ``torchpp.planner.replan`` (`torchpp replan`), which corrects the costs
from a run's timelines and plans again; here nothing is re-measured, hosts are only taken away
or given back.

The planner is asked exactly what `torchpp plan` would be asked (planner/api.py) with a
devices file cut down to the survivors, the old plan's global batch (so the data order, one
global batch per step, is unchanged) and its schedule. When no plan fits, the planner's own
message (memory the model needs, memory the devices have) is the error.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from ..formats import Plan, read_json, write_json


@dataclass
class Replanned:
    plan_path: Path
    plan: Plan
    hosts: list[str]
    seconds: float
    predicted_step_s: float


def read_hosts_file(path: Path | None) -> list[str] | None:
    """Hosts a hosts file allows: a JSON list, or one name a line (``#`` comments); None without one."""
    if path is None or not path.is_file():
        return None
    text = path.read_text()
    if text.lstrip().startswith("["):
        return [str(h) for h in json.loads(text)]
    return [ln.split("#", 1)[0].strip() for ln in text.splitlines() if ln.split("#", 1)[0].strip()]


def write_devices(devices: Path, hosts: list[str], out: Path) -> Path:
    """``devices`` cut down to ``hosts`` (their fixed ranks dropped: the planner numbers the new world)."""
    data = read_json(devices)
    missing = [h for h in hosts if h not in data]
    if missing:
        raise ValueError(f"{devices}: no entry for host(s) {', '.join(missing)}")
    kept = {}
    for h in hosts:
        v = data[h]
        kept[h] = {k: x for k, x in v.items() if k != "rank"} if isinstance(v, dict) else v
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(kept, indent=1) + "\n")
    return out


def first_search_schedule(plan_path: Path) -> str:
    """The schedule kinds the first plan's search allowed (``plan_meta.json`` beside it, as
    ``torchpp plan`` writes it): a re-plan searches them all, not just the kind it chose; "auto"
    (every kind) when the plan came without one."""
    meta = Path(plan_path).with_name("plan_meta.json")
    try:
        asked = json.loads(meta.read_text()).get("schedule")
    except (OSError, ValueError, AttributeError):
        return "auto"
    return asked if isinstance(asked, str) and asked else "auto"


def plan_survivors(cfg, old: Plan, hosts: list[str], out_dir: Path) -> Replanned:
    """Plan ``old``'s model and batch over ``hosts`` with ``cfg``'s measurements; writes the plan files
    into ``out_dir``. Raises :class:`~torchpp.elastic.driver.ElasticError` when nothing fits."""
    from ..planner import api
    from ..planner.types import InfeasibleError
    from .errors import ElasticError

    if not hosts:
        raise ElasticError("no host is left to train on")
    t0 = time.perf_counter()
    devices = write_devices(cfg.devices, hosts, out_dir / "devices.json")
    inputs = api.PlanInputs(layers=list(cfg.layers), bandwidth=cfg.bandwidth, devices=devices,
                            capacities=cfg.capacities, memory_model=cfg.memory_model)
    asked = getattr(cfg, "schedule", None) or first_search_schedule(cfg.plan)
    try:
        try:
            res = api.plan(inputs, api.PlanOptions(global_batch=old.global_batch, schedule=asked))
        except InfeasibleError:
            if asked == "auto":
                raise
            # the kind the first search was held to does not fit the survivors: whatever does
            res = api.plan(inputs, api.PlanOptions(global_batch=old.global_batch, schedule="auto"))
    except InfeasibleError as e:
        raise ElasticError(f"the hosts left ({', '.join(hosts)}) cannot hold the model: {e}") from None
    out_dir.mkdir(parents=True, exist_ok=True)
    res.plan.save(out_dir / "plan.json")  # the rest of `plan`'s files (a Gantt PNG) would only delay the restart
    write_json(out_dir / "plan_meta.json", res.meta)
    used = sorted({d.host for s in res.plan.stages for d in s.devices})
    return Replanned(plan_path=out_dir / "plan.json", plan=res.plan, hosts=used,
                     seconds=time.perf_counter() - t0, predicted_step_s=float(res.plan.predicted["step_time_s"]))
