"""plan.json: round trip, and errors that name the file, the field and the expected value."""
import json

import pytest

from torchpp.cli import main
from torchpp.formats import FormatError, Plan, split_samples, validate_plan
from torchpp.models.presets import load_config, model_info
from torchpp.planner.simple import even_plan


@pytest.fixture
def plan():
    info = model_info(load_config("qwen3-tiny"), "qwen3-tiny")
    return even_plan(info, stages=3, group_sizes=[2, 1, 1], seq_len=16, global_batch=8, num_microbatches=2)


def test_round_trip(plan, tmp_path):
    plan.save(tmp_path / "p.json")
    assert Plan.load(tmp_path / "p.json") == plan


@pytest.mark.parametrize("mutate,field", [
    (lambda d: d.update(format="torchpp.plan/9"), "format"),
    (lambda d: d.update(global_batch=7), "global_batch"),
    (lambda d: d["stages"][1].update(layers=[3, 3]), "stages[1].layers"),
    (lambda d: d["stages"][0]["devices"][0].update(samples=3), "stages[0].devices[*].samples"),
    (lambda d: d["stages"][2]["devices"][0].update(rank=0), "stages[*].devices[*].rank"),
    (lambda d: d["stages"][0].update(has_tail=True), "stages[0].has_tail"),
    (lambda d: d["stages"][0]["devices"][1].pop("host"), "stages[0].devices[1].host"),
    (lambda d: d.update(schedule="zb"), "schedule"),
    (lambda d: d["model"].update(num_layers=5), "stages[2].layers"),
])
def test_rejects_malformed(plan, tmp_path, mutate, field):
    d = plan.to_json()
    mutate(d)
    f = tmp_path / "bad.json"
    f.write_text(json.dumps(d))
    with pytest.raises(FormatError) as e:
        Plan.load(f)
    assert str(f) in str(e.value) and f"'{field}'" in str(e.value)


def test_world_size_and_model_mismatch(plan):
    with pytest.raises(FormatError, match="world size 3"):
        validate_plan(plan, "p.json", world_size=3)
    with pytest.raises(FormatError, match="model.num_layers"):
        validate_plan(plan, "p.json", model_layers=2)


def test_split_samples():
    assert split_samples(8, [1, 1, 1]) == [3, 3, 2]
    assert split_samples(5, [3, 1]) == [4, 1]
    assert split_samples(3, [100, 1, 1]) == [1, 1, 1]
    assert sum(split_samples(17, [0.3, 0.5, 0.2])) == 17


def test_plan_cli(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert main(["plan", "--strategy", "even", "--stages", "2", "--group-sizes", "2,1", "--global-batch", "8",
                 "--microbatches", "2", "--out", str(out)]) == 0
    p = Plan.load(out)
    assert [len(s.devices) for s in p.stages] == [2, 1]
    assert main(["plan", "--model", "nope", "--out", str(out)]) == 2
    assert "--model" in capsys.readouterr().err
