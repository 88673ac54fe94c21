"""Mixed precision on CPU: bf16 autocast with fp32 master weights, chosen in the plan.

The loss after 20 steps of a 2-stage pipeline on the repository's own text (a frozen copy of an
earlier README.md in tests/data/corpus.txt, byte tokens: the live README changes with every edit,
and the data with it) is within 1% of the fp32 run's; the step-time ratio is printed (run with -s).
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
import torch

from dist_harness import RankPool
from torchpp.formats import Plan
from torchpp.models.presets import load_config, model_info, precision_fields
from torchpp.planner.simple import make_plan

DATA = Path(__file__).resolve().parent / "data" / "corpus.txt"
STEPS = 20


def _plan(path: Path, dtype: str) -> Path:
    info = model_info(load_config("qwen3-tiny"), "qwen3-tiny", **precision_fields(dtype))
    make_plan(info, seq_len=64, global_batch=8, num_microbatches=4, layer_ranges=[(0, 2), (2, 4)],
              group_sizes=[1, 1], schedule="1f1b").save(path)
    return path


def _result(rank: int, world: int, case: dict) -> None:
    from torchpp.runtime.trainer import TrainConfig, train

    s = train(TrainConfig(**case["config"]))
    if rank == 0:
        Path(case["result"]).write_text(json.dumps({"losses": s.losses, "times": s.step_times_s}))


def _master_weights(rank: int, world: int, plan: str) -> None:
    from torchpp.formats import Plan
    from torchpp.models.stages import StageSpec, build_stage
    from torchpp.runtime.trainer import make_optimizer

    p = Plan.load(plan)
    stage = build_stage("qwen3-tiny", load_config("qwen3-tiny"), StageSpec.from_plan(p, 1), dtype=p.model.dtype,
                        autocast=p.model.autocast)
    opt = make_optimizer("adamw", stage.parameters(), 1e-3, 0.0)
    ids = torch.randint(0, 256, (2, 16))
    h = torch.randn(2, 16, stage.hidden_size, requires_grad=True)
    loss = stage.forward(h, ids, 30)
    loss.backward()
    opt.step()
    assert stage.autocast == torch.bfloat16 and loss.dtype == torch.float32
    assert all(q.dtype == torch.float32 and q.grad.dtype == torch.float32 for q in stage.parameters())
    assert all(t.dtype == torch.float32 for st in opt.state.values() for k, t in st.items() if k != "step")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
    root = tmp_path_factory.mktemp("bf16")
    out = {}
    with RankPool(2, threads=1) as pool:
        for dtype in ("float32", "bfloat16"):
            spec = {"result": str(root / f"{dtype}.json"), "config": dict(
                plan=_plan(root / f"plan_{dtype}.json", dtype), steps=STEPS, lr=3e-3, seed=0, data=str(DATA),
                tokenizer="bytes", data_cache=root / "cache", threads=1, timeout_s=60.0)}
            pool.run(_result, spec, world=2, timeout_s=300, pg_timeout_s=60)
            out[dtype] = json.loads(Path(spec["result"]).read_text())
        pool.run(_master_weights, str(root / "plan_bfloat16.json"), world=1, timeout_s=120, pg_timeout_s=60)
    return out


def test_bf16_loss_within_one_percent_of_fp32(runs):
    fp32, bf16 = runs["float32"]["losses"], runs["bfloat16"]["losses"]
    assert fp32[-1] < fp32[0] - 0.5  # it learned something
    assert bf16[-1] == pytest.approx(fp32[-1], rel=0.01)
    assert bf16 != fp32  # autocast really ran
    t32 = statistics.median(runs["float32"]["times"][2:])
    t16 = statistics.median(runs["bfloat16"]["times"][2:])
    print(f"\nbf16 autocast / fp32 step time: {t16 / t32:.2f} ({t16 * 1e3:.1f} ms / {t32 * 1e3:.1f} ms, "
          f"final loss {bf16[-1]:.4f} / {fp32[-1]:.4f})")


def test_plan_dtype_sets_precision(tmp_path):
    from torchpp.planner.api import PlanOptions, Strategy, fixed_plan

    mixed = fixed_plan(Strategy(model="qwen3-tiny", dtype="bfloat16"), PlanOptions(global_batch=4))
    assert (mixed.model.dtype, mixed.model.autocast, mixed.model.precision) == ("float32", "bfloat16", "bfloat16")
    plain = fixed_plan(Strategy(model="qwen3-tiny"), PlanOptions(global_batch=4))
    assert (plain.model.dtype, plain.model.autocast) == ("float32", "")
    mixed.save(tmp_path / "p.json")
    assert Plan.load(tmp_path / "p.json").model.autocast == "bfloat16"


def test_cli_plan_dtype_must_match_the_layers_files(tmp_path):
    from torchpp.cli import main as cli

    layers = tmp_path / "layers_h.json"
    assert cli(["profile", "--model", "qwen3-tiny", "--seq-len", "16", "--batch", "1", "--iters", "1",
                "--warmup", "0", "--host", "h", "--out", str(layers), "--quiet", "--dtype", "bfloat16",
                "--no-call-probe"]) == 0
    model = json.loads(layers.read_text())["model"]
    assert (model["dtype"], model["autocast"]) == ("float32", "bfloat16")
    (tmp_path / "devices.json").write_text(json.dumps({"h": 4}))
    (tmp_path / "bw.json").write_text(json.dumps({"format": "torchpp.bandwidth/1", "bytes_per_sec": {}}))
    base = ["plan", "--layers", str(layers), "--devices", str(tmp_path / "devices.json"), "--bandwidth",
            str(tmp_path / "bw.json"), "--global-batch", "2", "--out-dir", str(tmp_path / "out")]
    assert cli(base + ["--dtype", "float32"]) == 2
    assert cli(base + ["--dtype", "bfloat16"]) == 0
    plan = Plan.load(tmp_path / "out" / "plan.json")
    assert plan.model.autocast == "bfloat16"


def test_pure_bf16_plan_trains_and_says_so(tmp_path, caplog, monkeypatch):
    import logging

    from torchpp.runtime.trainer import TrainConfig, train

    caplog.set_level(logging.INFO, logger="torchpp.train")
    for k in ("MASTER_ADDR", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    info = model_info(load_config("qwen3-tiny"), "qwen3-tiny", dtype="bfloat16")
    make_plan(info, seq_len=16, global_batch=2, num_microbatches=1, layer_ranges=[(0, 4)], group_sizes=[1],
              schedule="1f1b").save(tmp_path / "plan.json")
    s = train(TrainConfig(plan=tmp_path / "plan.json", steps=1, threads=1))
    assert len(s.losses) == 1 and s.losses[0] > 0
    assert "pure bfloat16 weights and optimizer state (no fp32 master weights)" in caplog.text
