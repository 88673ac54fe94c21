"""The planning API: the same plan and files as `torchpp plan`, from dataclasses instead of flags."""
import json

import pytest

from torchpp.cli import main
from torchpp.errors import UsageError
from torchpp.formats import Plan
from torchpp.planner import api
from torchpp.planner.synthetic import layers_file, uniform_links


@pytest.fixture
def measured(tmp_path):
    for h, s in (("cpu1", 1.0), ("cpu2", 2.0)):
        layers_file(h, num_layers=4, speed=s, batch=2).save(tmp_path / f"layers_{h}.json")
    uniform_links(["cpu1", "cpu2", "cpu3"], 1e6).save(tmp_path / "bandwidth.json")
    (tmp_path / "capacities.json").write_text(json.dumps({"ref_host": "cpu1", "capacity": {"cpu1": 1, "cpu3": 0.5}}))
    (tmp_path / "devices.json").write_text(json.dumps({"cpu1": 1, "cpu2": 1, "cpu3": 1}))
    return tmp_path


def inputs(d) -> api.PlanInputs:
    return api.PlanInputs(layers=[d / "layers_cpu1.json", d / "layers_cpu2.json"], capacities=d / "capacities.json",
                          bandwidth=d / "bandwidth.json", devices=d / "devices.json")


def test_api_plans_and_writes_what_the_command_does(measured, capsys):
    assert main(["plan", "--layers", str(measured / "layers_cpu1.json"), str(measured / "layers_cpu2.json"),
                 "--capacities", str(measured / "capacities.json"), "--bandwidth", str(measured / "bandwidth.json"),
                 "--devices", str(measured / "devices.json"), "--global-batch", "8", "--schedule", "gpipe",
                 "--compare", "even,dp", "--out-dir", str(measured / "cli")]) == 0
    printed = capsys.readouterr().out
    lines: list[str] = []
    res = api.plan(inputs(measured), api.PlanOptions(global_batch=8, schedule="gpipe", compare=["even", "dp"]),
                   progress=lines.append)
    written = api.write(res, measured / "lib")
    assert [p.name for p in written] == list(api.OUTPUTS) and all(p.stat().st_size > 0 for p in written)
    assert (measured / "lib" / "plan.json").read_text() == (measured / "cli" / "plan.json").read_text()
    for name in ("stages.csv", "steps.csv"):
        assert (measured / "lib" / name).read_text() == (measured / "cli" / name).read_text()
    assert [c["name"] for c in res.compare] == ["chosen (optimal)", "even", "dp"]
    assert lines[0].startswith("planning synthetic (4 layers) on 3 device(s), global batch 8")
    assert all(x in printed for x in lines)  # the command prints the same progress
    assert res.meta["search"]["recompute"] is True and res.meta["schedule"] == "gpipe"
    # pricing a given plan on the same costs gives the plan's own prediction
    again = api.predict_plan(Plan.load(measured / "lib" / "plan.json"), api.load(inputs(measured)))
    assert again["step_time_s"] == pytest.approx(res.plan.predicted["step_time_s"])


def test_inputs_and_options_are_checked(measured):
    with pytest.raises(ValueError, match="layers files or an estimate"):
        api.PlanInputs()
    with pytest.raises(ValueError, match="bandwidth and devices"):
        api.PlanInputs(layers=[measured / "layers_cpu1.json"])
    with pytest.raises(ValueError, match="schedule"):
        api.PlanOptions(schedule="zb")
    with pytest.raises(ValueError, match="Strategy.name"):
        api.Strategy(name="tp")
    (measured / "devices.json").write_text(json.dumps({"cpu1": 1, "ghost": 1}))
    with pytest.raises(ValueError, match="ghost"):
        api.load(inputs(measured))
    with pytest.raises(UsageError, match="--seq-len"):
        api.load(api.PlanInputs(**{**inputs(measured).__dict__, "seq_len": 999}))
    assert api.compare_names(" even, ,dp,x.json") == ["even", "dp", "x.json"] and api.compare_names(None) == []


def test_fixed_plan_is_the_commands(tmp_path):
    assert main(["plan", "--strategy", "even", "--stages", "2", "--group-sizes", "2,1", "--global-batch", "8",
                 "--out", str(tmp_path / "cli.json")]) == 0
    p = api.fixed_plan(api.Strategy(name="even", stages=2, group_sizes=[2, 1]), api.PlanOptions(global_batch=8))
    assert p == Plan.load(tmp_path / "cli.json")
    with pytest.raises(UsageError, match="--devices"):
        api.fixed_plan(api.Strategy(name="dp"), api.PlanOptions())


def test_compare_prices_each_strategy_at_its_own_best_micro_batching(measured):
    """`--compare even,pp,dp,single`: every fixed strategy at the fastest of its own micro-batchings
    that fits (not the chosen plan's), and `single` as the best one device."""
    from torchpp.planner.simple import fixed_candidates

    res = api.plan(inputs(measured), api.PlanOptions(global_batch=8, compare=["even", "pp", "dp", "single"]))
    rows = {c["name"]: c for c in res.compare}
    assert list(rows) == ["chosen (optimal)", "even", "pp", "dp", "single"]
    pb, budget = res.problem, res.problem.budget
    for name in ("even", "pp", "dp", "single"):
        cands = [api.price(p, pb, budget) for p in fixed_candidates(name, res.plan.model, pb.hosts, seq_len=res.plan.seq_len,
                                                                   global_batch=8)]
        best = min(c.step_time_s for c in cands if c.fits)
        assert rows[name]["step_time_s"] == pytest.approx(best) and not rows[name]["oom"]
        assert len({c.plan.num_microbatches for c in cands}) > 1  # really several micro-batchings
    assert len(rows["single"]["hosts"]) == 1 and len(rows["even"]["hosts"]) == 3


def test_single_device_that_fits_nowhere_says_so(measured):
    """Budgets too small for the whole model on any one device: `single` is reported as not fitting."""
    res = api.plan(inputs(measured), api.PlanOptions(global_batch=8))
    pb = res.problem
    from torchpp.planner.simple import fixed_candidates

    cands = [api.price(p, pb, pb.budget) for p in fixed_candidates("single", res.plan.model, pb.hosts,
                                                                   seq_len=res.plan.seq_len, global_batch=8)]
    need = min(d["memory_bytes"] for c in cands for s in c.predicted["stages"] for d in s["devices"])
    tight = {h: need * 0.9 for h in pb.hosts}
    got = api.best_fixed("single", res.plan.model, pb, tight, seq_len=res.plan.seq_len, global_batch=8)
    assert got is not None and not got.fits
    row = api.compare_plans(["single"], res.plan, pb, tight)[1]
    assert row["oom"] and "does not fit" in __import__("torchpp.planner.report", fromlist=["x"]).summary_text(
        res.plan, {}, [api.compare_plans([], res.plan, pb, tight)[0], row])
