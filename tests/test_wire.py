"""Wire formats: codec round trips, error feedback, and the plan fields that choose them."""
import json

import pytest
import torch

from torchpp import wire
from torchpp.formats import FormatError, Plan, Sync, wire_bytes
from torchpp.models.presets import load_config, model_info
from torchpp.planner.simple import even_plan


def test_fp32_is_the_tensor_itself():
    x = torch.randn(3, 5)
    assert wire.encode("fp32", x) is x
    assert torch.equal(wire.round_trip("fp32", x), x)


@pytest.mark.parametrize("fmt,dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_half_formats_exact_on_representable_values(fmt, dtype):
    x = torch.randn(4, 7, 16).to(dtype).float()  # every value representable in the format
    msg = wire.encode(fmt, x)
    assert msg.numel() * msg.element_size() == wire_bytes(fmt, x.numel(), 16) == x.numel() * 2
    assert torch.equal(wire.round_trip(fmt, x), x)
    y = torch.randn(4, 16)
    assert not torch.equal(wire.round_trip(fmt, y), y)  # and lossy elsewhere


def test_int8_error_bounded_by_half_a_row_scale():
    torch.manual_seed(0)
    x = torch.randn(2, 9, 32) * torch.logspace(-3, 3, 9).reshape(1, 9, 1)  # rows of very different scale
    msg = wire.encode("int8", x)
    assert msg.numel() == wire_bytes("int8", x.numel(), 32) == x.numel() + 4 * 18
    assert msg.numel() == wire.encoded_numel("int8", tuple(x.shape))
    y = wire.round_trip("int8", x)
    scale = x.abs().amax(dim=-1, keepdim=True) / 127
    assert ((y - x).abs() <= scale / 2 * (1 + 1e-5)).all()
    assert torch.equal(wire.round_trip("int8", torch.zeros(3, 4)), torch.zeros(3, 4))


def test_error_feedback_carries_the_residual():
    torch.manual_seed(1)
    ef = wire.ErrorFeedback("int8")
    xs = [torch.randn(6, 8) for _ in range(5)]
    got = [wire.decode("int8", ef.encode("link", x), (6, 8), torch.float32) for x in xs]
    # what arrived plus what is still owed equals exactly what was sent, summed over micro-batches
    assert torch.allclose(sum(got) + ef.residual["link"], sum(xs), atol=1e-5)
    # the second message carries the first one's error
    r0 = xs[0] - wire.round_trip("int8", xs[0])
    assert torch.equal(got[1], wire.round_trip("int8", xs[1] + r0))
    # without feedback the sum drifts by every message's error
    plain = sum(wire.round_trip("int8", x) for x in xs)
    assert (plain - sum(xs)).abs().sum() > (sum(got) - sum(xs)).abs().sum()


def test_codec_cost_is_measured():
    c = wire.measure_codec("int8", (64, 64), iters=3)
    assert c.encode_s_per_byte >= 0 and c.decode_s_per_byte >= 0


@pytest.fixture
def plan():
    info = model_info(load_config("qwen3-tiny"), "qwen3-tiny")
    return even_plan(info, stages=3, group_sizes=[2, 2, 1], seq_len=16, global_batch=8, num_microbatches=2)


def test_plan_without_wire_fields_is_unchanged(plan, tmp_path):
    d = plan.to_json()
    assert "wire" not in json.dumps(d) and "sync" not in json.dumps(d)
    assert plan.lossy == []


def test_plan_wire_fields_round_trip(plan, tmp_path):
    plan.stages[0].wire, plan.stages[1].wire = "int8", "bf16"
    plan.stages[1].sync = Sync(kind="diloco", H=8, outer_lr=0.7, wire="bf16")
    plan.save(tmp_path / "p.json")
    back = Plan.load(tmp_path / "p.json")
    assert back == plan
    assert json.loads((tmp_path / "p.json").read_text())["stages"][1]["sync"] == {
        "kind": "diloco", "wire": "bf16", "H": 8, "outer_lr": 0.7, "outer_momentum": 0.9}
    assert back.lossy == ["stages[0].wire=int8", "stages[1].wire=bf16", "stages[1].sync=diloco/bf16"]


@pytest.mark.parametrize("mutate,field", [
    (lambda d: d["stages"][0].update(wire="int4"), "stages[0].wire"),
    (lambda d: d["stages"][2].update(wire="bf16"), "stages[2].wire"),
    (lambda d: d["stages"][2].update(sync={"kind": "allreduce", "wire": "bf16"}), "stages[2].sync"),
    (lambda d: d["stages"][1].update(sync={"kind": "diloco", "H": 0}), "stages[1].sync.H"),
    (lambda d: d["stages"][0].update(sync={"kind": "diloco", "H": 4}), "stages[0].sync.kind"),
    (lambda d: d.update(tied_sync={"kind": "diloco"}), "tied_sync.kind"),
    (lambda d: d["stages"][0].update(sync={"kind": "powersgd", "wire": "int8"}), "stages[0].sync.wire"),
    (lambda d: d["stages"][0].update(sync={"kind": "gossip"}), "stages[0].sync.kind"),
])
def test_plan_wire_fields_rejected(plan, tmp_path, mutate, field):
    d = plan.to_json()
    mutate(d)
    f = tmp_path / "bad.json"
    f.write_text(json.dumps(d))
    with pytest.raises(FormatError) as e:
        Plan.load(f)
    assert str(f) in str(e.value) and f"'{field}'" in str(e.value), str(e.value)
