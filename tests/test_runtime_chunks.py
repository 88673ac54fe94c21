"""Every schedule of the chunked plan format trains exactly what single-process training trains.

Interleaved (v=2), the V shape with the tied weight held once, and zero-bubble (ZB-H1, ZBV,
interleaved ZB) each run two AdamW steps of a real pipeline (gloo, one process per rank) with
uneven chunks, a data-parallel group inside a chunk and one recomputed layer; every weight
read back from the run's checkpoint equals plain HF training on the whole batch. A
checkpoint written under one chunking is resumed under another.
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
from torchpp.models.stages import StageSpec, backward_input, backward_weight, build_stage, build_stages, \
    read_tensors, safetensors_index
from torchpp.plans import make_chunked_plan
from torchpp.schedules import Kind, build

MODEL = "qwen3-tiny"
SEQ = 16
STEPS = 2
EPS = 1e-6
"""AdamW's eps: see tests/test_runtime.py (1e-8 amplifies fp32 rounding of near-zero gradients)."""


@dataclass(frozen=True)
class Case:
    schedule: str
    layers: list[tuple[int, int]]
    groups: list[int]
    mbs: int
    m: int
    recompute: int
    """The one recomputed decoder layer."""
    shares: list[list[float]] | None = None

    @property
    def world(self) -> int:
        return sum(self.groups)


CASES = {
    # chunks 0 and 2 on a group of two unequal ranks, chunks 1 and 3 on one; tied weight all-reduced
    "interleaved_v2": Case("interleaved", [(0, 2), (2, 3), (3, 4), (4, 4)], [2, 1], 3, 2, 2,
                           shares=[[2.0, 1.0], [1.0]]),
    # V: ranks 0 and 1 hold the embedding chunk and the tail chunk (one tied weight each, no all-reduce)
    "v_tied_group": Case("v", [(0, 1), (1, 2), (2, 4), (4, 4)], [2, 1], 2, 4, 1),
    # ZB-H1 on one chunk per rank, the second a group of two unequal ranks
    "zbh1_group": Case("zb-h1", [(0, 1), (1, 4)], [1, 2], 3, 3, 2, shares=[[1.0], [1.0, 2.0]]),
    # ZBV: rank 0 holds the (layer-less) embedding chunk and the tail chunk; chunks 1 and 2 on a group
    "zbv_group": Case("zbv", [(0, 0), (0, 1), (1, 3), (3, 4)], [1, 2], 2, 4, 1),
    "interleaved_zb": Case("interleaved-zb", [(0, 1), (1, 3), (3, 4), (4, 4)], [1, 1], 2, 4, 1),
}

RESUMES = {
    # written under V (one shared tied weight), resumed under interleaved ZB (a copy on each end)
    "v_to_interleaved_zb": ("v_tied_group", "interleaved_zb"),
    # and the other way round
    "interleaved_to_zbv": ("interleaved_v2", "zbv_group"),
}


def _plan(case: Case, path: Path) -> Path:
    info = model_info(load_config(MODEL), MODEL)
    rec = [[i == case.recompute for i in range(a, b)] for a, b in case.layers]
    plan = make_chunked_plan(info, seq_len=SEQ, global_batch=case.mbs * case.m, num_microbatches=case.m,
                             layer_ranges=case.layers, schedule=case.schedule, group_sizes=case.groups,
                             shares=case.shares, recompute=rec)
    plan.save(path)
    return path


def _spec(d: Path, case: Case, plan: Path, **kw) -> dict:
    return {"world_size": case.world, "result": str(d / f"result{kw.get('steps', STEPS)}.json"), "config": dict(
        plan=plan, steps=STEPS, lr=1e-3, seed=7, adam_eps=EPS, threads=1, checkpoint_dir=d / "ckpt",
        timeout_s=60.0) | kw}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("chunks")
    specs, dirs = [], {}
    for name, case in CASES.items():
        d = dirs[name] = root / name
        d.mkdir()
        specs.append(_spec(d, case, _plan(case, d / "plan.json")))
    for name, (first, then) in RESUMES.items():
        d = dirs[name] = root / name
        d.mkdir()
        # both plans split the same global batch (6 or 8 samples) the same way into micro-batches
        a, b = CASES[first], CASES[then]
        a = Case(a.schedule, a.layers, a.groups, b.mbs, b.m, a.recompute, a.shares if b.mbs == a.mbs else None)
        # one of them writes in the background (tensors copied between steps, per chunk)
        specs.append(_spec(d, a, _plan(a, d / "first.json"), steps=1, checkpoint_every=1,
                           checkpoint_background=first == "interleaved_v2"))
        specs.append(_spec(d, b, _plan(b, d / "then.json"), resume=True))
    # a traced ZBV run with block events: I and W of both chunks of a rank on its compute row
    d = dirs["traced"] = root / "traced"
    d.mkdir()
    case = CASES["zbv_group"]
    specs.append(_spec(d, case, _plan(case, d / "plan.json"), checkpoint_dir=None, trace_dir=d / "traces",
                       trace_steps=(2,), profile_blocks=True, log_dir=d / "logs"))
    run_cases(specs, nprocs=3, workdir=root, timeout_s=600)
    return dirs


def reference(mbs: int, m: int) -> tuple[torch.nn.Module, list[float]]:
    """Plain HF training of the whole model on the whole global batch."""
    torch.manual_seed(0)
    model = build_model(MODEL, seed=7)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0, eps=EPS)
    data = SyntheticTokens(vocab_size=model.config.vocab_size, seq_len=SEQ, global_batch=mbs * m, seed=7)
    return model, single_process_losses(model, opt, data, STEPS)


def _worst(step_dir: Path, ref: torch.nn.Module) -> tuple[float, str]:
    names = [n for n, _ in ref.named_parameters()]
    tensors = read_tensors(step_dir, names, {"lm_head.weight": "model.embed_tokens.weight"})
    return max((float((tensors[n] - p.detach()).abs().max()), n) for n, p in ref.named_parameters())


@pytest.mark.parametrize("name", list(CASES))
def test_weights_equal_single_process(runs, name):
    case = CASES[name]
    ref, ref_losses = reference(case.mbs, case.m)
    d = runs[name]
    assert json.loads((d / f"result{STEPS}.json").read_text())["losses"] == pytest.approx(ref_losses, abs=1e-5)
    step_dir = d / "ckpt" / f"step_{STEPS:08d}"
    worst = _worst(step_dir, ref)
    assert worst[0] < 1e-5, f"largest difference {worst[0]:.3g} in {worst[1]}"
    init = build_model(MODEL, seed=7)
    assert max(float((p.detach() - q.detach()).abs().max()) for p, q in zip(ref.parameters(), init.parameters())) > 1e-4
    index = safetensors_index(step_dir)
    if case.schedule in ("v", "zbv"):
        # the V's rank holding both ends keeps one tied weight: the checkpoint holds it once
        assert "lm_head.weight" not in index and "model.embed_tokens.weight" in index
    else:
        assert "lm_head.weight" in index


@pytest.mark.parametrize("name", list(RESUMES))
def test_checkpoint_resumes_under_another_chunking(runs, name):
    then = CASES[RESUMES[name][1]]
    d = runs[name]
    assert json.loads((d / f"result{STEPS}.json").read_text())["start"] == 1
    ref, ref_losses = reference(then.mbs, then.m)
    assert json.loads((d / f"result{STEPS}.json").read_text())["losses"] == pytest.approx(ref_losses[1:], abs=1e-5)
    worst = _worst(d / "ckpt" / f"step_{STEPS:08d}", ref)
    assert worst[0] < 1e-5, f"largest difference {worst[0]:.3g} in {worst[1]}"


def test_traces_show_each_chunk_and_the_split_backward(runs):
    from torchpp.trace.analyze import analyze, events_from_trace

    merged = json.loads((runs["traced"] / "traces" / "timeline_step2_all.json").read_text())
    xs = [e for e in merged["traceEvents"] if e["ph"] == "X" and e.get("cat") != "block"]
    case = CASES["zbv_group"]
    for rank, chunks in ((0, {0, 3}), (1, {1, 2}), (2, {1, 2})):
        mine = [e for e in xs if e["pid"] == rank]
        for kind in "FIW":
            assert {e["args"]["stage"] for e in mine if e["name"] == f"{kind}0"} == chunks, (rank, kind)
        assert not any(e["name"].startswith("B") for e in mine)
        assert sum(e["name"] == "optimizer" for e in mine) == 1
    # the local hand-off between chunks 1 and 2 of ranks 1 and 2 sends nothing
    assert not [e for e in xs if e["name"] == "send_act" and e["pid"] in (1, 2) and e["args"]["stage"] == 1]
    names = {e["args"].get("name") for e in merged["traceEvents"] if e["ph"] == "M" and e["pid"] == 0}
    assert any("stages 0,3" in str(n) for n in names)
    a = analyze(events_from_trace(merged))
    assert a.num_microbatches == case.m and a.step_time_s > 0


def test_v_rank_holds_the_tied_weight_once():
    cfg = load_config(MODEL)
    both = build_stages(MODEL, cfg, {0: StageSpec((0, 1), True, False, num_stages=4),
                                     3: StageSpec((3, 4), False, True, num_stages=4)}, seed=7)
    assert both.shares_tied_weight()
    emb = both.chunks[0].module.model.embed_tokens.weight
    assert both.chunks[3].module.lm_head.weight is emb
    names = [n for n, _ in both.named_parameters()]
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    assert sum(p is emb for p in both.parameters()) == 1
    info = model_info(cfg, MODEL)
    plan = make_chunked_plan(info, seq_len=SEQ, global_batch=4, num_microbatches=4, schedule="zbv",
                             layer_ranges=[(0, 1), (1, 2), (2, 3), (3, 4)])
    assert not any(a.tied for acts in build(plan).values() for a in acts if a.kind == Kind.ALLREDUCE)


@pytest.mark.parametrize("recompute", [(False, False, False), (False, True, False), (True, True, True)])
@pytest.mark.parametrize("tail", [False, True])
@pytest.mark.parametrize("autocast", ["", "bfloat16"])
def test_split_backward_equals_full_backward(recompute, tail, autocast):
    """I then W gives bit-identical input and weight gradients to one backward, with recompute and
    under mixed precision (the set-aside products run in autocast's dtype, as autograd's do)."""
    cfg = load_config(MODEL)
    spec = StageSpec(layers=(1, 4), has_embed=False, has_tail=tail, recompute=recompute, num_stages=2)
    got = []
    for split in (False, True):
        st = build_stage(MODEL, cfg, spec, seed=3, autocast=autocast)
        if split:
            assert st.defer_weight_gradients() == 7 * 3 + tail  # q k v o gate up down per layer, lm_head
        torch.manual_seed(0)
        x = torch.randn(2, 8, st.hidden_size, requires_grad=True)
        ids = torch.randint(0, cfg.vocab_size, (2, 8))
        out = st.forward(x, ids, 16)
        grad = None if tail else torch.randn_like(out)
        params = st.parameters()
        if split:
            now = [p for i, r in zip(range(1, 4), recompute) if r for p in st.layer_list[i].parameters()]
            later = [p for p in params if all(p is not q for q in now)]
            dx, task = backward_input(out, grad, x, later, now)
            del out
            linear = [m.weight for m in st.module.modules() if isinstance(m, torch.nn.Linear)]
            assert all(p.grad is None for p in later if any(p is w for w in linear))  # set aside for W
            assert all(p.grad is not None for p in now)
            backward_weight(task)
        else:
            torch.autograd.backward(out, grad)
            dx = x.grad
        got.append((dx, [p.grad for p in params]))
    (a, ga), (b, gb) = got
    assert torch.equal(a, b)
    assert all(torch.equal(u, v) for u, v in zip(ga, gb))


@pytest.mark.parametrize("model", ["gpt2-tiny", "llama-tiny"])
def test_split_backward_equals_full_backward_other_architectures(model):
    """GPT-2's Conv1D layers (weight stored (in, out), with biases) and Llama's set aside their
    weight gradients too, bit-identical to one backward."""
    cfg = load_config(model)
    spec = StageSpec(layers=(0, 2), has_embed=False, has_tail=True, num_stages=2)
    got = []
    for split in (False, True):
        st = build_stage(model, cfg, spec, seed=3)
        if split:
            assert st.defer_weight_gradients() > 0
        torch.manual_seed(0)
        x = torch.randn(2, 8, st.hidden_size, requires_grad=True)
        ids = torch.randint(0, cfg.vocab_size, (2, 8))
        out = st.forward(x, ids, 16)
        if split:
            dx, task = backward_input(out, None, x, st.parameters(), [])
            assert task.kept and any(d.bias is not None for d in task.kept) == (model == "gpt2-tiny")
            backward_weight(task)
        else:
            out.backward()
            dx = x.grad
        got.append((dx, [p.grad for p in st.parameters()]))
    (a, ga), (b, gb) = got
    assert torch.equal(a, b)
    assert all(torch.equal(u, v) for u, v in zip(ga, gb))


def test_input_pass_frees_the_graph_and_weight_pass_what_it_kept():
    """After I only the linear layers' inputs and output gradients are held (the graph and every
    other saved activation are freed); W frees those."""
    import gc
    import weakref

    cfg = load_config(MODEL)
    st = build_stage(MODEL, cfg, StageSpec(layers=(1, 3), has_embed=False, has_tail=False, num_stages=3), seed=3)
    saved: list[weakref.ref] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        # a detached alias: holding the tensor itself would tie a node to its own output (a cycle)
        if isinstance(t, torch.nn.Parameter):
            return t
        t = t.detach()
        saved.append(weakref.ref(t))
        return t

    st.defer_weight_gradients()
    x = torch.randn(2, 8, st.hidden_size, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = st.forward(x)
    dx, task = backward_input(out, torch.randn_like(out), x, st.parameters(), [])
    del out, x
    gc.collect()
    assert dx is not None and saved and all(r() is None for r in saved)
    assert len(task.kept) == 7 * 2  # one per linear layer call
    # nothing kept leads back into the graph (an unpacked saved input carries its grad_fn)
    assert all(t.grad_fn is None for d in task.kept for t in (d.x, d.dy))
    kept = [weakref.ref(t) for d in task.kept for t in (d.x, d.dy)]
    backward_weight(task)
    del task
    gc.collect()
    assert all(r() is None for r in kept)


@pytest.mark.parametrize("name", list(CASES))
def test_message_tags_tell_every_message_on_a_link_apart(name):
    """Interleaved and V placements send several chunks' messages between the same two ranks: the
    chunk is in the tag, so two messages in flight on one link never share one."""
    from torchpp.runtime.comm import tag_of

    case = CASES[name]
    info = model_info(load_config(MODEL), MODEL)
    plan = make_chunked_plan(info, seq_len=SEQ, global_batch=case.mbs * case.m, num_microbatches=case.m,
                             layer_ranges=case.layers, schedule=case.schedule, group_sizes=case.groups,
                             shares=case.shares)
    sched = build(plan)
    space = (plan.num_stages - 1, plan.micro_batch_size)
    sent = [(r, a.peer, tag_of(a, *space)) for r, acts in sched.items() for a in acts if a.is_send]
    got = [(a.peer, r, tag_of(a, *space)) for r, acts in sched.items() for a in acts if a.is_recv]
    assert len(set(sent)) == len(sent) and sorted(sent) == sorted(got)


def test_per_stage_statistics_count_every_chunk(runs):
    """A rank's compute and waits go to the chunk whose action they were: on a ZBV plan every
    chunk's entry in metrics.jsonl is its own, none is left at 0 (the first chunk once took all)."""
    rows = [json.loads(x) for x in (runs["traced"] / "logs" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "compute_s" in r]
    assert len(steps) == STEPS
    for r in steps:
        assert len(r["compute_s"]) == 4 and min(r["compute_s"]) > 0, r["compute_s"]
        assert len(r["comm_wait_s"]) == 4


@pytest.mark.parametrize("split", [False, True])
def test_lm_head_adds_its_weight_gradient_in_place(split, monkeypatch):
    """From the second micro-batch on, the tail's lm_head adds its weight gradient into ``.grad``
    in one product: no block of the lm_head's size is allocated during a micro-batch (plain
    ``nn.Linear`` autograd allocates its fresh product there), with a full backward and with I
    then W; the sum equals plain autograd's over the same micro-batches."""
    from torch.profiler import ProfilerActivity, profile

    import torchpp.models.stages as stages_mod

    cfg = load_config(MODEL)
    spec = StageSpec(layers=(2, 4), has_embed=False, has_tail=True, num_stages=2)
    grads, fresh = [], []
    for in_place in (False, True):
        st = build_stage(MODEL, cfg, spec, seed=3)
        head = st.module.lm_head
        if split:
            st.defer_weight_gradients()
        if not in_place:  # autograd's own linear: a fresh product, added by AccumulateGrad
            monkeypatch.setattr(stages_mod, "project", lambda m, h: torch.nn.functional.linear(h, m.weight, m.bias))
        torch.manual_seed(0)
        count = 0
        for mb in range(3):
            with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                x = torch.randn(2, 8, st.hidden_size, requires_grad=True)
                out = st.forward(x, torch.randint(0, cfg.vocab_size, (2, 8)), 14)
                if split:
                    backward_weight(backward_input(out, None, x, st.parameters(), [])[1])
                else:
                    out.backward()
            if mb:
                count += sum(e.cpu_memory_usage == head.weight.grad.nbytes for e in prof.events())
        monkeypatch.undo()
        grads.append(head.weight.grad)
        fresh.append(count)
    assert fresh[0] >= 2 and fresh[1] == 0
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-7)
