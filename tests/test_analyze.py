"""Timeline analysis: the bubble split adds up and matches closed forms."""
import pytest

from torchpp import schedules as S
from torchpp.formats import ModelInfo
from torchpp.planner.simple import make_plan
from torchpp.schedules import Kind
from torchpp.sim.replay import replay
from torchpp.trace.analyze import Event, analyze, events_from_trace

NAMES = {Kind.SEND_ACT: "send_act", Kind.RECV_ACT: "recv_act", Kind.SEND_GRAD: "send_grad",
         Kind.RECV_GRAD: "recv_grad", Kind.ALLREDUCE: "allreduce", Kind.OPTIMIZER: "optimizer"}


class Cost:
    def __init__(self, f, b, comm=0.0):
        self.f, self.b, self.comm = f, b, comm

    def compute_s(self, rank, a):
        return {Kind.FORWARD: self.f[a.stage], Kind.BACKWARD: self.b[a.stage], Kind.OPTIMIZER: 0.0}[a.kind]

    def transfer_s(self, src, dst, a):
        return self.comm

    def allreduce_s(self, a):
        return 0.0


def events(f, b, m, comm=0.0):
    p = len(f)
    info = ModelInfo(name="t", num_layers=p, hidden_size=8, vocab_size=32, tied_embeddings=False)
    sched = S.build(make_plan(info, seq_len=4, global_batch=m, num_microbatches=m,
                              layer_ranges=[(i, i + 1) for i in range(p)], group_sizes=[1] * p))
    out = []
    for r, spans in replay(sched, Cost(f, b, comm)).spans.items():
        for s in spans:
            a = s.action
            kind = a.kind.value if a.kind in (Kind.FORWARD, Kind.BACKWARD) else NAMES[a.kind]
            start = s.start
            if a.is_recv:  # a receive's event is the time the rank waited
                start, end = s.start, s.end
            else:
                end = s.end
            out.append(Event(r, a.stage, kind, a.microbatch, start, end, peer=a.peer))
    return out


def test_balanced_pipeline_has_only_ideal_bubble():
    p, m, f, b = 4, 8, 1.0, 2.0
    res = analyze(events([f] * p, [b] * p, m))
    assert res.step_time_s == pytest.approx((m + p - 1) * (f + b))
    assert res.bubble["ideal"] == pytest.approx((p - 1) * (f + b))
    assert res.bubble["imbalance"] == pytest.approx(0)
    assert res.bubble["communication"] == pytest.approx(0)
    assert res.bubble["real"] == pytest.approx(res.bubble["ideal"])


def test_split_adds_up_with_imbalance_and_comm():
    res = analyze(events([1.0, 1.5, 1.0], [2.0, 3.0, 2.5], 6, comm=0.2))
    bub = res.bubble
    assert bub["real"] == pytest.approx(bub["ideal"] + bub["imbalance"] + bub["communication"] + bub["recompute"])
    assert bub["imbalance"] > 0 and bub["communication"] > 0
    assert res.stage_forward_s == pytest.approx([1.0, 1.5, 1.0])
    assert sum(res.critical_path.values()) == pytest.approx(res.step_time_s)


def write_trace(path, evs, scale=1.0, ranks_meta=None):
    from torchpp.trace.chrome import TraceWriter

    tw = TraceWriter(world_size=len({e.rank for e in evs}), metadata={"ranks": ranks_meta or {}})
    for e in evs:
        tw.name_process(e.rank, f"rank {e.rank} · stage {e.stage} · host h{e.rank}")
        name = f"{e.kind}{e.microbatch}" if e.kind in ("F", "B") else e.kind
        thread = {"send_act": "send", "send_grad": "send", "recv_act": "recv", "recv_grad": "recv",
                  "allreduce": "collective"}.get(e.kind, "compute")
        tw.complete(e.rank, thread, name, e.start * scale, e.dur * scale,
                    {"stage": e.stage, "microbatch": e.microbatch, "peer": e.peer, "bytes": 1024})
    tw.save(path)


def test_analyze_cli_writes_report(tmp_path):
    import json

    from torchpp.cli import main

    evs = events([1.0, 1.5], [2.0, 3.0], 4, comm=0.1)
    (tmp_path / "tr").mkdir()
    meta = {"0": {"peak_rss_bytes": 100 * 2**20}, "1": {"peak_rss_bytes": 120 * 2**20}}
    write_trace(tmp_path / "tr" / "timeline_step1_all.json", evs, 1.1, meta)  # measured: 10% slower
    write_trace(tmp_path / "tr" / "timeline_step2_all.json", evs, 1.1, meta)
    write_trace(tmp_path / "pred.json", evs)
    assert main(["analyze", str(tmp_path / "tr"), "--predicted", str(tmp_path / "pred.json"),
                 "--out", str(tmp_path / "rep")]) == 0
    rep = json.loads((tmp_path / "rep" / "report.json").read_text())
    assert rep["step_time_error"] == pytest.approx(1 / 1.1 - 1, rel=1e-4)
    assert rep["stage_errors"][1]["forward_error"] == pytest.approx(1 / 1.1 - 1, rel=1e-4)
    assert rep["memory"]["1"]["measured_peak_bytes"] == 120 * 2**20
    for f in ("report.md", "gantt.png", "stages.png"):
        assert (tmp_path / "rep" / f).stat().st_size > 0
    assert main(["analyze", str(tmp_path / "nothing"), "--out", str(tmp_path / "x")]) == 2


def test_the_error_splits_into_the_hosts_speed_and_the_rest(tmp_path):
    """A run whose every compute took 1.25x its prediction (links free) is 20% slower than predicted,
    all of it the hosts' speed: the critical path's compute reads 1.25x and, with it as measured, the
    prediction is exact. Where the run's compute matched, the whole error is left to the rest."""
    import json

    from torchpp.sim.trace import predicted_trace
    from torchpp.trace.report import build_report, compute_split

    info = ModelInfo(name="t", num_layers=2, hidden_size=8, vocab_size=32, tied_embeddings=False)
    plan = make_plan(info, seq_len=4, global_batch=4, num_microbatches=4, layer_ranges=[(0, 1), (1, 2)],
                     group_sizes=[1, 1])
    for name, k in (("pred.json", 1.0), ("slow/timeline_step1_all.json", 1.25)):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        tl = replay(S.build(plan), Cost([1.0 * k, 1.5 * k], [2.0 * k, 3.0 * k]))
        (tmp_path / name).write_text(json.dumps(predicted_trace(plan, tl, step=1)))
    rep = build_report(tmp_path / "slow", predicted=tmp_path / "pred.json")
    assert rep["step_time_error"] == pytest.approx(1 / 1.25 - 1, rel=1e-6)
    split = rep["compute_split"]
    assert split["ratio"] == pytest.approx(1.25, rel=1e-6) and split["step_error"] == pytest.approx(0.0, abs=1e-6)
    same = analyze(events_from_trace(json.loads((tmp_path / "pred.json").read_text())))
    assert compute_split(same, same, same.step_time_s * 1.1)["step_error"] == pytest.approx(1 / 1.1 - 1)
    assert build_report(tmp_path / "slow")["step_time_error"] is None  # no prediction: no split either


def test_the_demo_says_each_runs_error_apart_from_the_hosts_speed():
    from torchpp.demo import RunResult, compute_speed_line

    runs = [RunResult("even", "p", 1.5, 1.05, [1.5], "r", "t", compute_split={"ratio": 1.5, "step_error": -0.02}),
            RunResult("plan", "p", 1.0, 1.0, [1.0], "r", "t")]
    assert compute_speed_line(runs) == ("apart from the hosts' speed (each run priced with its critical path's "
                                        "compute as measured): even -2.0% (compute 1.50x its prediction)")
    assert compute_speed_line(runs[1:]) is None
