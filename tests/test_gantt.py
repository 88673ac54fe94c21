"""The one Gantt renderer, as plan, analyze and simulate use it: one colour per action kind."""
import json
import random

import pytest

from torchpp.cost import MemoryEstimator
from torchpp.planner.report import predict, write_outputs
from torchpp.planner.simple import make_plan
from torchpp.planner.synthetic import random_instance
from torchpp.schedules import build
from torchpp.sim.engine import SimOptions, simulate
from torchpp.sim.gantt import bars_of, plot_gantt
from torchpp.sim.trace import predicted_trace, timeline_events
from torchpp.trace.gantt import COLOURS, bars_from_events

PNG = b"\x89PNG\r\n\x1a\n"


def cost_api():
    """The cost layer's profiles, links and measured cost (one place to update when it moves)."""
    from torchpp.cost import Links, MeasuredCost, Profiles

    return Profiles, Links, MeasuredCost


@pytest.fixture
def hybrid():
    Profiles, Links, MeasuredCost = cost_api()
    files, bw, _ = random_instance(random.Random(1), hosts=4, layers=4, batch=2, tied=True)
    plan = make_plan(files[0].model, seq_len=16, global_batch=8, num_microbatches=4, layer_ranges=[(0, 2), (2, 4)],
                     group_sizes=[2, 2], hosts=[f.host for f in files])
    prof = Profiles.from_layers(files)
    return plan, prof, Links(bw), MeasuredCost(plan, prof, Links(bw))


def is_png(path) -> bool:
    return path.read_bytes()[:8] == PNG


def test_plan_gantt(tmp_path, hybrid):
    plan, prof, links, _ = hybrid
    plan.predicted, tl = predict(plan, prof, links, MemoryEstimator.analytic(), {})
    write_outputs(tmp_path, plan, tl, {"format": "torchpp.plan_meta/1"})
    assert is_png(tmp_path / "gantt.png")


def test_analyze_gantt(tmp_path, hybrid):
    from torchpp.trace.report import run_analyze

    plan, _, _, cost = hybrid
    tl = simulate(build(plan), cost).timeline
    (tmp_path / "tr").mkdir()
    (tmp_path / "tr" / "timeline_step1_all.json").write_text(json.dumps(predicted_trace(plan, tl, step=1)))
    (tmp_path / "pred.json").write_text(json.dumps(predicted_trace(plan, tl)))
    run_analyze(tmp_path / "tr", tmp_path / "rep", predicted=tmp_path / "pred.json")
    assert is_png(tmp_path / "rep" / "gantt.png")


@pytest.mark.parametrize("style", ["single", "dual"])
def test_simulate_gantt(tmp_path, hybrid, style):
    plan, _, _, cost = hybrid
    res = simulate(build(plan), cost, SimOptions(comm="shared", congestion=True, recv_capacity=0.5))
    out = plot_gantt(res, tmp_path / f"{style}.png", style=style, show_throttling=True, show_completion_time=True)
    assert is_png(out)
    with pytest.raises(ValueError, match="single or dual"):
        plot_gantt(res, tmp_path / "x.png", style="triple")


def test_simulator_and_timeline_draw_the_same_bars(hybrid):
    """The simulator's adapter and the analysis' events give one bar per action, same kind and time."""
    plan, _, _, cost = hybrid
    res = simulate(build(plan), cost)
    key = lambda b: (b.device, b.channel, b.kind, round(b.start, 12), round(b.end, 12))  # noqa: E731
    sim = sorted(key(b) for b in bars_of(res) if b.channel != "comm" or b.kind == "allreduce")
    ev = sorted(key(b) for b in bars_from_events(timeline_events(plan, res.timeline))
                if b.channel != "comm" or b.kind == "allreduce")
    assert sim == ev
    assert {b[2] for b in sim} <= set(COLOURS) and {"F", "B", "allreduce"} <= {b[2] for b in sim}


def test_seed002_result_is_drawn_with_the_same_kinds(tmp_path):
    from torchpp.sim.model import Priorities
    from torchpp.sim.seed002 import simulate_seed002

    lengths = {"forward": 1.0, "backward": 2.0, "fwd_prop": 0.5, "grad_prop": 0.5, "grad_sync": 0.3}
    r = simulate_seed002(num_gpus=3, n=4, sync_freq=1, lengths=lengths, priorities=Priorities(), fwd_impact=0.1,
                         bwd_impact=0.1, use_recv_congestion=True)
    kinds = {b.kind for b in bars_of(r)}
    assert kinds <= set(COLOURS) and {"F", "B", "send_act", "send_grad", "allreduce"} <= kinds
    assert is_png(plot_gantt(r, tmp_path / "s.png", style="single", show_throttling=True))
