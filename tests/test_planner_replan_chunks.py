"""replan after a chunked plan: interleaved (v=2, a data-parallel group), ZBV with tied embeddings and
ZB-H1, each "measured" by `simulate plan` (links model) on a cluster where one host is truly slower
than its profile. The fitted factors recover the slowdown, the old plan re-priced with the corrected
costs equals the measured step, and the memory model is refitted per rank over all its chunks."""
import json
from pathlib import Path

import pytest

from torchpp.cli import main
from torchpp.cost import Links, MemoryEstimator, Profiles, stage_weights
from torchpp.formats import GB, Bandwidth, FormatError, LayersFile, MemoryModel, Plan
from torchpp.planner.replan import fit_host, memory_terms, read_run
from torchpp.cost import device_memory
from torchpp.planner.report import predict
from torchpp.planner.synthetic import layers_file, uniform_links
from torchpp.plans import make_chunked_plan

L = 12
RATE = 1e6
TRUE_MEMORY = MemoryEstimator(5e7, 3.0, 12.0, "truth")
RANGES6 = [(0, 3), (3, 5), (5, 7), (7, 9), (9, 11), (11, 12)]   # uneven chunks

CASES = {
    # schedule, chunk ranges, chunks per device, device groups' sizes, hosts (rank order), slow host
    "interleaved": ("interleaved", RANGES6, 2, [1, 2, 1], ["a", "b", "c", "d"], "b"),
    "zbv-tied": ("zbv", [(0, 2), (2, 5), (5, 6), (6, 8), (8, 11), (11, 12)], 2, [1, 1, 1], ["a", "b", "c"], "a"),
    "zb-h1": ("zb-h1", [(0, 5), (5, 9), (9, 12)], 1, [1, 1, 1], ["a", "b", "c"], "c"),
}


def write_layers(d: Path, speeds: dict[str, float], split: float | None = None,
                 optimizer: float | None = None, split_layer: float | None = None) -> list[Path]:
    d.mkdir(parents=True, exist_ok=True)
    out = []
    for h, s in speeds.items():
        lf = layers_file(h, num_layers=L, speed=s, batch=2, layer_param_bytes=2_000_000,
                         act_bytes_per_sample=20_000, embed_param_bytes=3_000_000, tail_param_bytes=3_100_000,
                         embed_fwd_s=0.1, tail_fwd_s=0.5, fixed_fraction=0.25, tied=True)
        lf.backward_split_factor = split
        lf.backward_split_layer_s = split_layer / s if split_layer else None
        lf.optimizer_s_per_byte = optimizer / s if optimizer else None
        out.append(lf.save(d / f"layers_{h}.json"))
    uniform_links(list(speeds), RATE).save(d / "bandwidth.json")
    return out


def measured_run(tmp: Path, case: str, *, steps=(2, 3), split: float | None = None,
                 optimizer: float | None = None, split_layer: float | None = None) -> tuple[Plan, dict]:
    """The claimed inputs, the plan priced with them, and its "measured" timelines: `simulate plan`
    on the true layers files (the slow host 2x slower), with each rank's peak RSS under TRUE_MEMORY."""
    schedule, ranges, v, groups, hosts, slow = CASES[case]
    claimed = write_layers(tmp / "claimed", {h: 1.0 for h in hosts}, split, optimizer, split_layer)
    true = write_layers(tmp / "true", {h: 0.5 if h == slow else 1.0 for h in hosts}, split, optimizer, split_layer)
    (tmp / "devices.json").write_text(json.dumps({h: 1 for h in hosts}))
    lfs = [LayersFile.load(p) for p in claimed]
    plan = make_chunked_plan(lfs[0].model, seq_len=16, global_batch=8, num_microbatches=4, layer_ranges=ranges,
                             schedule=schedule, chunks_per_device=v, group_sizes=groups, hosts=hosts)
    prof = Profiles.from_layers(lfs)
    plan.predicted, _ = predict(plan, prof, Links(Bandwidth.load(tmp / "claimed" / "bandwidth.json")),
                                MemoryEstimator.analytic(), {h: GB for h in hosts})
    plan.save(tmp / "plan.json")
    peaks = device_memory(plan, prof, TRUE_MEMORY)
    (tmp / "traces").mkdir()
    for n in steps:
        path = tmp / "traces" / f"timeline_step{n}_all.json"
        assert main(["simulate", "plan", str(tmp / "plan.json"), "--bandwidth", str(tmp / "true" / "bandwidth.json"),
                     "--layers", *map(str, true), "--comm", "links", "--trace", str(path)]) == 0
        tr = json.loads(path.read_text())
        for r, md in tr["metadata"]["ranks"].items():
            md["peak_rss_bytes"] = int(peaks[int(r)])
        path.write_text(json.dumps(tr))
    return plan, {"hosts": hosts, "slow": slow, "claimed": claimed}


def replan(tmp: Path, hosts, *extra) -> dict:
    assert main(["replan", "--plan", str(tmp / "plan.json"), "--traces", str(tmp / "traces"), "--layers",
                 *[str(tmp / "claimed" / f"layers_{h}.json") for h in hosts],
                 "--bandwidth", str(tmp / "claimed" / "bandwidth.json"), "--devices", str(tmp / "devices.json"),
                 "--out-dir", str(tmp / "out"), *extra]) == 0
    return json.loads((tmp / "out" / "replan_summary.json").read_text())


@pytest.mark.parametrize("case", list(CASES))
def test_replan_of_a_chunked_plan_recovers_the_slow_host(tmp_path, capsys, case):
    plan, run = measured_run(tmp_path, case)
    assert any(len(plan.stages_of_rank(r)) > 1 for r in plan.ranks) == (case != "zb-h1")
    s = replan(tmp_path, run["hosts"])
    for h, v in s["hosts"].items():
        want = 2.0 if h == run["slow"] else 1.0
        assert v["factor"] == pytest.approx(want, rel=1e-6), h
        assert v["forward_factor"] == pytest.approx(want, rel=1e-6), h
        assert v["backward_factor"] == pytest.approx(want, rel=1e-6), h
        assert v["fit_rms_rel"] < 1e-6
        # every chunk of the host's ranks is listed, and timed: F and B (or I and W) per micro-batch
        chunks = [st for r in v["ranks"] for st in plan.stages_of_rank(r)]
        assert sorted(map(tuple, v["layers"])) == sorted({tuple(st.layers) for st in chunks})
        per_mb = 3 if plan.schedule in ("zbv", "zb-h1") else 2
        assert v["timings"] == 2 * plan.num_microbatches * per_mb * len(chunks)
    old = s["old_plan"]
    assert abs(old["prediction_error"]) > 0.1                     # the claimed profiles were off
    assert old["repriced_step_time_s"] == pytest.approx(old["measured_step_time_s"], rel=1e-6)
    # memory: per rank over all its chunks (the tied weight once), refitted to the truth
    mm = MemoryModel.load(tmp_path / "out" / "memory_model.json")
    assert (mm.base, mm.alpha, mm.Kp) == pytest.approx((TRUE_MEMORY.base, TRUE_MEMORY.alpha, TRUE_MEMORY.kp),
                                                       rel=1e-6)
    for r, v in s["memory"]["ranks"].items():
        assert v["new_predicted_bytes"] == pytest.approx(v["measured_peak_bytes"], rel=1e-6), r
    # the new plan is searched over every schedule kind, gives the slow host no more work and is faster
    new = Plan.load(tmp_path / "out" / "plan.json")
    meta = json.loads((tmp_path / "out" / "plan_meta.json").read_text())
    assert meta["schedule"] == "auto" and new.schedule == meta["chosen_schedule"]
    assert s["work_share"][run["slow"]]["new"] <= s["work_share"][run["slow"]]["old"]
    assert s["new_plan"]["predicted_step_time_s"] < old["repriced_step_time_s"]


def test_memory_terms_of_a_chunked_rank_are_the_planners_peak(tmp_path):
    """base + alpha·W + Kp·K + fixed of each rank is device_memory's prediction (chunks_peak), tied weight once."""
    plan, run = measured_run(tmp_path, "zbv-tied", steps=(2,))
    prof = Profiles.from_layers([LayersFile.load(p) for p in run["claimed"]])
    pred = device_memory(plan, prof, TRUE_MEMORY)
    for r in plan.ranks:
        w, k, fixed, _ = memory_terms(plan, prof, r, TRUE_MEMORY)
        assert TRUE_MEMORY.base + TRUE_MEMORY.alpha * w + TRUE_MEMORY.kp * k + fixed == pytest.approx(pred[r], rel=1e-12)
    first = plan.stages_of_rank(0)
    assert [s.index for s in first] == [0, 5] and first[0].has_embed and first[1].has_tail
    assert memory_terms(plan, prof, 0, TRUE_MEMORY)[0] == pytest.approx(
        sum(float(stage_weights(prof, s)) for s in first) - prof.tied_bytes)


def test_replan_schedule_choice_and_chunk_mismatch(tmp_path, capsys):
    """--schedule restricts the new plan's kinds as `plan --schedule` does; timelines of another
    chunking are refused naming the file and field."""
    plan, run = measured_run(tmp_path, "interleaved", steps=(2,))
    s = replan(tmp_path, run["hosts"], "--schedule", "1f1b")
    assert Plan.load(tmp_path / "out" / "plan.json").schedule == "1f1b" and s["hosts"]["b"]["factor"] > 1.9
    prof = Profiles.from_layers([LayersFile.load(p) for p in run["claimed"]])
    meas = read_run(tmp_path / "traces", plan, prof)
    assert {c.kind for c in meas.compute} == {"F", "B"} and {c.stage for c in meas.compute} == set(range(6))
    fit = fit_host("b", [1], plan, prof, meas)
    assert fit.ranges == [(3, 5), (9, 11)] and len(fit.groups) == 2
    other = make_chunked_plan(plan.model, seq_len=16, global_batch=8, num_microbatches=4,
                              layer_ranges=[(0, 2), (2, 5), (5, 7), (7, 9), (9, 11), (11, 12)],
                              schedule="interleaved", chunks_per_device=2, group_sizes=[1, 2, 1],
                              hosts=run["hosts"])
    with pytest.raises(FormatError, match=r"timeline_step2_all.json.*args\.layers.*\[0, 2\]"):
        read_run(tmp_path / "traces", other, prof)


def test_analyze_of_a_chunked_run_compares_each_ranks_memory_over_all_its_chunks(tmp_path, capsys):
    """`torchpp analyze --plan` of a ZBV run: per rank, measured peak against the plan's prediction
    for all the chunks it holds (the tied weight once); the per-rank table names every chunk."""
    plan, run = measured_run(tmp_path, "zbv-tied", steps=(2,))
    assert main(["analyze", str(tmp_path / "traces"), "--plan", str(tmp_path / "plan.json"),
                 "--out", str(tmp_path / "report")]) == 0
    rep = json.loads((tmp_path / "report" / "report.json").read_text())
    prof = Profiles.from_layers([LayersFile.load(p) for p in run["claimed"]])
    want = device_memory(plan, prof, MemoryEstimator.analytic())
    truth = device_memory(plan, prof, TRUE_MEMORY)
    assert set(rep["memory"]) == {str(r) for r in plan.ranks}
    for r in plan.ranks:
        m = rep["memory"][str(r)]
        assert m["predicted_peak_bytes"] == int(want[r]) and m["measured_peak_bytes"] == int(truth[r])
    md = (tmp_path / "report" / "report.md").read_text()
    assert "| 0 | 0,5 |" in md and "| 2 | 2,3 |" in md


@pytest.mark.parametrize("case", ["zb-h1", "zbv-tied"])
def test_a_measured_split_cost_is_kept_by_the_corrected_files(tmp_path, capsys, case):
    """I and W measured on hosts whose split backward costs 1.3 x one pass: the corrected layers
    files keep the factor, and the per-layer call cost scaled as the host's backward, so the old
    plan re-priced from them still equals the measured step."""
    plan, run = measured_run(tmp_path, case, split=1.3, split_layer=0.004)
    s = replan(tmp_path, run["hosts"])
    for h in run["hosts"]:
        slow = h == run["slow"]
        assert s["hosts"][h]["factor"] == pytest.approx(2.0 if slow else 1.0, rel=1e-6), h
        lf = LayersFile.load(tmp_path / "out" / f"layers_{h}.json")
        assert lf.backward_split_factor == 1.3
        assert lf.backward_split_layer_s == pytest.approx(0.008 if slow else 0.004, rel=1e-6)
    old = s["old_plan"]
    assert old["repriced_step_time_s"] == pytest.approx(old["measured_step_time_s"], rel=1e-6)


def test_the_corrected_files_alone_price_the_old_plan_as_the_replan_did(tmp_path, capsys):
    """With measured optimizer steps: the corrected layers files carry each host's fitted rate, so
    `simulate plan` on them (what a later `plan` or `analyze` reads) gives replan's re-priced step."""
    plan, run = measured_run(tmp_path, "zb-h1", optimizer=5e-8)
    s = replan(tmp_path, run["hosts"])
    out = tmp_path / "out"
    rates = {h: LayersFile.load(out / f"layers_{h}.json").optimizer_s_per_byte for h in run["hosts"]}
    assert rates[run["slow"]] == pytest.approx(2 * 5e-8, rel=1e-3) and all(rates.values()), rates
    capsys.readouterr()
    assert main(["simulate", "plan", str(tmp_path / "plan.json"), "--bandwidth", str(out / "bandwidth.json"),
                 "--layers", *[str(out / f"layers_{h}.json") for h in run["hosts"]], "--comm", "links",
                 "--trace", str(tmp_path / "again.json")]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("predicted step time"))
    old = s["old_plan"]
    assert float(line.split()[3]) == pytest.approx(old["repriced_step_time_s"], abs=2e-6)
    assert old["repriced_step_time_s"] == pytest.approx(old["measured_step_time_s"], rel=1e-6)
