"""Evaluation is the executor running the forward-only lists: every schedule kind evaluates, and
its loss equals plain HF's on the same batch; a failing action is logged with the schedule grid."""
from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from torchpp.data import SyntheticTokens
from torchpp.models.presets import build_model, load_config, model_info
from torchpp.plans import make_chunked_plan
from torchpp.schedules import Kind, build, build_forward, validate

MODEL = "qwen3-tiny"
SEQ = 16
SEED = 7

# schedule, layer ranges of the chunks, group sizes, samples per micro-batch, micro-batches, shares
CASES = {
    "1f1b": ("1f1b", [(0, 2), (2, 4)], [1, 2], 3, 2, [[1.0], [1.0, 2.0]]),
    "gpipe": ("gpipe", [(0, 1), (1, 4)], [2, 1], 2, 3, None),
    "zb-h1": ("zb-h1", [(0, 1), (1, 4)], [1, 2], 3, 3, [[1.0], [1.0, 2.0]]),
    "interleaved": ("interleaved", [(0, 2), (2, 3), (3, 4), (4, 4)], [2, 1], 3, 2, [[2.0, 1.0], [1.0]]),
    "interleaved-zb": ("interleaved-zb", [(0, 1), (1, 3), (3, 4), (4, 4)], [2, 1], 2, 4, None),
    "v": ("v", [(0, 1), (1, 2), (2, 4), (4, 4)], [2, 1], 2, 4, None),
    "zbv": ("zbv", [(0, 0), (0, 1), (1, 3), (3, 4)], [1, 2], 2, 4, None),
}


def _plan(name: str):
    schedule, layers, groups, mbs, m, shares = CASES[name]
    return make_chunked_plan(model_info(load_config(MODEL), MODEL), seq_len=SEQ, global_batch=mbs * m,
                             num_microbatches=m, layer_ranges=layers, schedule=schedule, group_sizes=groups,
                             shares=shares)


@pytest.mark.parametrize("name", list(CASES))
def test_forward_lists_are_the_training_forwards(name):
    """The forward-only lists are valid and keep each rank's forwards and activation messages in
    their training order."""
    plan = _plan(name)
    train, fwd = build(plan), build_forward(plan)
    validate(fwd)
    kinds = (Kind.FORWARD, Kind.SEND_ACT, Kind.RECV_ACT)
    assert fwd == {r: [a for a in acts if a.kind in kinds] for r, acts in train.items()}


def _eval_loss(rank: int, world: int, name: str) -> float:
    """One rank's part: build its chunks as the trainer does, evaluate one batch twice."""
    from torchpp.models.stages import StageSpec, build_stages
    from torchpp.runtime.comm import Comm
    from torchpp.runtime.evaluate import Evaluator

    plan = _plan(name)
    chunks = [c.index for c in plan.stages_of_rank(rank)]
    stage = build_stages(MODEL, load_config(MODEL), {c: StageSpec.from_plan(plan, c) for c in chunks}, seed=SEED)
    ids = SyntheticTokens(vocab_size=plan.model.vocab_size, seq_len=SEQ, global_batch=plan.global_batch,
                          seed=SEED).batch(0)
    ev = Evaluator(rank=rank, plan=plan, stage=stage, comm=Comm(rank, 60.0, boundaries=plan.num_stages - 1,
                                                                 samples=plan.micro_batch_size))
    first, again = ev.loss(ids), ev.loss(ids)
    assert all(st.module.training for st in stage.chunks.values())  # dropout back on for training
    return first if abs(first - again) < 1e-6 else float("nan")  # a second evaluation: nothing left over


@pytest.fixture(scope="module")
def eval_losses() -> dict[str, list[float]]:
    from dist_harness import RankPool

    with RankPool(3, threads=1) as pool:
        return {name: pool.run(_eval_loss, name, world=sum(CASES[name][2]), timeout_s=300) for name in CASES}


@pytest.mark.parametrize("name", list(CASES))
def test_eval_loss_equals_hf_with_every_schedule(eval_losses, name):
    plan = _plan(name)
    ids = SyntheticTokens(vocab_size=plan.model.vocab_size, seq_len=SEQ, global_batch=plan.global_batch,
                          seed=SEED).batch(0)
    model = build_model(MODEL, seed=SEED).eval()
    with torch.no_grad():
        want = model(input_ids=ids, labels=ids).loss.item()
    assert eval_losses[name] == pytest.approx([want] * len(eval_losses[name]), abs=1e-5)


def test_a_failing_action_is_logged_with_rank_step_and_grid(caplog):
    """A stage that raises inside the executor's loop: the log names rank, step, the action and
    shows the schedule grid with the action marked."""
    from torchpp.models.stages import StageSpec, build_stages
    from torchpp.runtime.executor import Executor, describe_failure, failed_action

    plan = make_chunked_plan(model_info(load_config(MODEL), MODEL), seq_len=SEQ, global_batch=2,
                             num_microbatches=2, layer_ranges=[(0, 4)], schedule="1f1b", group_sizes=[1])
    sched = build(plan)
    stage = build_stages(MODEL, load_config(MODEL), {0: StageSpec.from_plan(plan, 0)}, seed=SEED)
    ex = Executor(rank=0, plan=plan, actions=sched[0], stage=stage, comm=SimpleNamespace(stamp=False), optimizer=None)
    calls = []

    def broken(x, labels, n_tokens):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("boom")
        return real(x, labels, n_tokens)

    real, stage.chunks[0].forward = stage.chunks[0].forward, broken
    ids = SyntheticTokens(vocab_size=plan.model.vocab_size, seq_len=SEQ, global_batch=2, seed=SEED).batch(0)
    with pytest.raises(RuntimeError, match="boom") as e:
        ex.step(ids, 2 * (SEQ - 1))
    i, act = failed_action(e.value)
    assert (act.kind, act.microbatch) == (Kind.FORWARD, 1) and sched[0][i] == act
    text = describe_failure(0, 3, e.value, sched)
    assert text.startswith(f"rank 0 step 3: action {i} ({act}) failed: RuntimeError: boom")
    assert f"*{act}" in text and "rank   0:" in text
    assert failed_action(ValueError("elsewhere")) is None
    logging.getLogger("torchpp.runtime").error(text)
    assert "boom" in caplog.text


def test_labels_reach_torch_profiler():
    """With labels on, a torch.profiler trace of a step carries each action's printable name."""
    from torch.profiler import profile

    from torchpp.models.stages import StageSpec, build_stages
    from torchpp.runtime.executor import Executor

    plan = make_chunked_plan(model_info(load_config(MODEL), MODEL), seq_len=SEQ, global_batch=2,
                             num_microbatches=2, layer_ranges=[(0, 4)], schedule="1f1b", group_sizes=[1])
    sched = build(plan)
    stage = build_stages(MODEL, load_config(MODEL), {0: StageSpec.from_plan(plan, 0)}, seed=SEED)
    opt = torch.optim.SGD(stage.parameters(), lr=0.0)
    ex = Executor(rank=0, plan=plan, actions=sched[0], stage=stage, comm=SimpleNamespace(stamp=False), optimizer=opt)
    ids = SyntheticTokens(vocab_size=plan.model.vocab_size, seq_len=SEQ, global_batch=2, seed=SEED).batch(0)
    bare = ex.step(ids, 2 * (SEQ - 1)).loss
    ex.label_actions()
    with profile() as prof:
        labelled = ex.step(ids, 2 * (SEQ - 1)).loss
    names = {e.name for e in prof.events()}
    assert {str(a) for a in sched[0]} <= names
    assert labelled == pytest.approx(bare, abs=1e-6)
