"""Inputs that were once answered silently or with a traceback: each is now one line
naming the file, the field and what was expected (exit 2), or a correct answer.

In-process through ``torchpp.cli.main`` on files torchpp itself made (only the topology plan
builds a preset's config, on the meta device).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from test_fuzz_cli import world  # noqa: F401 (the fixture: measured files, capacities, a plan, its trace)
from torchpp.cli import main


def _search(w: dict[str, Path], **swap: Path) -> list[str]:
    f = {**w, **swap}
    return ["--layers", str(f["la"]), str(f["lb"]), "--capacities", str(f["caps"]), "--bandwidth", str(f["bw"]),
            "--devices", str(f["devices"])]


def _refused(capsys, argv: list[str], *expected: str) -> str:
    """Run ``torchpp argv``: exit 2 and one stderr line holding every ``expected`` piece."""
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and ": error: " in err, err
    for piece in expected:
        assert piece in err, (piece, err)
    return err


def _mutated(src: Path, dst: Path, edit: Any) -> Path:
    data = json.loads(src.read_text())
    edit(data)
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_text(json.dumps(data))
    return dst


def test_capacities_table_batch_beyond_any_profile_is_refused(world, capsys):
    """A table batch of 1e40 made every per-sample time vanish (a 1-stage plan instead of the
    measured answer); the batch is a profile's and is bounded like a layers file's ``run.batch``."""
    for v in (10**40, 5000):
        caps = _mutated(world["caps"], world["root"] / f"caps_batch{v}.json",
                        lambda c: c["tables"]["a"].__setitem__("batch", v))
        _refused(capsys, ["plan", *_search(world, caps=caps), "--out-dir", str(world["root"] / "o")],
                 str(caps), "tables.a.batch", "<= 4096")


def _trace(world: dict[str, Path], name: str, edit: Any) -> Path:
    """A copy of the simulated timeline with ``edit`` applied, alone in its folder."""
    return _mutated(world["traces"] / "timeline_step1_all.json",
                    world["root"] / f"tr_{name}" / "timeline_step1_all.json", edit).parent


def _first_forward(trace: dict[str, Any]) -> dict[str, Any]:
    return next(e for e in trace["traceEvents"] if e.get("ph") == "X" and e["name"].startswith("F"))


def _set_pids(trace: dict[str, Any], pid: int, every: bool) -> None:
    for e in trace["traceEvents"] if every else [_first_forward(trace)]:
        e["pid"] = pid


def _beyond_plan(trace: dict[str, Any]) -> None:
    e = _first_forward(trace)
    e["name"], e["args"]["microbatch"] = "F99", 99


@pytest.mark.parametrize("every", [True, False], ids=["every-event", "one-event"])
def test_a_pid_that_is_no_rank_is_refused_by_analyze_and_replan(world, capsys, every):
    """Events of pid 99 were analysed as a 'rank 99' running every stage."""
    tr = _trace(world, f"pid99_{every}", lambda t: _set_pids(t, 99, every))
    o = str(world["root"] / "o")
    for argv in (["analyze", str(tr), "--out", o], ["analyze", str(tr), "--plan", str(world["plan"]), "--out", o],
                 ["replan", "--plan", str(world["plan"]), "--traces", str(tr), *_search(world)[:7], "--out-dir", o]):
        _refused(capsys, argv, str(tr), ".pid'", "0..1", "got 99")


def test_a_pid_beyond_the_plan_without_world_size_is_refused_with_the_plan(world, capsys):
    tr = _trace(world, "pid99_nows", lambda t: (_set_pids(t, 99, True), t["metadata"].pop("world_size")))
    _refused(capsys, ["analyze", str(tr), "--plan", str(world["plan"]), "--out", str(world["root"] / "o")],
             str(tr), ".pid'", f"a rank of {world['plan']} (0..1)", "got 99")


def test_a_microbatch_beyond_the_plan_is_refused(world, capsys):
    tr = _trace(world, "mb99", _beyond_plan)
    o = str(world["root"] / "o")
    _refused(capsys, ["analyze", str(tr), "--plan", str(world["plan"]), "--out", o],
             str(tr), "F<mb> of rank 0", "micro-batches 0..7", "num_microbatches", "99]")
    _refused(capsys, ["analyze", str(tr), "--out", o], str(tr), "F<mb> of rank 0", "micro-batches 0..7", "99]")
    _refused(capsys, ["replan", "--plan", str(world["plan"]), "--traces", str(tr), *_search(world)[:7],
                      "--out-dir", o], str(tr), "micro-batches 0..7", "num_microbatches")


def test_a_world_size_the_events_do_not_fill_is_refused(world, capsys):
    tr = _trace(world, "ws5", lambda t: t["metadata"].__setitem__("world_size", 5))
    _refused(capsys, ["analyze", str(tr), "--out", str(world["root"] / "o")], str(tr), "metadata.world_size", "got 5")


@pytest.mark.parametrize("verb", ["analyze", "replan"])
def test_an_infinite_world_size_is_one_line(world, capsys, verb):
    """``"world_size": Infinity`` (JSON's spelling, which Python reads) was an OverflowError in replan."""
    tr = _trace(world, "wsinf", lambda t: t["metadata"].__setitem__("world_size", float("inf")))
    assert "Infinity" in (tr / "timeline_step1_all.json").read_text()
    o = str(world["root"] / "o")
    argv = (["analyze", str(tr), "--plan", str(world["plan"]), "--out", o] if verb == "analyze" else
            ["replan", "--plan", str(world["plan"]), "--traces", str(tr), *_search(world)[:7], "--out-dir", o])
    _refused(capsys, argv, str(tr), "metadata.world_size", "an integer")


def test_the_untouched_timeline_is_still_analysed(world, capsys):
    """The checks refuse what is wrong, not the simulator's own timeline."""
    o = world["root"] / "ok"
    assert main(["analyze", str(world["traces"]), "--plan", str(world["plan"]), "--out", str(o)]) == 0
    assert main(["analyze", str(world["traces"]), "--out", str(o)]) == 0
    assert json.loads((o / "report.json").read_text())["measured"]["num_stages"] == 2


@pytest.mark.parametrize("rank", [99, 2])
def test_a_devices_rank_beyond_its_hosts_is_refused(world, capsys, rank):
    """``"rank": 99`` among two hosts was ignored (the planner numbered the ranks itself)."""
    dev = world["root"] / f"devices_rank{rank}.json"
    dev.write_text(json.dumps({"a": {"memory_gb": 4, "rank": rank}, "b": 4}))
    _refused(capsys, ["plan", *_search(world, devices=dev), "--out-dir", str(world["root"] / "o")],
             str(dev), "a.rank", "0..1", f"got {rank}")
    _refused(capsys, ["replan", "--plan", str(world["plan"]), "--traces", str(world["traces"]),
                      *_search(world, devices=dev), "--out-dir", str(world["root"] / "o")], str(dev), "a.rank")


@pytest.mark.parametrize("edit,field", [({"n": []}, "'n'"), ({"sync_freq": []}, "'sync_freq'"),
                                        ({"n": [2], "sync_freq": [4, 8]}, "'sync_freq'")],
                         ids=["empty-list", "empty-sync", "every-point-dropped"])
def test_a_sweep_of_no_points_is_refused(world, capsys, edit, field):
    """A grid with no point (an empty list, or every sync_freq above every n, which the sweep
    drops) wrote a header-only CSV and exited 0."""
    exp = _mutated(Path(__file__).parents[1] / "configs" / "sim_experiment.json",
                   world["root"] / f"exp_{len(str(edit))}.json", lambda e: e.update(edit))
    out = world["root"] / "sweep.csv"
    _refused(capsys, ["simulate", "sweep", "-c", str(exp), "--output", str(out)], str(exp), field)
    assert not out.exists()


def test_plan_estimate_on_a_topology_without_dtype_plans_in_bfloat16(world, capsys):
    """The documented command has no --dtype: it was ``KeyError: None``; it now prices bfloat16,
    the precision ``simulate topology`` assumes by default for the same plan."""
    spec = world["root"] / "spec.json"
    spec.write_text(json.dumps({"devices": {"gpu": {"flops": 1e14, "memory_gb": 80}}, "link_gbps": 100}))
    topo = Path(__file__).parents[1] / "configs" / "topologies" / "wifi_8.json"
    out = world["root"] / "topo_plan"
    assert main(["plan", "--estimate", "--model", "qwen3-tiny", "--device-spec", str(spec), "--topology", str(topo),
                 "--devices", "8", "--seq-len", "32", "--out-dir", str(out)]) == 0
    plan = json.loads((out / "plan.json").read_text())
    assert plan["model"]["dtype"] == "bfloat16"
    assert main(["simulate", "topology", str(out / "plan.json"), "--topology", str(topo), "--model", "qwen3-tiny",
                 "--flops", "1e14", "--trace", str(out / "t.json")]) == 0
    for bad, field in (({"flops": -1}, "'flops'"), ({"devices": {"g": {"flops": "x"}}}, "devices.g.flops"), ([], "<root>"),
                       ({"devices": {}}, "'flops'")):
        spec.write_text(json.dumps(bad))
        _refused(capsys, ["plan", "--estimate", "--model", "qwen3-tiny", "--device-spec", str(spec), "--topology",
                          str(topo), "--devices", "8", "--out-dir", str(out)], str(spec), field)


@pytest.mark.parametrize("flag,value", [(f, v) for f in ("--flops", "--tp") for v in ("0", "-1", "nan", "inf")]
                         + [("--flops", "1e300"), ("--tp", "1e12")])
def test_simulate_topology_refuses_a_flag_out_of_range(world, capsys, flag, value):
    topo = Path(__file__).parents[1] / "configs" / "topologies" / "wifi_8.json"
    _refused(capsys, ["simulate", "topology", str(world["plan"]), "--topology", str(topo), "--model", "qwen3-tiny",
                      "--flops", "1e12", f"{flag}={value}"], f"argument {flag}: expected")
