"""Clipping, LR schedules with warm-up, Adam betas and evaluation loss train what HF trains.

Each case is a 2-stage pipeline with a data-parallel group, trained with global-norm clipping
(tight enough to clip every step), a warm-up schedule, AdamW betas and weight decay; losses,
gradient norms, evaluation losses and every weight must equal plain HF training with
``clip_grad_norm_`` and HF's own scheduler on the whole batch.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from dist_harness import run_cases
from torchpp.data import SyntheticTokens, held_out
from torchpp.models.presets import build_model, load_config, model_info
from torchpp.models.stages import read_tensors
from torchpp.planner.simple import make_plan
from torchpp.runtime.optim import OptimSettings, lr_lambda

SEQ = 16
STEPS = 4
SEED = 7


@dataclass(frozen=True)
class Case:
    model: str
    layers: list[tuple[int, int]]
    groups: list[int]
    shares: list[list[float]]
    schedule: str
    warmup: int
    max_norm: float = 0.5
    betas: tuple[float, float] = (0.8, 0.95)
    weight_decay: float = 0.1
    lr: float = 2e-3
    mbs: int = 3
    m: int = 2


CASES = {
    # tied embeddings: the last stage's copy of the tied weight must be counted once in the norm
    "qwen3_pp2_dp12_cosine": Case("qwen3-tiny", [(0, 2), (2, 4)], [1, 2], [[1.0], [1.0, 2.0]], "cosine", 2),
    "llama_pp2_dp21_linear": Case("llama-tiny", [(0, 1), (1, 4)], [2, 1], [[2.0, 1.0], [1.0]], "linear", 1),
}


def _plan(case: Case, path: Path) -> Path:
    info = model_info(load_config(case.model), case.model)
    plan = make_plan(info, seq_len=SEQ, global_batch=case.mbs * case.m, num_microbatches=case.m,
                     layer_ranges=case.layers, group_sizes=case.groups, schedule="1f1b", shares=case.shares)
    plan.save(path)
    return path


def _result(rank: int, world: int, case: dict) -> None:
    from torchpp.runtime.trainer import TrainConfig, train

    s = train(TrainConfig(**case["config"]))
    if rank == 0:
        Path(case["result"]).write_text(json.dumps({"losses": s.losses, "grad_norms": s.grad_norms,
                                                    "eval": s.eval_losses}))


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("essentials")
    specs, dirs = [], {}
    for name, case in CASES.items():
        d = dirs[name] = root / name
        d.mkdir()
        specs.append({"world_size": sum(case.groups), "result": str(d / "result.json"), "config": dict(
            plan=_plan(case, d / "plan.json"), steps=STEPS, lr=case.lr, seed=SEED, adam_eps=1e-6,
            adam_betas=case.betas, weight_decay=case.weight_decay, max_grad_norm=case.max_norm,
            lr_schedule=case.schedule, warmup_steps=case.warmup, eval_every=2, eval_fraction=0.25, eval_batches=2,
            threads=1, checkpoint_dir=d / "ckpt", timeout_s=60.0, log_dir=d / "logs")})
    from dist_harness import RankPool  # the pool runs our own case function (it returns grad norms too)

    with RankPool(3, threads=1) as pool:
        for spec in specs:
            pool.run(_result, spec, world=spec["world_size"], timeout_s=300, pg_timeout_s=60)
    return dirs


def reference(case: Case):
    """Plain HF training: clip_grad_norm_, AdamW, HF's scheduler; eval loss in eval mode."""
    import transformers

    torch.manual_seed(0)
    model = build_model(case.model, seed=SEED)
    opt = torch.optim.AdamW(model.parameters(), lr=case.lr, betas=case.betas, eps=1e-6,
                            weight_decay=case.weight_decay)
    make = {"cosine": transformers.get_cosine_schedule_with_warmup,
            "linear": transformers.get_linear_schedule_with_warmup}[case.schedule]
    sched = make(opt, case.warmup, STEPS)
    data = SyntheticTokens(vocab_size=model.config.vocab_size, seq_len=SEQ, global_batch=case.mbs * case.m, seed=SEED)
    _, eval_data = held_out(data, 0.25)
    losses, norms, evals = [], [], []
    for step in range(1, STEPS + 1):
        ids = data.batch(step - 1)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), case.max_norm)))
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(loss.item())
        if step % 2 == 0:
            model.eval()
            with torch.no_grad():
                ev = [model(input_ids=eval_data.batch(i), labels=eval_data.batch(i)).loss.item() for i in range(2)]
            model.train()
            evals.append([step, sum(ev) / 2])
    return model, losses, norms, evals


@pytest.mark.parametrize("name", list(CASES))
def test_clipped_scheduled_training_equals_hf(runs, name):
    case = CASES[name]
    ref, losses, norms, evals = reference(case)
    got = json.loads((runs[name] / "result.json").read_text())
    assert got["losses"] == pytest.approx(losses, abs=1e-5)
    assert got["grad_norms"] == pytest.approx(norms, rel=1e-5)
    assert min(norms) > case.max_norm  # every step was clipped
    assert [s for s, _ in got["eval"]] == [2, 4]
    assert [v for _, v in got["eval"]] == pytest.approx([v for _, v in evals], abs=1e-5)
    step_dir = runs[name] / "ckpt" / f"step_{STEPS:08d}"
    names = [n for n, _ in ref.named_parameters()]
    tensors = read_tensors(step_dir, names)
    worst = max((float((tensors[n] - p.detach()).abs().max()), n) for n, p in ref.named_parameters())
    assert worst[0] < 1e-5, f"largest difference {worst[0]:.3g} in {worst[1]}"


def test_learning_rate_grad_norm_and_eval_loss_are_logged(runs):
    case = CASES["qwen3_pp2_dp12_cosine"]
    records = [json.loads(line) for line in (runs["qwen3_pp2_dp12_cosine"] / "logs" / "metrics.jsonl").open()]
    steps = [r for r in records if "step" in r]
    factor = lr_lambda(OptimSettings(schedule="cosine", warmup_steps=case.warmup, total_steps=STEPS))
    assert [r["lr"] for r in steps] == pytest.approx([case.lr * factor(k) for k in range(STEPS)])
    assert steps[0]["lr"] == 0.0 and all(r["grad_norm"] > 0 for r in steps)
    assert [("eval_loss" in r) for r in steps] == [False, True, False, True]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(runs["qwen3_pp2_dp12_cosine"] / "logs"))
    acc.Reload()
    assert {"train/learning_rate", "train/grad_norm", "eval/loss"} <= set(acc.Tags()["scalars"])


def test_options_are_checked():
    from torchpp.runtime.trainer import TrainConfig

    for bad, word in ((dict(lr_schedule="step"), "--lr-schedule"), (dict(max_grad_norm=-1.0), "--max-grad-norm"),
                      (dict(warmup_steps=-1), "--warmup-steps"), (dict(adam_betas=(0.9, 1.0)), "--adam-betas"),
                      (dict(eval_every=2), "--eval-every"), (dict(eval_fraction=0.1, eval_data="x"), "--eval-data")):
        with pytest.raises(ValueError, match=word):
            TrainConfig(plan=Path("plan.json"), **bad)


def test_schedule_resumes_on_the_same_curve():
    from torchpp.runtime.optim import make_scheduler

    settings = OptimSettings(schedule="cosine", warmup_steps=3, total_steps=10)
    factor = lr_lambda(settings)
    for done in (0, 2, 5):
        opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
        make_scheduler(opt, settings, done_steps=done)
        assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * factor(done))


def test_held_out_split_of_text(tmp_path):
    from torchpp.data import DataError, prepare_corpus, TokenCorpus

    (tmp_path / "a.jsonl").write_text("".join('{"text": "%s"}\n' % ("abcdefgh" * (1 + i % 3)) for i in range(40)))
    prepare_corpus([tmp_path / "a.jsonl"], tmp_path / "c", tokenizer="bytes", num_proc=1)
    src = TokenCorpus(tmp_path / "c", seq_len=8, global_batch=2)
    train, held = held_out(src, 0.25)
    assert 0 < len(held) and 0 < len(train) < len(src)
    with pytest.raises(DataError, match="--eval-fraction"):
        held_out(src, 1.5)


def test_command_line_passes_attention_and_text_column(tmp_path):
    from torchpp.runtime.trainer import TrainConfig, fingerprint, prepare
    from torchpp.train import build_parser

    args = build_parser().parse_args(["--plan", "p.json", "--attn-implementation", "eager", "--text-column", "body",
                                      "--adam-betas", "0.8,0.9", "--lr-schedule", "linear", "--warmup-steps", "3"])
    assert (args.attn_implementation, args.text_column, args.adam_betas) == ("eager", "body", (0.8, 0.9))
    plan = _plan(CASES["llama_pp2_dp21_linear"], tmp_path / "plan.json")
    for want in ("eager", "sdpa"):
        cfg = TrainConfig(plan=plan, attn_implementation=want, text_column="body")
        prep = prepare(cfg, 3)
        assert prep.config._attn_implementation == want
        assert fingerprint(cfg, prep)["attn_implementation"] == want
