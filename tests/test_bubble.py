"""One analysis: the planner's priced step, the replayed timeline, the analysis of that timeline
and of its predicted Chrome trace agree, and every bubble term is measured, ≥ 0 and adds up."""
import json
import random

import pytest

from torchpp.cli import main
from torchpp.formats import Plan
from torchpp.cost import MemoryEstimator
from torchpp.planner.report import predict
from torchpp.planner.simple import make_plan
from torchpp.planner.synthetic import layers_file, random_instance
from torchpp.sim.trace import predicted_trace, recompute_of, timeline_events
from torchpp.trace.analyze import BUBBLE_TERMS, analyze, events_from_trace


def cost_api():
    """The cost layer's profiles, links and pricing (one place to update when it moves)."""
    from torchpp.cost import Links, Profiles
    from torchpp.sim.measured import price

    return Profiles, Links, price


def random_plan(rng: random.Random):
    """A small random plan over random hosts: stages, groups, micro-batches, recompute, tied or not."""
    _, Links, _ = cost_api()
    tied = rng.random() < 0.5
    groups = [rng.choice([1, 1, 2]) for _ in range(rng.randint(1, 4))]
    L = len(groups) + rng.randint(0, 3)
    files, bw, _ = random_instance(rng, hosts=sum(groups), layers=L, batch=2, tied=tied)
    cuts = sorted(rng.sample(range(1, L), len(groups) - 1))
    bounds = [0, *cuts, L]
    m = rng.choice([1, 2, 3, 4, 6])
    plan = make_plan(files[0].model, seq_len=16, global_batch=m * 2 * max(groups), num_microbatches=m,
                     layer_ranges=list(zip(bounds, bounds[1:])), group_sizes=groups, hosts=[f.host for f in files],
                     schedule=rng.choice(["1f1b", "1f1b", "gpipe"]))
    for s in plan.stages:
        s.recompute = [rng.random() < 0.4 for _ in s.recompute]
    return plan, files, Links(bw)


def check_split(b: dict, T: float) -> None:
    assert all(b[k] >= 0.0 for k in ("real", *BUBBLE_TERMS)), b
    assert abs(sum(b[k] for k in BUBBLE_TERMS) - b["real"]) <= 1e-9 * T


@pytest.mark.parametrize("seed", range(12))
def test_priced_step_timeline_and_analysis_agree(seed):
    Profiles, _, price = cost_api()
    rng = random.Random(seed)
    plan, files, links = random_plan(rng)
    prof = Profiles.from_layers(files)
    opt = {f.host: rng.choice([0.0, 1e-4]) for f in files}
    step, tl = price(plan, prof, links, opt)
    rec = recompute_of(plan, prof)
    a = analyze(timeline_events(plan, tl, recompute_of=rec))
    assert step == tl.makespan == a.step_time_s
    check_split(a.bubble, a.step_time_s)
    for st in a.ranks.values():
        parts = st.ideal_s + st.imbalance_s + st.communication_s + st.recompute_s
        assert min(st.ideal_s, st.imbalance_s, st.communication_s, st.recompute_s, st.useful_s) >= 0
        assert abs(parts - st.real_s) <= 1e-9 * a.step_time_s
    if any(any(s.recompute) for s in plan.stages):
        assert a.bubble["recompute"] > 0
    # the predicted Chrome trace, read back, gives the same analysis
    tr = json.loads(json.dumps(predicted_trace(plan, tl, recompute_of=rec)))
    b = analyze(events_from_trace(tr))
    assert b.step_time_s == pytest.approx(a.step_time_s, abs=1e-9)
    for k, v in a.bubble.items():
        assert b.bubble[k] == pytest.approx(v, abs=1e-9), k
    # and the planner's prediction is that analysis
    pred, _ = predict(plan, prof, links, MemoryEstimator.analytic(), {}, opt)
    assert pred["step_time_s"] == step and pred["bubble"] == a.bubble


def test_balanced_pipeline_with_recompute_is_fill_drain_plus_recompute():
    Profiles, Links, price = cost_api()
    files = [layers_file(h, num_layers=4, layer_fwd_s=1.0, embed_fwd_s=0.0, tail_fwd_s=0.0, tied=False)
             for h in ("a", "b")]
    plan = make_plan(files[0].model, seq_len=16, global_batch=4, num_microbatches=4, layer_ranges=[(0, 2), (2, 4)],
                     group_sizes=[1, 1], hosts=["a", "b"])
    for s in plan.stages:
        s.recompute = [False, True]
    prof = Profiles.from_layers(files)
    from torchpp.planner.synthetic import uniform_links

    _, tl = price(plan, prof, Links(uniform_links(["a", "b"], 1e12)))
    a = analyze(timeline_events(plan, tl, recompute_of=recompute_of(plan, prof)))
    c = (2 + 4 + 1) / 4  # a 1-sample micro-batch (layer times are for 4): 2 layers F, their B, 1 recomputed
    assert a.bubble["ideal"] == pytest.approx(c)  # (p - 1)·c
    assert a.bubble["recompute"] == pytest.approx(4 * 0.25)
    assert a.bubble["imbalance"] == pytest.approx(0, abs=1e-9)
    assert a.bubble["real"] == pytest.approx(c + 1.0)


def test_untied_four_host_instance_has_no_negative_term():
    """On this instance the old formula (communication = real − the others, relative to m·t̄)
    printed communication −0.91."""
    Profiles, Links, _ = cost_api()
    from torchpp.planner.types import Problem
    from torchpp.planner.search import search

    files, bw, mem = random_instance(random.Random(3), hosts=4, layers=6, batch=2, tied=False)
    prof = Profiles.from_layers(files)
    memory = MemoryEstimator.analytic()
    pb = Problem(profiles=prof, links=Links(bw), hosts=[f.host for f in files], budget=mem, memory=memory,
                 global_batch=4)
    plan = search(pb).plan
    pred, tl = predict(plan, prof, Links(bw), memory, mem)
    check_split(pred["bubble"], pred["step_time_s"])
    assert pred["bubble"]["communication"] > 0  # the transfers of a slow link are there, not subtracted away


@pytest.fixture
def planned(tmp_path):
    hosts = ("h0", "h1", "h2")
    files, bw, _ = random_instance(random.Random(5), hosts=3, layers=5, batch=2, tied=False)
    paths = []
    for f in files:
        paths.append(f.save(tmp_path / f"layers_{f.host}.json"))
    bw.save(tmp_path / "bandwidth.json")
    (tmp_path / "devices.json").write_text(json.dumps({h: 1 for h in hosts}))
    return tmp_path, [str(p) for p in paths]


def test_plan_bubble_equals_analyze_of_simulate_plan_trace(planned, capsys):
    d, layers = planned
    assert main(["plan", "--layers", *layers, "--bandwidth", str(d / "bandwidth.json"), "--devices",
                 str(d / "devices.json"), "--global-batch", "8", "--out-dir", str(d / "out")]) == 0
    assert main(["simulate", "plan", str(d / "out" / "plan.json"), "--bandwidth", str(d / "bandwidth.json"),
                 "--layers", *layers, "--comm", "links", "--trace", str(d / "pred.json")]) == 0
    plan = Plan.load(d / "out" / "plan.json")
    a = analyze(events_from_trace(json.loads((d / "pred.json").read_text())))
    assert a.step_time_s == pytest.approx(plan.predicted["step_time_s"], abs=1e-9)
    assert set(a.bubble) == set(plan.predicted["bubble"])
    for k, v in plan.predicted["bubble"].items():
        assert a.bubble[k] == pytest.approx(v, abs=1e-9), k
    check_split(plan.predicted["bubble"], plan.predicted["step_time_s"])
    summary = (d / "out" / "summary.txt").read_text()
    assert "seconds per rank" in summary and f"{plan.predicted['bubble']['real']:8.4f}" in summary
    # the same numbers from `torchpp analyze`, reading the predicted trace as if it were measured
    (d / "tr").mkdir()
    (d / "tr" / "timeline_step0_all.json").write_text((d / "pred.json").read_text())
    assert main(["analyze", str(d / "tr"), "--out", str(d / "rep")]) == 0
    rep = json.loads((d / "rep" / "report.json").read_text())
    for k, v in plan.predicted["bubble"].items():
        assert rep["measured"]["bubble"][k] == pytest.approx(v, abs=1e-9), k
