"""Price once: a `plan` call replays the chosen plan on its own costs exactly once (the search's
replay is what the prediction and the gap to the bound read), and ``predicted`` is a typed record
whose JSON is the object the planner always wrote."""
import json

import pytest

from torchpp.cost import FreeLinks
from torchpp.formats import Plan, Predicted
from torchpp.planner import api
from torchpp.planner.report import predict
from test_planner_api import measured as measured_dir  # noqa: F401  (a fixture: the same files)
import torchpp.sim.measured as measured_mod


@pytest.fixture
def measured(measured_dir):
    return api.PlanInputs(layers=[measured_dir / "layers_cpu1.json", measured_dir / "layers_cpu2.json"],
                          capacities=measured_dir / "capacities.json", bandwidth=measured_dir / "bandwidth.json",
                          devices=measured_dir / "devices.json")


@pytest.mark.parametrize("schedule", ["1f1b", "auto"])
def test_a_plan_call_replays_the_chosen_plan_once(measured, monkeypatch, schedule):
    replays = []
    real = measured_mod.replay

    def counting(sched, cost):
        replays.append(cost)
        return real(sched, cost)

    monkeypatch.setattr(measured_mod, "replay", counting)
    res = api.plan(measured, api.PlanOptions(global_batch=8, schedule=schedule))
    chosen = [c for c in replays if c.plan is res.plan]
    on_own_costs = [c for c in chosen if not isinstance(c.links, FreeLinks)]
    assert len(on_own_costs) == 1
    assert len(chosen) == 4  # and the gap's three counterfactuals: free links; without the runtime's calls; free calls
    # the reused replay is the plan's price: replaying it again gives the same prediction
    again, _ = predict(res.plan, res.problem.profiles, res.problem.links, res.problem.memory, res.problem.budget,
                       res.problem.optimizer_s_per_byte)
    kept = res.plan.predicted.to_json()
    assert again.to_json() == {k: v for k, v in kept.items() if k != "optimizer"}


def test_predicted_is_a_typed_record_with_the_same_json(measured, tmp_path):
    res = api.plan(measured, api.PlanOptions(global_batch=8, schedule="1f1b"))
    pred = res.plan.predicted
    assert isinstance(pred, Predicted) and pred["step_time_s"] == pred.step_time_s > 0
    assert set(pred.to_json()) == {"step_time_s", "throughput_samples_per_s", "lower_bound_s", "ratio_to_lower_bound",
                                   "gap_to_bound", "bubble", "memory_model", "memory_bytes_per_rank", "stages",
                                   "optimizer"}
    res.plan.save(tmp_path / "p.json")
    raw = json.loads((tmp_path / "p.json").read_text())["predicted"]
    assert raw == json.loads(json.dumps(pred.to_json()))
    back = Plan.load(tmp_path / "p.json")
    assert back.predicted == Predicted.from_json(raw) and back.predicted.step_time_s == pred.step_time_s
    raw["layout"] = {"pp": 2}  # a key the record does not know is kept and written back
    assert Predicted.from_json(raw).to_json()["layout"] == {"pp": 2}
