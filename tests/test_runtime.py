"""The runtime trains exactly what single-process training trains.

Each case runs two optimizer steps of a real pipeline (gloo, one process per rank) and
compares every weight, loaded back from the checkpoint the run wrote (so the stages' files
together must form the HF model), and both losses against plain HF training on the whole
global batch.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from dist_harness import run_cases, single_process_losses
from torchpp.data import SyntheticTokens
from torchpp.models.presets import build_model, load_config, model_info
from torchpp.models.stages import read_tensors, safetensors_index
from torchpp.planner.simple import make_plan

SEQ = 16
STEPS = 2


@dataclass(frozen=True)
class Case:
    model: str
    layers: list[tuple[int, int]]
    groups: list[int]
    mbs: int
    m: int
    schedule: str
    recompute: list[list[bool]]
    shares: list[list[float]] | None = None
    optimizer: str = "adamw"
    lr: float = 1e-3
    eps: float = 1e-6
    """AdamW divides by sqrt(v) + eps: with the default 1e-8, a gradient element that is zero up to
    fp32 rounding (1e-10) moves by up to lr / 100 depending on the rounding, which any change of
    summation order (a sample split across ranks) changes. 1e-6 keeps that below 1e-7."""


CASES = {
    # 2-stage uneven pipeline, tied embeddings synced across stages, 1F1B
    "qwen3_pp2_uneven_1f1b": Case("qwen3-tiny", [(0, 3), (3, 4)], [1, 1], 2, 4, "1f1b", [[False] * 3, [False]]),
    # 3-stage uneven pipeline, GPipe, recompute on some layers
    "qwen3_pp3_uneven_gpipe_recompute": Case("qwen3-tiny", [(0, 1), (1, 3), (3, 4)], [1, 1, 1], 1, 3, "gpipe",
                                             [[True], [False, True], [True]]),
    # hybrid (2, 1) with unequal shares: stage 1 receives one micro-batch from two ranks; untied
    "llama_hybrid21_shares_1f1b": Case("llama-tiny", [(0, 1), (1, 4)], [2, 1], 3, 2, "1f1b",
                                       [[False], [True, False, True]], shares=[[2.0, 1.0], [1.0]]),
    # hybrid (1, 2): the tied last stage is a group of two unequal ranks
    "qwen3_hybrid12_tied_gpipe": Case("qwen3-tiny", [(0, 2), (2, 4)], [1, 2], 3, 2, "gpipe",
                                      [[False, False], [True, True]], shares=[[1.0], [1.0, 2.0]]),
    # pure data parallel over 3 ranks with unequal shares (eager attention: masks must be rebuilt)
    "gpt2_dp3_shares": Case("gpt2-tiny", [(0, 4)], [3], 4, 2, "1f1b", [[False] * 4], shares=[[2.0, 1.0, 1.0]]),
    # 3-stage GPT-2 (learned positions, eager attention in every stage), SGD
    "gpt2_pp3_1f1b_sgd": Case("gpt2-tiny", [(0, 2), (2, 3), (3, 4)], [1, 1, 1], 1, 4, "1f1b",
                              [[False, True], [False], [True]], optimizer="sgd", lr=0.5),
}


def _plan(case: Case, path: Path) -> Path:
    info = model_info(load_config(case.model), case.model)
    plan = make_plan(info, seq_len=SEQ, global_batch=case.mbs * case.m, num_microbatches=case.m,
                     layer_ranges=case.layers, group_sizes=case.groups, schedule=case.schedule, shares=case.shares)
    for st, flags in zip(plan.stages, case.recompute):
        st.recompute = list(flags)
    plan.save(path)
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("runtime")
    specs, dirs = [], {}
    for name, case in CASES.items():
        d = root / name
        d.mkdir()
        dirs[name] = d
        specs.append({"world_size": sum(case.groups), "result": str(d / "result.json"), "config": dict(
            plan=_plan(case, d / "plan.json"), steps=STEPS, lr=case.lr, optimizer=case.optimizer, seed=7,
            adam_eps=case.eps,
            threads=1, checkpoint_dir=d / "ckpt", timeout_s=60.0)})
    # a traced run with block events and logs
    trace_plan = _plan(CASES["llama_hybrid21_shares_1f1b"], root / "trace_plan.json")
    specs.append({"world_size": 3, "result": str(root / "trace_result.json"), "config": dict(
        plan=trace_plan, steps=2, threads=1, timeout_s=60.0, trace_dir=root / "traces", trace_steps=(2,),
        profile_blocks=True, log_dir=root / "logs")})
    dirs["traced"] = root
    # resume: 2 steps + 2 resumed steps against 4 straight steps
    resume_plan = _plan(CASES["qwen3_pp2_uneven_1f1b"], root / "resume_plan.json")
    for name, steps, resume, ck in (("first", 2, False, "ck_resumed"), ("resumed", 4, True, "ck_resumed"),
                                    ("straight", 4, False, "ck_straight")):
        specs.append({"world_size": 2, "result": str(root / f"resume_{name}.json"), "config": dict(
            plan=resume_plan, steps=steps, threads=1, timeout_s=60.0, checkpoint_dir=root / ck,
            checkpoint_every=1, resume=resume)})
    run_cases(specs, nprocs=3, workdir=root, timeout_s=420)
    return dirs


def reference(case: Case) -> tuple[torch.nn.Module, list[float]]:
    """Plain HF training of the whole model on the whole global batch."""
    torch.manual_seed(0)
    model = build_model(case.model, seed=7)
    if case.optimizer == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=case.lr)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=case.lr, weight_decay=0.0, eps=case.eps)
    data = SyntheticTokens(vocab_size=model.config.vocab_size, seq_len=SEQ, global_batch=case.mbs * case.m, seed=7)
    return model, single_process_losses(model, opt, data, STEPS)


@pytest.mark.parametrize("name", list(CASES))
def test_weights_equal_single_process(runs, name):
    case = CASES[name]
    ref, ref_losses = reference(case)
    d = runs[name]
    got_losses = json.loads((d / "result.json").read_text())["losses"]
    assert got_losses == pytest.approx(ref_losses, abs=1e-5)
    step_dir = d / "ckpt" / f"step_{STEPS:08d}"
    index = safetensors_index(step_dir)
    names = [n for n, _ in ref.named_parameters()]
    tensors = read_tensors(step_dir, names)
    worst = max((float((tensors[n] - p.detach()).abs().max()), n) for n, p in ref.named_parameters())
    assert worst[0] < 1e-5, f"largest difference {worst[0]:.3g} in {worst[1]}"
    # the weights really moved (a run that did nothing would not be close to the reference anyway)
    init = build_model(case.model, seed=7)
    moved = max(float((p.detach() - q.detach()).abs().max()) for p, q in zip(ref.parameters(), init.parameters()))
    assert moved > 1e-4
    if ref.config.tie_word_embeddings and len(case.layers) > 1:
        # the last stage's own copy of the tied weight stayed in sync with the embedding
        head = read_tensors(step_dir, ["lm_head.weight"])["lm_head.weight"]
        assert "lm_head.weight" in index
        assert float((head - ref.get_output_embeddings().weight.detach()).abs().max()) < 1e-5


def test_checkpoint_loads_into_hf_model(runs):
    from transformers import AutoModelForCausalLM

    case = CASES["llama_hybrid21_shares_1f1b"]
    ref, _ = reference(case)
    step_dir = runs["llama_hybrid21_shares_1f1b"] / "ckpt" / f"step_{STEPS:08d}"
    loaded = AutoModelForCausalLM.from_pretrained(str(step_dir), local_files_only=True)
    for (n, p), (_, q) in zip(ref.named_parameters(), loaded.named_parameters()):
        assert float((p.detach() - q.detach()).abs().max()) < 1e-5, n
    manifest = json.loads((step_dir / "manifest.json").read_text())
    assert manifest["step"] == STEPS and set(manifest["files"]) == {
        "model-stage0.safetensors", "model-stage1.safetensors", "optim-stage0.safetensors", "optim-stage1.safetensors"}


def test_resume_continues_from_the_last_checkpoint(runs):
    root = runs["traced"]
    assert json.loads((root / "resume_resumed.json").read_text())["start"] == 2
    a, b = root / "ck_resumed" / "step_00000004", root / "ck_straight" / "step_00000004"
    names = sorted(safetensors_index(b))
    ta, tb = read_tensors(a, names), read_tensors(b, names)
    assert all(torch.equal(ta[n], tb[n]) for n in names)


def test_traces_show_every_action_with_aligned_clocks(runs):
    from torchpp.trace.analyze import analyze, events_from_trace

    root = runs["traced"]
    tdir = root / "traces"
    assert {p.name for p in tdir.iterdir()} == {f"timeline_step2_rank{r}.json" for r in range(3)} | {
        "timeline_step2_all.json"}
    merged = json.loads((tdir / "timeline_step2_all.json").read_text())
    ev = merged["traceEvents"]
    offsets = merged["metadata"]["clock_offsets_s"]
    assert len(offsets) == 3 and offsets[0] == 0.0
    xs = [e for e in ev if e["ph"] == "X"]
    for rank in range(3):
        names = {e["name"] for e in xs if e["pid"] == rank}
        assert {"F0", "F1", "B0", "B1", "optimizer"} <= names
        assert ("allreduce" in names) == (rank < 2)  # the stage-0 group; untied, so no tied all-reduce
    # ranks 0, 1 (stage 0) send activations to rank 2, which sends gradients back
    p2p = [e for e in xs if e["name"] in ("send_act", "recv_act", "send_grad", "recv_grad")]
    assert all(e["args"]["bytes"] > 0 for e in p2p)
    assert sum(1 for e in p2p if e["pid"] == 2 and e["name"] == "recv_act") == 4  # 2 micro-batches x 2 senders
    starts = {e["id"]: e for e in ev if e["ph"] == "s"}
    ends = {e["id"]: e for e in ev if e["ph"] == "f"}
    assert starts and set(starts) == set(ends)
    rtt_us = max(merged["metadata"]["clock_rtt_s"]) * 1e6
    # After alignment no message arrives before it was sent. The send row is laid out without
    # overlap, so a send is drawn from the end of the previous one, whose completion a waiter
    # thread stamps, late by up to a scheduler time slice or two when the cores are busy.
    slack_us = rtt_us / 2 + 25_000
    for fid, s in starts.items():
        assert s["pid"] != ends[fid]["pid"]
        assert s["ts"] <= ends[fid]["ts"] + slack_us
    blocks = [e for e in xs if e.get("cat") == "block"]
    assert {(e["name"], e["args"]["pass"]) for e in blocks if e["pid"] == 2} >= {
        ("layer1", "forward"), ("layer3", "backward"), ("tail", "forward"), ("tail", "backward")}
    assert {(e["name"], e["args"]["pass"]) for e in blocks if e["pid"] == 0} >= {
        ("embed", "forward"), ("embed", "backward"), ("layer0", "backward")}
    # the shared analyser reads the measured timeline
    a = analyze(events_from_trace(merged))
    assert a.num_stages == 2 and a.num_microbatches == 2 and a.step_time_s > 0
    logs = root / "logs"
    steps = [json.loads(x) for x in (logs / "metrics.jsonl").read_text().splitlines() if '"step"' in x]
    assert [r["step"] for r in steps] == [1, 2] and all(len(r["compute_s"]) == 2 for r in steps)
    # wall-clock stamps: the period between two reports holds the second step (and what followed the first)
    assert steps[1]["time"] - steps[0]["time"] >= steps[1]["step_time_s"] - 1e-3
    assert list(logs.glob("events.out.tfevents.*"))
