"""The tied weight kept in sync by the rows a step touches trains exactly what the dense all-reduce trains.

A 3-stage qwen3-tiny pipeline (tied embeddings, vocabulary 512, 96 tokens a step: about 90
distinct rows) runs with the plan's ``tied_sync`` ``rows`` and without it, with global-norm
clipping tight enough to clip every step, weight decay, evaluation and checkpoints: losses,
gradient norms, evaluation losses and every weight of the final checkpoint are bit-identical,
a run resumed from a checkpoint equals an uninterrupted one, and the traced sync moves a
fraction of the weight's bytes. The same holds where an end stage is a data-parallel group (the
rows then travel as broadcasts over the first and last stages' ranks, through a binomial tree
where the group has four members).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dist_harness import RankPool
from torchpp.formats import Plan, Sync
from torchpp.models.presets import build_model, load_config, model_info
from torchpp.models.stages import read_tensors
from torchpp.planner.simple import make_plan

SEQ = 16
STEPS = 4


def _result(rank: int, world: int, case: dict) -> None:
    from torchpp.runtime.trainer import TrainConfig, train

    s = train(TrainConfig(**case["config"]))
    if rank == 0:
        Path(case["result"]).write_text(json.dumps({"losses": s.losses, "grad_norms": s.grad_norms,
                                                    "eval": s.eval_losses, "start": s.start_step}))


COMMON = dict(threads=1, timeout_s=60.0, seed=7, lr=2e-3, adam_eps=1e-6, weight_decay=0.1, max_grad_norm=0.05,
              eval_every=2, eval_fraction=0.25, eval_batches=1)
"""Training settings of every run: clipping tight enough to clip every step, weight decay, evaluation."""


def _plan(path: Path, rows: bool, groups: tuple[int, ...] = (1, 1, 1)) -> Path:
    info = model_info(load_config("qwen3-tiny"), "qwen3-tiny")
    ranges = {3: [(0, 1), (1, 3), (3, 4)], 2: [(0, 2), (2, 4)]}[len(groups)]
    plan = make_plan(info, seq_len=SEQ, global_batch=6, num_microbatches=3, layer_ranges=ranges,
                     group_sizes=list(groups), schedule="1f1b")
    if rows:
        plan.tied_sync = Sync(kind="rows")
    plan.save(path)
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("tied_rows")
    dense, rows = _plan(d / "dense.json", False), _plan(d / "rows.json", True)
    cases = {
        "dense": dict(plan=dense, steps=STEPS, checkpoint_dir=d / "ck_dense", checkpoint_every=2,
                      trace_dir=d / "tr_dense", trace_steps=(2,)),
        "rows": dict(plan=rows, steps=STEPS, checkpoint_dir=d / "ck_rows", checkpoint_every=2,
                     trace_dir=d / "tr_rows", trace_steps=(2,)),
        "first": dict(plan=rows, steps=2, checkpoint_dir=d / "ck_resumed", checkpoint_every=1,
                      full_checkpoint_every=1),
        "resumed": dict(plan=rows, steps=STEPS, checkpoint_dir=d / "ck_resumed", checkpoint_every=1,
                        full_checkpoint_every=1, resume=True),
    }
    with RankPool(3, threads=1) as pool:
        for name, cfg in cases.items():
            pool.run(_result, {"result": str(d / f"{name}_result.json"), "config": {**COMMON, **cfg}}, world=3,
                     timeout_s=300, pg_timeout_s=60)
    return d


GROUPED = {"first_group": (2, 1, 1), "both_groups": (2, 2)}
"""End stages as data-parallel groups: the first stage of two devices (tied group of three ranks), and
two stages of two devices each (a tied group of four: the broadcasts forward through a member)."""


@pytest.fixture(scope="module")
def grouped(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("tied_rows_groups")
    common = dict(COMMON, steps=STEPS, checkpoint_every=STEPS, trace_steps=(2,))
    with RankPool(4, threads=1) as pool:
        for layout, groups in GROUPED.items():
            for sync in ("dense", "rows"):
                name = f"{layout}_{sync}"
                plan = _plan(d / f"{name}.json", sync == "rows", groups)
                cfg = {**common, "plan": plan, "checkpoint_dir": d / f"ck_{name}", "trace_dir": d / f"tr_{name}"}
                pool.run(_result, {"result": str(d / f"{name}_result.json"), "config": cfg}, world=4,
                         timeout_s=300, pg_timeout_s=60)
    return d


@pytest.mark.parametrize("layout", list(GROUPED))
def test_rows_sync_with_data_parallel_end_stages_equals_the_dense_all_reduce(grouped, layout):
    dense, rows = _get(grouped, f"{layout}_dense"), _get(grouped, f"{layout}_rows")
    assert rows["losses"] == dense["losses"] and len(rows["losses"]) == STEPS
    assert rows["grad_norms"] == dense["grad_norms"] and all(n > 0.05 for n in dense["grad_norms"])
    assert rows["eval"] == dense["eval"] and len(rows["eval"]) == 2
    names = [n for n, _ in build_model("qwen3-tiny", seed=7).named_parameters()]
    step = f"step_{STEPS:08d}"
    got = read_tensors(grouped / f"ck_{layout}_rows" / step, names)
    want = read_tensors(grouped / f"ck_{layout}_dense" / step, names)
    for n in names:
        assert torch.equal(got[n], want[n]), n
    plan = Plan.load(grouped / f"{layout}_rows.json")
    tied = set(plan.stages[0].ranks) | set(plan.stages[-1].ranks)
    moved = _tied_bytes(grouped / f"tr_{layout}_rows")
    assert len(moved) == len(tied) and len(set(moved)) == 1  # every member of the tied group, the same rows
    assert moved[0] < 512 * 64 * 4 / 2


def _get(d: Path, name: str) -> dict:
    return json.loads((d / f"{name}_result.json").read_text())


def test_rows_sync_equals_the_dense_all_reduce_bit_for_bit(runs):
    dense, rows = _get(runs, "dense"), _get(runs, "rows")
    assert rows["losses"] == dense["losses"] and len(rows["losses"]) == STEPS
    assert rows["grad_norms"] == dense["grad_norms"]
    assert all(n > 0.05 for n in dense["grad_norms"])  # every step clipped: the norm mattered
    assert rows["eval"] == dense["eval"] and len(rows["eval"]) == 2
    names = [n for n, _ in build_model("qwen3-tiny", seed=7).named_parameters()]
    step = f"step_{STEPS:08d}"
    got, want = read_tensors(runs / "ck_rows" / step, names), read_tensors(runs / "ck_dense" / step, names)
    init = dict(build_model("qwen3-tiny", seed=7).named_parameters())
    emb = "model.embed_tokens.weight"
    assert (want[emb] != init[emb].detach()).any(dim=1).all()  # every row moved: the first stage's copy is whole
    for n in names:
        assert torch.equal(got[n], want[n]), n


def test_resumed_rows_run_equals_an_uninterrupted_one(runs):
    resumed = _get(runs, "resumed")
    assert resumed["start"] == 2
    assert resumed["losses"] == _get(runs, "rows")["losses"][2:]


def _tied_bytes(trace_dir: Path) -> list[int]:
    out = []
    for f in sorted(trace_dir.rglob("*.json")):
        if "_all" not in f.name:
            out += [e["args"]["bytes"] for e in json.loads(f.read_text()).get("traceEvents", [])
                    if e.get("name") == "allreduce" and e.get("ph") == "X" and e["args"].get("tied")]
    return out


def test_gradient_logs_are_refused_with_rows(tmp_path):
    from torchpp.runtime.trainer import TrainConfig, prepare

    cfg = TrainConfig(plan=_plan(tmp_path / "rows.json", True), steps=2, checkpoint_dir=tmp_path / "ck",
                      checkpoint_every=1)
    with pytest.raises(ValueError, match="--full-checkpoint-every: expected 1"):
        prepare(cfg, 3)


def test_rows_sync_moves_only_the_touched_rows(runs):
    plan = Plan.load(runs / "rows.json")
    dense, rows = _tied_bytes(runs / "tr_dense"), _tied_bytes(runs / "tr_rows")
    weight = 512 * 64 * 4
    assert dense == [weight, weight]
    assert len(rows) == 2 and rows[0] == rows[1] and rows[0] % (2 * 64 * 4) == 0
    touched = rows[0] // (2 * 64 * 4)  # rows up (the gradient's) and down (the step's weights)
    assert 1 < touched <= min(512, plan.global_batch * plan.seq_len)
    assert rows[0] < weight / 2
