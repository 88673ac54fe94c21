"""Wire formats priced by the one cost model and chosen by the planner only where allowed and paying."""
import json

import pytest

from torchpp.cli import main
from torchpp.cost import Links
from torchpp.formats import LayersFile, Plan, Sync
from torchpp.planner import api
from torchpp.planner.synthetic import layers_file, uniform_links
from torchpp.planner.wire import choose, parse_allow


def test_wire_time_prices_bytes_on_the_wire_plus_codec_cpu():
    links = Links(uniform_links(["a", "b"], 1e6, latency_s=0.01))
    assert links.wire_time("a", "b", 4e6) == pytest.approx(4.01) == links.time("a", "b", 4e6)
    assert links.wire_time("a", "b", 4e6, "bf16") == pytest.approx(2.01)
    assert links.wire_time("a", "b", 4e6, "bf16", codec=(1e-9, 2e-9)) == pytest.approx(2.01 + 4e6 * 3e-9)
    # int8: one byte per value plus a 4-byte scale per row of 64
    assert links.wire_time("a", "b", 4 * 64 * 1000, "int8", row=64) == pytest.approx(0.01 + 68 * 1000 / 1e6)


def test_layers_file_codec_field_round_trips_and_is_checked(tmp_path):
    lf = layers_file("h", num_layers=2)
    assert "codec_s_per_byte" not in lf.to_json()  # absent stays absent
    lf.codec_s_per_byte = {"bf16": [1e-10, 2e-10], "int8": [5e-10, 3e-10]}
    lf.save(tmp_path / "l.json")
    assert LayersFile.load(tmp_path / "l.json").codec_s_per_byte == lf.codec_s_per_byte
    d = lf.to_json()
    d["codec_s_per_byte"] = {"int4": [0, 0]}
    (tmp_path / "bad.json").write_text(json.dumps(d))
    with pytest.raises(ValueError, match="codec_s_per_byte.int4"):
        LayersFile.load(tmp_path / "bad.json")


def _setup(tmp_path, rate: float):
    for h in ("h1", "h2"):
        lf = layers_file(h, num_layers=4, batch=4, layer_fwd_s=0.2, act_bytes_per_sample=400_000,
                         layer_param_bytes=50_000_000, hidden_size=1000)
        lf.codec_s_per_byte = {"bf16": [1e-10, 1e-10], "fp16": [1e-10, 1e-10], "int8": [4e-10, 2e-10]}
        lf.save(tmp_path / f"layers_{h}.json")
    uniform_links(["h1", "h2"], rate).save(tmp_path / "bandwidth.json")
    (tmp_path / "devices.json").write_text(json.dumps({"h1": 8, "h2": 8}))
    return api.PlanInputs(layers=[tmp_path / "layers_h1.json", tmp_path / "layers_h2.json"],
                          bandwidth=tmp_path / "bandwidth.json", devices=tmp_path / "devices.json")


def test_planner_compresses_slow_links_only_when_allowed(tmp_path):
    inputs = _setup(tmp_path, 1.25e6)  # 10 Mbit/s
    plain = api.plan(inputs, api.PlanOptions(global_batch=8, schedule="1f1b"))
    assert plain.plan.lossy == [] and "wire" not in plain.plan.predicted
    lossy = api.plan(inputs, api.PlanOptions(global_batch=8, schedule="1f1b", allow_lossy=parse_allow("bf16,int8")))
    assert plain.plan.num_stages == 2 == lossy.plan.num_stages
    assert lossy.plan.stages[0].wire == "int8"
    pred = lossy.plan.predicted
    assert pred["step_time_s"] < 0.8 * plain.plan.predicted["step_time_s"]
    assert pred["wire"]["fp32_step_time_s"] == pytest.approx(plain.plan.predicted["step_time_s"])
    assert pred["wire"]["lossy"] == ["stages[0].wire=int8"]
    only_bf16 = api.plan(inputs, api.PlanOptions(global_batch=8, schedule="1f1b", allow_lossy=parse_allow("bf16")))
    assert only_bf16.plan.stages[0].wire == "bf16"


def test_planner_keeps_fp32_on_gigabit_links(tmp_path):
    inputs = _setup(tmp_path, 1.25e8)  # 1 Gbit/s: the transfers hide behind compute
    lossy = api.plan(inputs, api.PlanOptions(global_batch=8, schedule="1f1b",
                                             allow_lossy=parse_allow("bf16,int8,diloco")))
    assert lossy.plan.lossy == []


def test_diloco_period_is_chosen_for_a_slow_data_parallel_group(tmp_path):
    inputs = _setup(tmp_path, 1.25e6)
    costs = api.load(inputs)
    dp = api.plan(inputs, api.PlanOptions(global_batch=8, schedule="1f1b")).plan
    from torchpp.planner.simple import make_plan

    p = make_plan(dp.model, seq_len=dp.seq_len, global_batch=8, num_microbatches=2, layer_ranges=[(0, 4)],
                  group_sizes=[2], schedule="1f1b", hosts=["h1", "h2"])
    fp32 = api.predict_plan(p, costs)["step_time_s"]
    got = choose(p, lambda q: api.predict_plan(q, costs)["step_time_s"], parse_allow("diloco,int8"))
    s = got.plan.stages[0].sync
    assert s is not None and s.kind == "diloco" and s.wire == "int8" and s.H > 1
    assert got.step_s < fp32 / 5 and got.fp32_step_s == pytest.approx(fp32)
    assert p.stages[0].sync is None  # the given plan is left as it was
    # the all-reduce is priced at the outer all-reduce's bytes spread over H
    p.stages[0].sync = Sync(kind="diloco", H=4)
    ar = [api.predict_plan(p, costs)["stages"][0]["allreduce_s"]]
    p.stages[0].sync = Sync(kind="diloco", H=8)
    ar.append(api.predict_plan(p, costs)["stages"][0]["allreduce_s"])
    assert ar[1] == pytest.approx(ar[0] / 2, rel=0.01)


def test_allow_lossy_is_checked(tmp_path, capsys):
    with pytest.raises(ValueError, match="--allow-lossy"):
        parse_allow("bf16,int3")
    inputs = _setup(tmp_path, 1.25e6)
    rc = main(["plan", "--layers", str(inputs.layers[0]), str(inputs.layers[1]), "--bandwidth", str(inputs.bandwidth),
               "--devices", str(inputs.devices), "--allow-lossy", "bf16,int3", "--out-dir", str(tmp_path / "o")])
    assert rc == 2 and "--allow-lossy" in capsys.readouterr().err


def _tied_plan(groups):
    from torchpp.models.presets import load_config, model_info
    from torchpp.planner.simple import make_plan

    info = model_info(load_config("qwen3-tiny"), "qwen3-tiny")
    return make_plan(info, seq_len=16, global_batch=4 * max(groups), num_microbatches=2,
                     layer_ranges=[(0, 2), (2, 4)], group_sizes=groups, schedule="1f1b")


def _tied_price(p: Plan) -> float:
    """A stand-in cost: 4 s of tied all-reduce in fp32, its bytes' share in int8, half in bf16."""
    s = p.tied_sync
    return 1.0 + (4.0 if s is None else 2.0 if s.wire == "bf16" else 1.05 if s.wire == "int8" else 3.0)


def test_tied_allreduce_takes_int8_only_where_allowed_and_between_two():
    got = choose(_tied_plan([1, 1]), _tied_price, parse_allow("bf16,int8"))
    assert got.plan.tied_sync == Sync(kind="allreduce", wire="int8") and got.step_s == pytest.approx(2.05)
    assert choose(_tied_plan([1, 1]), _tied_price, parse_allow("bf16")).plan.tied_sync.wire == "bf16"
    # four members: an all-gather of int8 sends more than a ring of bf16, so int8 is not offered; the
    # exact rows are (priced 3 s here), as for two members, where int8 priced lower took it
    got = choose(_tied_plan([2, 2]), _tied_price, parse_allow("int8"))
    assert got.plan.tied_sync.kind == "rows" and got.step_s == pytest.approx(4.0)


def test_int8_allreduce_is_priced_with_its_bytes_and_codec_cpu(tmp_path):
    from torchpp.cost.actions import MeasuredCost
    from torchpp.plans import make_plan
    from torchpp.schedules import Action, Kind

    inputs = _setup(tmp_path, 1.25e6)
    costs = api.load(inputs)
    model = LayersFile.load(inputs.layers[0]).model
    dp = make_plan(model, seq_len=16, global_batch=8, num_microbatches=1, layer_ranges=[(0, 4)], group_sizes=[2],
                   hosts=["h1", "h2"])
    ar = Action(kind=Kind.ALLREDUCE, stage=0, group=(0, 1))
    fp32 = MeasuredCost(dp, costs.profiles, costs.links).allreduce_s(ar)
    dp.stages[0].sync = Sync(kind="allreduce", wire="int8")
    int8 = MeasuredCost(dp, costs.profiles, costs.links).allreduce_s(ar)
    weights = 4 * 50_000_000  # four layers of 50 MB
    wire = costs.links.ring_allreduce(["h1", "h2"], weights * 260 / 1024)  # codes and a scale per 256
    assert int8 == pytest.approx(wire + weights * (4e-10 + 2 * 2e-10), rel=1e-3)  # encode once, decode both
    assert int8 < fp32 / 3


def test_powersgd_is_held_to_the_margin_of_a_change_to_the_optimisation():
    """PowerSGD's low-rank gradient changes the optimisation as DiLoCo does: taken where it shortens the
    predicted step by 20%, not the 3% a rounding needs (bf16 at 10% is taken where allowed)."""
    def price(gain: float):
        return lambda p: 1.0 + 4.0 * (1 - gain if p.tied_sync is not None and p.tied_sync.kind != "rows" else 1.0)

    plan = _tied_plan([1, 1])
    assert choose(plan, price(0.1), parse_allow("powersgd")).plan.tied_sync is None  # 8% of the step
    got = choose(plan, price(0.3), parse_allow("powersgd"))  # 24% of the step
    assert got.plan.tied_sync is not None and got.plan.tied_sync.kind == "powersgd"
    assert choose(plan, price(0.1), parse_allow("bf16")).plan.tied_sync.wire == "bf16"


def test_powersgd_for_a_group_under_adamw_up_to_four_members_else_a_note():
    """A group's whole gradient in rank-4 PowerSGD ended 15% above fp32's loss under AdamW: the pass offers
    it at hidden x (members - 1) / 16 (qwen3-tiny's hidden 64: rank 4 for a pair, 8 for three, 12 for four)
    and not to a group of five, and says so; bf16 is still taken there, and the tied weight's PowerSGD as
    before."""
    def price(p: Plan) -> float:  # the group's all-reduce: 4 s in fp32, 0.4 s in PowerSGD, 2 s in bf16
        s = p.stages[0].sync
        return 1.0 + (4.0 if s is None else 0.4 if s.kind == "powersgd" else 2.0)

    refused = "powersgd is not offered to {} ({} ranks) under adamw: measured to train within 2% of fp32 in groups " \
              "of at most 4 (docs/links.md)"
    got = choose(_tied_plan([2, 1]), price, parse_allow("powersgd"))
    assert got.plan.stages[0].sync == Sync(kind="powersgd", rank=4) and got.notes == []
    got = choose(_tied_plan([3, 1]), price, parse_allow("powersgd"))
    assert got.plan.stages[0].sync == Sync(kind="powersgd", rank=8) and got.notes == []
    got = choose(_tied_plan([4, 1]), price, parse_allow("powersgd"))  # the tied weight's all-reduce: 5 ranks
    assert got.plan.stages[0].sync == Sync(kind="powersgd", rank=12)
    assert got.notes == [refused.format("the tied weight", 5)]
    plan = _tied_plan([5, 1])
    got = choose(plan, price, parse_allow("powersgd"))
    assert got.plan.stages[0].sync is None and got.step_s == pytest.approx(5.0) and not got.decisions
    assert got.notes == [refused.format("stages[0]'s group", 5), refused.format("the tied weight", 6)]
    assert choose(plan, price, parse_allow("powersgd"), optimizer="sgd").plan.stages[0].sync.kind == "powersgd"
    got = choose(plan, price, parse_allow("bf16,powersgd"))
    assert got.plan.stages[0].sync == Sync(kind="allreduce", wire="bf16")
    assert choose(plan, price, parse_allow("bf16")).notes == []
    tied = lambda p: 1.0 + {None: 4.0, "rows": 3.9, "powersgd": 1.0}[p.tied_sync and p.tied_sync.kind]  # noqa: E731
    got = choose(_tied_plan([1, 1]), tied, parse_allow("powersgd"))
    assert got.plan.tied_sync is not None and got.plan.tied_sync.kind == "powersgd" and got.notes == []
