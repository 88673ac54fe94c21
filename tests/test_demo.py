"""`torchpp demo` end to end at a reduced size: every artefact exists and reads back valid."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from torchpp.demo import cluster_available
from torchpp.formats import Bandwidth, Capacities, LayersFile, Plan, read_json

ROOT = Path(__file__).resolve().parents[1]


def run_demo(out: Path, *extra: str, timeout: float = 900) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "torchpp", "demo", "--quick", "--out", str(out), *extra], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=timeout)


def test_demo_refuses_what_is_not_a_prepared_corpus_before_any_host_starts(tmp_path):
    (tmp_path / "a.txt").write_text("raw text")
    res = run_demo(tmp_path / "demo", "--local", "--data", str(tmp_path / "a.txt"), timeout=120)
    assert res.returncode == 2 and "--data" in res.stderr and "torchpp data prepare" in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and not (tmp_path / "demo").exists()


def check_artefacts(out: Path, hosts: list[str]) -> dict:
    for h in hosts:
        lf = LayersFile.load(out / "hosts" / f"layers_{h}.json")
        assert lf.host == h and lf.run.batches == [1, 2, 8]
    cap = Capacities.load(out / "capacities.json")
    assert set(cap.capacity) == set(hosts)
    bw = Bandwidth.load(out / "bandwidth" / "bandwidth.json")
    assert all(bw.has(a, b) for a in hosts for b in hosts if a != b)
    mm = read_json(out / "memory_model.json")
    assert mm["format"].startswith("torchpp.memory_model/")
    summary = json.loads((out / "summary.json").read_text())
    assert [r["name"] for r in summary["runs"]] == ["even", "plan", "replan"]
    for r in summary["runs"]:
        plan = Plan.load(r["plan"])
        assert {d.host for s in plan.stages for d in s.devices} <= set(hosts)
        assert r["measured_step_s"] > 0 and r["predicted_step_s"] > 0 and len(r["steps_s"]) >= 1
        traces = Path(r["trace_dir"])
        merged = sorted(traces.glob("timeline_step*_all.json"))
        assert merged, traces
        assert json.loads(merged[0].read_text())["traceEvents"]
        report = Path(r["report"]).parent
        rep = json.loads((report / "report.json").read_text())
        assert rep["step_time_error"] == pytest.approx(
            (rep["predicted_step_time_s"] - rep["step_time_s"]) / rep["step_time_s"])
        for png in ("gantt.png", "stages.png"):
            assert (report / png).read_bytes()[:4] == b"\x89PNG"
        assert (traces.parent / "predicted.json").exists()
        # every run, the even baseline too, is priced for memory and compared rank by rank
        assert sorted(x["rank"] for x in r["memory_mib"]) == list(range(plan.world_size)), r["memory_mib"]
        assert r["memory_error"] == max((x["error"] for x in r["memory_mib"]), key=abs)
        # what bench_fidelity reads for its "MAPE at launch": written, even where no speed check ran
        now = r["predicted_now_s"]
        assert r["error_now"] == (None if now is None else pytest.approx(now / r["measured_step_s"] - 1))
    for f in ("plan.json", "summary.txt", "gantt.png", "stages.csv"):
        assert (out / "plan" / f).exists(), f
    assert (out / "replan" / "plan.json").exists() and (out / "replan" / "replan_summary.txt").exists()
    table = (out / "summary.md").read_text()
    assert "| even |" in table and "| plan |" in table and "| replan |" in table
    assert "| lower bound (all work incl. the optimizer over all capacity) |" in table and "\nwhy: " in table
    assert "\nabove the bound (predicted; each part taken out of the same replay in turn): " in table
    assert [b["name"].split()[0] for b in summary["baselines"]] == ["single", "dp"]
    assert summary["lower_bound_s"] > 0
    # the plan certified: a bound on every plan of the space, so at most the plan's own predicted step
    cert = summary["certificate"]
    planned = Plan.load(out / "plan" / "plan.json").predicted["step_time_s"]
    assert 0 < cert["bound_s"] <= cert["step_s"] == pytest.approx(planned)
    assert "| best plan of the planner's space, proven at least |" in table
    said = (f"\ncertificate: the plan's predicted {cert['step_s']:.3f} s is the best of the space" if cert["gap"] <= 0
            else f"\ncertificate: the plan's predicted {cert['step_s']:.3f} s is within {100 * cert['gap']:.1f}%")
    assert said in table
    return summary


def test_windows_and_the_closing_lines():
    from torchpp.demo import Baseline, window_medians, why_line
    from torchpp.planner.simple import even_plan
    from torchpp.formats import ModelInfo

    assert window_medians([1, 2, 3, 4, 5, 6, 7]) == [2, 4.5, 6.5] and window_medians([3.0]) == [3.0]
    info = ModelInfo(name="m", source="preset", num_layers=4, hidden_size=8, vocab_size=16, tied_embeddings=False)
    p = even_plan(info, stages=2, hosts=["a", "b"], seq_len=8, global_batch=8, num_microbatches=4)
    single = Baseline(name="single (a)", predicted_step_s=None, fits=False, memory="9 GiB/1 GiB (a)")
    line = why_line(p, [single])
    assert line.startswith("no single host can hold the model with AdamW (9 GiB/1 GiB (a)), so it is split")
    assert "a layers [0,2) + embedding; b layers [2,4) + lm_head" in line and "4 micro-batches of 2" in line


def test_the_closing_table_shows_the_prediction_at_launch(tmp_path):
    """With speed checks, each run's prediction at launch and its error sit beside the profile's,
    and the hosts' ratios are said under the table; without, the table has no such column."""
    from torchpp.demo import DemoConfig, RunResult, summary_lines
    from torchpp.formats import ModelInfo
    from torchpp.planner.simple import even_plan

    info = ModelInfo(name="m", source="preset", num_layers=4, hidden_size=8, vocab_size=16, tied_embeddings=False)
    p = even_plan(info, stages=2, hosts=["a", "b"], seq_len=8, global_batch=8, num_microbatches=4)
    p.save(tmp_path / "plan.json")

    def run(name, now=None, speed=None):
        return RunResult(name=name, plan=str(tmp_path / "plan.json"), measured_step_s=2.0, predicted_step_s=1.8,
                         steps_s=[2.0, 2.0, 2.0], report="", trace_dir="", predicted_now_s=now, speed_now=speed or {})

    lines = summary_lines(DemoConfig(), "m", ["a", "b"], [run("plan", 2.1, {"a": 1.12, "b": 0.97})], [], p)
    head = next(x for x in lines if x.startswith("| run |"))
    row = next(x for x in lines if x.startswith("| plan |"))
    assert "| error | at launch (error) |" in head and len(head.split("|")) == len(row.split("|"))
    assert "| 1.800 | -10.0% | 2.100 (+5.0%) |" in row
    assert lines[-1].startswith("at launch:") and "plan: a x1.12, b x0.97" in lines[-1]
    plain = summary_lines(DemoConfig(), "m", ["a", "b"], [run("plan")], [], p)
    assert not any("at launch" in x for x in plain)


def test_a_replan_slower_than_its_plan_is_said(tmp_path):
    """Under the table: the re-plan's measured step against the plan's, with the gain it predicted
    (its replan_summary.json) and both runs' spread; slower is said in words."""
    from torchpp.demo import RunResult, replan_line

    (tmp_path / "replan").mkdir()
    (tmp_path / "replan" / "replan_summary.json").write_text(json.dumps({"predicted_gain": 0.078}))

    def run(name, step, plan):
        return RunResult(name=name, plan=str(plan), measured_step_s=step, predicted_step_s=None,
                         steps_s=[step] * 6, report="", trace_dir="")

    old, slow = run("plan", 1.670, tmp_path / "plan.json"), run("replan", 1.886, tmp_path / "replan" / "plan.json")
    line = replan_line([run("even", 3.7, tmp_path / "e.json"), old, slow])
    assert line.startswith("re-plan: measured 1.886 s against the plan's 1.670 s (+12.9%), slower than the plan it "
                           "replaced: its corrected costs misjudged the new layout")
    assert "it predicted +7.8% throughput" in line and "step spread 0% and 0%" in line
    fast = replan_line([old, run("replan", 1.6, tmp_path / "elsewhere" / "plan.json")])
    assert "(-4.2%), faster than the plan it replaced; the two runs'" in fast  # no summary: no prediction
    assert replan_line([old]) is None
    (tmp_path / "replan" / "replan_summary.json").write_text(json.dumps({
        "predicted_gain": 0.0, "plan_choice": "plan kept: the best plan found is predicted +0.1% throughput"}))
    kept = replan_line([old, run("replan", 1.7, tmp_path / "replan" / "plan.json")])
    assert kept.startswith("re-plan: plan kept: the best plan found is predicted +0.1% throughput; the same plan "
                           "measured 1.700 s against 1.670 s (+1.8%: the runs' own noise")


def test_step_times_are_the_last_runs_only(tmp_path):
    """The trainer appends to metrics.jsonl: an earlier run's steps in the same file are left out."""
    from torchpp.demo import measured_step_times

    rows = [{"event": "start"}, *({"step": i, "step_time_s": 0.05} for i in (1, 2, 3)),
            {"event": "start"}, *({"step": i, "step_time_s": 2.0 + i / 100} for i in (1, 2, 3))]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert measured_step_times(tmp_path) == [2.02, 2.03]


def test_run_verdict_reads_the_oom_line(tmp_path):
    from torchpp.demo import run_verdict

    why = "rank 0 on host laptop was killed by the kernel for exceeding its memory limit (1.00 GiB)"
    (tmp_path / "run.json").write_text(json.dumps({"hosts": [{"returncode": -9, "why": why}]}))
    assert run_verdict(tmp_path / "run.json", "") == why
    (tmp_path / "run.json").write_text(json.dumps({"hosts": [{"returncode": 0, "why": None}]}))
    assert run_verdict(tmp_path / "run.json", "").startswith("it ran")
    (tmp_path / "run.json").write_text(json.dumps({"hosts": [{"returncode": 1, "why": None}]}))
    assert "exit 1" in run_verdict(tmp_path / "run.json", "boom\n")


@pytest.mark.slow
def test_demo_on_local_processes(tmp_path):
    """On a prepared corpus (UTF-8 bytes as ids): its runs train on it, checked before any host starts."""
    from torchpp.data import prepare_corpus

    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "a.txt").write_text("the demo reads a corpus of its user's own. " * 400)
    prepare_corpus([tmp_path / "text"], tmp_path / "corpus", tokenizer="bytes", num_proc=1)
    out = tmp_path / "demo"
    res = run_demo(out, "--local", "--data", str(tmp_path / "corpus"))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "not using the emulated cluster (--local was given)" in res.stdout
    assert f"on corpus {tmp_path / 'corpus'}" in res.stdout
    runs = [head for head in (p.read_text().splitlines()[0] for p in (out / "logs").iterdir()) if "torchpp.train" in head]
    assert runs and all("--data " + str(tmp_path / "corpus") in head for head in runs), runs
    bench = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_corpus_cluster.py"), "--quick", "--demo",
                            str(out), "--corpus", str(tmp_path / "corpus")], cwd=ROOT, capture_output=True, text=True,
                           timeout=900, env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)})
    assert bench.returncode == 0, bench.stdout[-3000:] + bench.stderr[-3000:]
    assert "corpus / synthetic tokens/s (medians of 2 runs each): " in bench.stdout, bench.stdout[-3000:]
    assert "[16/16]" in res.stdout  # numbered progress through every step
    summary = check_artefacts(out, ["local0", "local1"])
    assert summary["mode"] == "local processes"


@pytest.mark.slow
@pytest.mark.root
@pytest.mark.skipif(cluster_available() is not None, reason=f"emulated cluster unavailable: {cluster_available()}")
def test_demo_on_the_emulated_cluster(tmp_path):
    from torchpp.cluster import cluster

    if cluster.load_state("homelab") is not None or cluster.leftovers("homelab")["namespaces"]:
        pytest.skip("cluster homelab is up on this machine; not touching it")
    out = tmp_path / "demo"
    try:
        res = run_demo(out, timeout=1500)  # noqa: the demo brings homelab (the default scenario) up and down itself
    finally:
        left = cluster.leftovers("homelab")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert not left["namespaces"], left  # the demo took its cluster down
    summary = check_artefacts(out, ["laptop", "pi4a", "pi4b", "pi3"])
    assert summary["mode"] == "emulated cluster homelab"


@pytest.mark.slow
@pytest.mark.root
@pytest.mark.skipif(cluster_available() is not None, reason=f"emulated cluster unavailable: {cluster_available()}")
def test_a_terminated_demo_takes_its_cluster_down(tmp_path):
    """SIGTERM while the demo's hosts profile: the demo ends and removes the cluster it brought up
    (before, it died with namespaces and cgroups left, and the next demo refused to start)."""
    import signal
    import time

    from torchpp.cluster import cluster

    if cluster.load_state("homelab") is not None or cluster.leftovers("homelab")["namespaces"]:
        pytest.skip("cluster homelab is up on this machine; not touching it")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "torchpp", "demo", "--quick", "--out", str(tmp_path / "demo")],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        seen = []
        deadline = time.monotonic() + 300
        for line in proc.stdout:  # the cluster is up once the profile step starts
            seen.append(line)
            if "profile" in line and line.rstrip().endswith("...") or time.monotonic() > deadline:
                break
        assert cluster.load_state("homelab") is not None, "".join(seen)[-2000:]
        time.sleep(2)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
        left = cluster.leftovers("homelab")
        assert cluster.load_state("homelab") is None and not left["namespaces"], (left, "".join(seen)[-2000:])
        assert proc.returncode != 0
    finally:
        proc.kill()
        proc.wait()
        if cluster.load_state("homelab") is not None or cluster.leftovers("homelab")["namespaces"]:
            cluster.down("homelab", log=lambda *_: None)
