"""The simulator's layout: no import cycle inside sim/, nothing above it imported, the plan
builders below both planner and simulator, the engine's parts pluggable."""
import ast
import subprocess
import sys
from pathlib import Path

import pytest

from torchpp import plans
from torchpp.formats import SimParams
from torchpp.planner import simple
from torchpp.sim.compiled import Compiled, check_finished, durations
from torchpp.sim.core import Run, step
from torchpp.sim.engine import SimOptions, simulate
from torchpp.sim.links import links_hooks
from torchpp.sim.parametric import ParamCost, compiled_parametric

ROOT = Path(__file__).resolve().parents[1]
SIM = ROOT / "torchpp" / "sim"


def _sim_imports(path: Path) -> set[str]:
    """Modules of torchpp.sim that ``path`` imports (at module level or inside functions)."""
    mod = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    pkg = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
    if path.name == "__init__.py":
        mod = pkg
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = pkg
            for _ in range(node.level - 1):
                base = base.rsplit(".", 1)[0]
            name = f"{base}.{node.module}" if node.level and node.module else (node.module or base)
            targets = [name] + [f"{name}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            continue
        for t in targets:
            f = ROOT.joinpath(*t.split("."))
            if t.startswith("torchpp.sim") and t != mod and (f.with_suffix(".py").is_file() or f.is_dir()):
                out.add(t)
    return out


def test_no_import_cycle_inside_sim():
    graph = {}
    for p in SIM.rglob("*.py"):
        mod = ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        graph[mod] = _sim_imports(p) - {"torchpp.sim"}
    state: dict[str, int] = {}

    def visit(m, path):
        if state.get(m) == 1:
            pytest.fail("import cycle: " + " -> ".join(path[path.index(m):] + [m]))
        if state.get(m) == 2:
            return
        state[m] = 1
        for t in sorted(graph.get(m, ())):
            visit(t, path + [m])
        state[m] = 2

    for m in sorted(graph):
        visit(m, [])
    assert "torchpp.sim.replay" not in graph["torchpp.sim.engine"]


def test_pricing_imports_neither_planner_nor_torch():
    code = ("import sys, torchpp.sim.parametric, torchpp.sim.sweep, torchpp.sim.replay, "
            "torchpp.sim.seed002.reference\n"
            "bad = sorted(m for m in sys.modules if m.startswith('torchpp.planner') or m == 'torch')\n"
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_plan_builders_sit_below_planner_and_simulator():
    code = ("import sys, torchpp.plans\n"
            "loaded = sorted(m for m in sys.modules if m.startswith('torchpp'))\n"
            "assert all(m in ('torchpp', 'torchpp.plans', 'torchpp.validate') or m.split('.')[:2] == ['torchpp', "
            "'formats'] for m in loaded), loaded\n"
            "assert 'torchpp.formats.plan' in loaded, loaded")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
    assert simple.make_plan is plans.make_plan and simple.even_layer_ranges is plans.even_layer_ranges


def test_the_core_runs_with_a_comm_model_plugged_in():
    """The engine is the core plus a model: driving them by hand gives simulate's result."""
    comp = compiled_parametric(3, 5, 2)
    cost = ParamCost(SimParams(n=5, stages=3, sync_freq=2, prop_len=0.7, fwd_impact=0.0, bwd_impact=0.0))
    run = Run(comp, durations(comp, cost))
    step(run, links_hooks(run))
    check_finished(comp, run.pc)
    assert max(run.end) == simulate(comp, cost, SimOptions(comm="links")).makespan


def test_a_deadlocked_schedule_is_reported_with_the_schedule():
    from torchpp.schedules import Action, Kind, ScheduleError

    sched = {0: [Action(Kind.RECV_ACT, 1, 0, peer=1), Action(Kind.SEND_GRAD, 1, 0, peer=1)],
             1: [Action(Kind.RECV_GRAD, 0, 0, peer=0), Action(Kind.SEND_ACT, 0, 0, peer=0)]}
    comp = Compiled(sched)
    for comm in ("links", "shared"):
        with pytest.raises(ScheduleError, match="deadlocks"):
            simulate(comp, ParamCost(SimParams(n=1, stages=2)), SimOptions(comm=comm))
