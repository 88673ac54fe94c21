"""capacities, bandwidth, memory-model and devices files: computed right, round-trip, seed forms, errors."""
import json
import statistics

import pytest

from torchpp.cli import main
from torchpp.formats import Bandwidth, Capacities, Devices, FormatError, MemoryModel, MemorySample, GB
from torchpp.planner.bandwidth import parse_links_csv
from torchpp.profiling.calibrate import fit, random_spans, span_sums
from torchpp.planner.capacities import compute_capacities
from torchpp.cost import MemoryEstimator, Profiles
from torchpp.planner.synthetic import layers_file


def test_capacity_is_the_ratio_of_totals_and_tables_kept(tmp_path):
    """Every block both hosts measured (embedding, layers, tail), forward + backward, summed: the
    reference's total over the host's."""
    ref = layers_file("ref", num_layers=3, layer_fwd_s=[1.0, 1.0, 1.0])
    fast = layers_file("fast", num_layers=3, layer_fwd_s=[0.5, 0.25, 0.5])  # embedding and tail as ref's
    for lf in (ref, fast):
        lf.save(tmp_path / f"layers_{lf.host}.json")
    assert main(["capacities", "--inputs", str(tmp_path / "layers_ref.json"), str(tmp_path / "layers_fast.json"),
                 "--ref-host", "ref", "--out", str(tmp_path / "cap.json")]) == 0
    cap = Capacities.load(tmp_path / "cap.json")
    ends = 3 * 0.1 + 3 * 0.5  # embedding and tail, forward + twice that backward, on both
    assert cap.capacity == {"ref": 1.0, "fast": pytest.approx((ends + 3 * 3.0) / (ends + 3 * 1.25))}
    assert cap.tables["fast"].forward_time_s[1:4] == pytest.approx([0.5, 0.25, 0.5])
    assert cap == compute_capacities([ref, fast], "ref")
    # a profile built from capacities alone prices "fast" from its own table, not ref / capacity
    prof = Profiles.from_layers([ref], cap)
    assert prof.table("fast")[0][2] == pytest.approx(0.25 / ref.run.batch)


def test_capacity_weighs_every_batch_size_both_measured():
    """A host as fast as the reference at batch 4 but twice as slow at batch 1: the totals over both
    sizes, (3 + 6) / (6 + 6); a size only one of them measured is left out."""
    ref, slow = layers_file("ref", num_layers=1), layers_file("slow", num_layers=1)
    for b in (ref.embed, ref.tail, slow.embed, slow.tail):
        b.batch_times_s = []
    ref.layers[0].batch_times_s = [[1.0, 1.0, 2.0], [4.0, 2.0, 4.0], [8.0, 3.0, 6.0]]
    slow.layers[0].batch_times_s = [[1.0, 2.0, 4.0], [4.0, 2.0, 4.0]]
    ends = 3 * 0.1 + 3 * 0.5  # embedding and tail at the run's batch, alike on both
    assert compute_capacities([ref, slow], "ref").capacity["slow"] == pytest.approx((ends + 3 + 6) / (ends + 6 + 6))


def test_capacity_needs_a_block_and_size_the_reference_measured():
    ref, other = layers_file("ref", num_layers=1), layers_file("other", num_layers=1)
    for lf, n in ((ref, 1.0), (other, 2.0)):
        for b in (lf.embed, lf.layers[0], lf.tail):
            b.batch_times_s = [[n, b.forward_time_s, b.backward_time_s]]
    with pytest.raises(FormatError, match="layers_other.json"):
        compute_capacities([ref, other], "ref")


def test_capacity_counts_the_backward_too():
    """A host as fast as the reference forward but three times slower backward in its layers is
    slower overall: (ends + 3·(1 + 2)) / (ends + 3·(1 + 6)), not the forward's 1."""
    ref = layers_file("ref", num_layers=3, layer_fwd_s=1.0, layer_bwd_s=2.0)
    odd = layers_file("odd", num_layers=3, layer_fwd_s=1.0, layer_bwd_s=6.0)
    ends = 3 * 0.1 + 3 * 0.5
    assert compute_capacities([ref, odd], "ref").capacity["odd"] == pytest.approx((ends + 9) / (ends + 21))


def _scaled(host, k, num_layers=2):
    """A host whose every block takes ``k`` times layers_file's default."""
    return layers_file(host, num_layers=num_layers, speed=1 / k)


def test_capacity_is_the_median_of_rounds_and_one_slow_reference_is_outvoted(tmp_path):
    """Three rounds of profiles taken together: in the second the reference ran 1.4x slow on its own,
    which alone would put every host 1.4x faster; the median of the rounds keeps each host's speed.
    A round's ratios are taken within it, so a load that slowed every host of a round cancels."""
    rounds = [[_scaled("ref", 1.0), _scaled("pi", 2.0), _scaled("pi3", 3.0)],
              [_scaled("ref", 1.4), _scaled("pi", 2.1), _scaled("pi3", 2.9)],
              [_scaled("ref", 1.5), _scaled("pi", 3.0), _scaled("pi3", 4.5)]]  # all slowed alike: cancels
    paths = []
    for i, fs in enumerate(rounds):
        paths.append([])
        for lf in fs:
            lf.save(f := tmp_path / f"r{i}_{lf.host}.json")
            paths[-1].append(str(f))
    assert main(["capacities", *(a for g in paths for a in ("--inputs", *g)), "--ref-host", "ref",
                 "--out", str(tmp_path / "cap.json")]) == 0
    cap = Capacities.load(tmp_path / "cap.json")
    assert cap.capacity == {"ref": 1.0, "pi": pytest.approx(0.5), "pi3": pytest.approx(1 / 3)}
    assert [r["pi"] for r in cap.rounds] == pytest.approx([0.5, 1.4 / 2.1, 0.5])
    assert cap == Capacities.load(cap.save(tmp_path / "again.json"))
    # one round alone: no rounds recorded, the file as before
    one = compute_capacities(rounds[0], "ref")
    assert one.rounds == [] and "rounds" not in one.to_json()


def test_capacity_rounds_errors(tmp_path):
    first = [_scaled("ref", 1.0), _scaled("pi", 2.0)]
    with pytest.raises(FormatError, match="reference host 'ref'"):
        compute_capacities(first, "ref", again=[([_scaled("pi", 2.0)], ["b_pi.json"])])
    with pytest.raises(FormatError, match="b_new.json.*first round"):
        compute_capacities(first, "ref", again=[([_scaled("ref", 1.0), _scaled("new", 2.0)], ["b_ref.json", "b_new.json"])])
    with pytest.raises(FormatError, match="b_pi2.json.*already in this round"):
        compute_capacities(first, "ref", again=[([_scaled("ref", 1.0), _scaled("pi", 2.0), _scaled("pi", 2.0)],
                                                 ["b_ref.json", "b_pi.json", "b_pi2.json"])])
    other = _scaled("pi", 2.0)
    other.run.seq_len += 1
    with pytest.raises(FormatError, match="b_pi.json.*run.seq_len"):
        compute_capacities(first, "ref", again=[([_scaled("ref", 1.0), other], ["b_ref.json", "b_pi.json"])])
    # a round may profile fewer layers than the first (the same blocks are compared)
    cap = compute_capacities(first, "ref", again=[([_scaled("ref", 1.0, 1), _scaled("pi", 2.0, 1)], ["a", "b"])])
    assert cap.capacity["pi"] == pytest.approx(0.5)
    f = tmp_path / "c.json"
    f.write_text(json.dumps({**cap.to_json(), "rounds": [{"ref": 1.0, "zz": 0.5}]}))
    with pytest.raises(FormatError, match=r"rounds\[0\]\.zz"):
        Capacities.load(f)
    f.write_text(json.dumps({**cap.to_json(), "rounds": [{"ref": 1.0, "pi": -0.5}]}))
    with pytest.raises(FormatError, match=r"rounds\[0\]\.pi"):
        Capacities.load(f)


def test_capacities_seed_form_and_errors(tmp_path):
    f = tmp_path / "capacities.json"
    f.write_text(json.dumps({"ref_host": "cpu1", "capacity": {"cpu1": 1.0, "cpu2": 0.8}}))
    cap = Capacities.load(f)
    assert cap.capacity["cpu2"] == 0.8 and cap.tables == {}
    cap.save(tmp_path / "again.json")
    assert Capacities.load(tmp_path / "again.json") == cap
    f.write_text(json.dumps({"ref_host": "cpu1", "capacity": {"cpu1": 1.0, "cpu2": -1}}))
    with pytest.raises(FormatError, match="capacity.cpu2"):
        Capacities.load(f)
    with pytest.raises(FormatError, match="ref_host"):
        compute_capacities([layers_file("a")], "zzz")


def test_bandwidth_csv(tmp_path):
    csv = tmp_path / "links.csv"
    csv.write_text("cpu1,cpu2,8\ncpu2,cpu1,4\ncpu1,cpu2,16\n")
    bw = parse_links_csv(csv)
    assert bw.rate("cpu1", "cpu2") == pytest.approx(12e9 / 8)  # repeated rows averaged
    assert bw.rate("cpu2", "cpu1") == pytest.approx(0.5e9)
    assert main(["bandwidth", "parse", "--csv", str(csv), "--out", str(tmp_path / "bw.json")]) == 0
    assert Bandwidth.load(tmp_path / "bw.json") == bw


def test_bandwidth_missing_pairs_named_unless_symmetric(tmp_path, capsys):
    csv = tmp_path / "links.csv"
    csv.write_text("a,b,1\nb,c,2,0.5\n")
    with pytest.raises(FormatError) as e:
        parse_links_csv(csv)
    for pair in ("b->a", "a->c", "c->a", "c->b"):
        assert pair in str(e.value)
    assert main(["bandwidth", "parse", "--csv", str(csv), "--out", str(tmp_path / "x.json")]) == 2
    assert "missing" in capsys.readouterr().err
    csv.write_text("a,b,1\nb,c,2,0.5\na,c,3\n")
    bw = parse_links_csv(csv, assume_symmetric=True)
    assert bw.rate("c", "b") == bw.rate("b", "c") and bw.latency("c", "b") == pytest.approx(5e-4)
    csv.write_text("a,b,fast\n")
    with pytest.raises(FormatError, match="line 1"):
        parse_links_csv(csv)


def test_bandwidth_seed_matrix_form(tmp_path):
    f = tmp_path / "bandwidth_matrix.json"
    f.write_text(json.dumps({"cpu1|cpu2": 1.2e9, "cpu2|cpu1": 1.1e9}))
    bw = Bandwidth.load(f)
    assert bw.rate("cpu2", "cpu1") == 1.1e9
    f.write_text(json.dumps({"format": "torchpp.bandwidth/1", "bytes_per_sec": {"cpu1|cpu2": -5}}))
    with pytest.raises(FormatError, match=r"bytes_per_sec.cpu1\|cpu2"):
        Bandwidth.load(f)


def test_devices_both_forms(tmp_path):
    f = tmp_path / "devices.json"
    f.write_text(json.dumps({"cpu1": 24, "cpu2": 0.5}))
    d = Devices.load(f)
    assert d.memory_bytes("cpu1") == 24 * GB and d.hosts == ["cpu1", "cpu2"]
    f.write_text(json.dumps({"pi1": {"memory_gb": 4, "address": "10.0.0.2", "rank": 1},
                             "pi2": {"memory_gb": 8, "address": "10.0.0.3", "rank": 0}}))
    d = Devices.load(f)
    assert d.devices["pi1"].address == "10.0.0.2" and d.devices["pi2"].rank == 0
    d.save(tmp_path / "again.json")
    assert Devices.load(tmp_path / "again.json") == d
    f.write_text(json.dumps({"pi1": {"memory_gb": -4}}))
    with pytest.raises(FormatError, match="pi1.memory_gb"):
        Devices.load(f)


def test_memory_fit_recovers_coefficients_and_round_trips(tmp_path):
    base, alpha, kp = 3e8, 4.0, 12.0
    rows = [MemorySample(start=s, end=e, has_embed=False, has_tail=False, weights_bytes=int(w), activation_bytes_per_sample=int(a),
                         batch=b, peak_bytes=int(base + alpha * w + kp * a * b))
            for s, e, w, a, b in [(0, 1, 1e6, 1e4, 4), (0, 2, 2e6, 2e4, 4), (1, 4, 3e6, 3e4, 2), (2, 3, 1e6, 5e4, 8)]]
    mm = fit(rows)
    assert (mm.base, mm.alpha, mm.Kp) == pytest.approx((base, alpha, kp), rel=1e-6)
    assert mm.r2 == pytest.approx(1.0) and max(abs(r) for r in mm.residuals) < 1.0
    mm.save(tmp_path / "mm.json")
    assert MemoryModel.load(tmp_path / "mm.json") == mm
    (tmp_path / "seed.json").write_text(json.dumps({"base": 1.0, "alpha": 2.0, "Kp": 3.0}))
    seed = MemoryEstimator.fitted(MemoryModel.load(tmp_path / "seed.json"))
    assert seed.peak(10, 100, 0.0, 2, 3) == 1 + 20 + 3 * 100 * 2 * 3


def test_memory_fit_separates_the_tail_factor(tmp_path):
    """Spans with and without the tail: the logits' own factor Kt is recovered beside Kp, and
    the planner's per-block activations weight the tail by Kt / Kp."""
    import numpy as np


    base, alpha, kp, kt = 1e8, 4.0, 30.0, 1.5
    spans = [(0, 1, 1e6, 1e4, 0, 2), (0, 2, 2e6, 2e4, 0, 8), (1, 4, 3e6, 3e4, 0, 2), (2, 4, 5e6, 1e4 + 3e5, 3e5, 8),
             (3, 4, 4e6, 5e3 + 3e5, 3e5, 2), (1, 3, 2e6, 2e4, 0, 8)]
    rows = [MemorySample(start=s, end=e, has_embed=False, has_tail=t > 0, weights_bytes=int(w),
                         activation_bytes_per_sample=int(a), tail_activation_bytes_per_sample=int(t), batch=b,
                         peak_bytes=int(base + alpha * w + b * (kp * (a - t) + kt * t)))
            for s, e, w, a, t, b in spans]
    mm = fit(rows)
    assert (mm.base, mm.alpha, mm.Kp, mm.Kt) == pytest.approx((base, alpha, kp, kt), rel=1e-5)
    mm.save(tmp_path / "mm.json")
    assert MemoryModel.load(tmp_path / "mm.json").Kt == pytest.approx(kt)
    est = MemoryEstimator.fitted(mm)
    acts = est.activations(np.array([1.0, 2.0, 2.0, 10.0]))
    # the embedding's output counts 0 (the first layer keeps it as its input), the tail's by Kt / Kp
    assert list(acts) == pytest.approx([0.0, 2.0, 2.0, 10.0 * kt / kp])
    kept = float(est.activations(np.array([5e3, 1e4, 3e5])).sum())  # the embedding, a decoder layer and the tail
    assert est.peak(1e6, kept, 0.0, 4, 1) == pytest.approx(base + alpha * 1e6 + 4 * (kp * 1e4 + kt * 3e5))
    # without tail spans there is nothing to tell Kt apart: one factor, as before
    assert fit([r for r in rows if not r.has_tail]).Kt is None


def test_random_spans_distinct_and_sums():
    spans = random_spans(8, 10, seed=1)
    assert len(set(spans)) == 10 and all(0 <= s < e <= 8 for s, e in spans)
    assert len({e - s for s, e in spans}) >= 5
    assert sum(e == 8 for _, e in spans) >= 3  # a third end with the tail, for Kt
    assert sum(e == 8 for _, e in random_spans(8, 4, seed=2)) >= 2
    lf = layers_file("a", num_layers=4, layer_param_bytes=[1, 2, 3, 4], embed_param_bytes=100, tail_param_bytes=1000)
    assert span_sums(lf, 0, 2)[:3] == (103, 2 * 64, True)  # the embedding's output is the first layer's input
    assert span_sums(lf, 3, 4) == (1004, 2 * 64, False, True, 64)


@pytest.mark.timeout(240)
def test_calibrate_memory_end_to_end_in_subprocesses(tmp_path):
    """Three spans of the tiny preset, each in a fresh process; the file carries samples and fit."""
    lf = layers_file("local", num_layers=4, layer_param_bytes=4 * 50_000, embed_param_bytes=4 * 32_768,
                     tail_param_bytes=4 * 32_832, act_bytes_per_sample=16 * 64 * 4, seq_len=16)
    lf.model.name = "qwen3-tiny"
    lf.save(tmp_path / "layers_local.json")
    out = tmp_path / "memory_model.json"
    assert main(["calibrate-memory", "--layers", str(tmp_path / "layers_local.json"), "--model", "qwen3-tiny",
                 "--samples", "3", "--microbatch", "2,8", "--out", str(out)]) == 0
    mm = MemoryModel.load(out)
    assert len(mm.samples) == 3 and len(mm.residuals) == 3
    assert [s.batch for s in mm.samples] == [2, 8, 2] and mm.microbatch == 8  # sizes taken in turn
    assert all(s.process_bytes > 50 * 2**20 for s in mm.samples)  # the runtime itself, recorded apart
    assert mm.process_bytes == sorted(s.process_bytes for s in mm.samples)[1]
    assert all(s.peak_bytes > 0 for s in mm.samples)
    assert min(mm.base, mm.alpha, mm.Kp) >= 0


@pytest.mark.timeout(240)
def test_memory_probe_counts_optimizer_moments_beside_activations():
    """A training rank's backward runs beside AdamW's two moments, which exist only after the
    first step: the probe's peak over three steps exceeds a one-step peak by about 2 × weights."""
    import subprocess
    import sys

    def peak(steps: int) -> dict:
        out = subprocess.run([sys.executable, "-m", "torchpp.profiling.memory_probe", "--model", "qwen3-small",
                              "--start", "2", "--end", "5", "--batch", "8", "--seq-len", "64", "--steps", str(steps)],
                             capture_output=True, text=True, timeout=200, check=True).stdout
        return json.loads(out.strip().splitlines()[-1])

    one, three = peak(1), peak(3)
    weights = 3 * 3_148_288  # three qwen3-small decoder layers, fp32
    assert three["steps"] == 3 and one["steps"] == 1
    assert three["peak_bytes"] - one["peak_bytes"] >= 1.0 * weights, (one, three)


def test_peak_rss_counts_from_the_base_not_from_start_up():
    """A transient peak before the base (imports, config loading) must not be read as the
    stage's: ``mark_base_rss`` resets the kernel's high-water mark (in a fresh process)."""
    import os
    import subprocess
    import sys

    code = (
        "from torchpp.runtime import tracing\n"
        "x = bytearray(400 * 2**20); x[::4096] = b'1' * len(x[::4096]); del x\n"
        "before = tracing.peak_rss_bytes()\n"
        "tracing.mark_base_rss()\n"
        "import psutil; rss = psutil.Process().memory_info().rss\n"
        "print(before, tracing.peak_rss_bytes(), rss)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    before, after, rss = map(int, out.stdout.split())
    if not os.path.exists("/proc/self/clear_refs"):
        pytest.skip("no /proc/self/clear_refs: the high-water mark cannot be reset here")
    assert before > rss + 300 * 2**20 and after < rss + 50 * 2**20, (before, after, rss)


def _save_rounds(tmp_path, rounds):
    paths = []
    for i, fs in enumerate(rounds):
        paths.append([])
        for lf in fs:
            lf.save(f := tmp_path / f"r{i}_{lf.host}.json")
            paths[-1].append(str(f))
    return [a for g in paths for a in ("--inputs", *g)]


def test_a_round_far_from_the_median_is_reported_and_the_consensus_is_the_median_round(tmp_path, capsys):
    """pi3 as the demo once read it (0.411, 0.019, 0.228 of the reference): the middle round is the
    consensus, both others are reported as outliers and the host's rounds agree only within ~92%;
    pi's rounds, within 4% of each other, agree, and nothing of it is reported."""
    rounds = [[_scaled("ref", 1.0), _scaled("pi", 2.0), _scaled("pi3", 1 / 0.411)],
              [_scaled("ref", 1.0), _scaled("pi", 2.08), _scaled("pi3", 1 / 0.019)],
              [_scaled("ref", 1.0), _scaled("pi", 1.98), _scaled("pi3", 1 / 0.228)]]
    assert main(["capacities", *_save_rounds(tmp_path, rounds), "--ref-host", "ref",
                 "--out", str(tmp_path / "cap.json")]) == 0
    out = capsys.readouterr().out
    cap = Capacities.load(tmp_path / "cap.json")
    assert cap.capacity["pi3"] == pytest.approx(0.228)
    assert cap.consensus_round == {"ref": 1, "pi": 0, "pi3": 2}  # ref: three equal rounds, the middle one
    assert cap.agreement["pi3"] == pytest.approx(1 - 0.019 / 0.228)
    assert cap.agreement["pi"] == pytest.approx(1 - 2.0 / 2.08)
    assert sorted((o.host, o.round) for o in cap.outliers) == [("pi3", 0), ("pi3", 1)]
    assert all(o.median == pytest.approx(0.228) and o.tolerance == pytest.approx(0.10) for o in cap.outliers)
    assert "outlier: pi3 round 2: 0.019 is -92% from its median 0.228" in out
    assert "pi3" in out and "round 3)" in out
    assert cap == Capacities.load(cap.save(tmp_path / "again.json"))


def test_a_slow_reference_round_is_reported_through_the_other_hosts():
    """The reference's ratio is 1 in every round and its absolute speed is not judged (a busier
    machine slows every host of a round alike): a round in which it alone ran 1.4x slow shows as that
    round's outlier in every other host; its consensus is the round of its median speed."""
    rounds = [[_scaled("ref", 1.0), _scaled("pi", 2.0)], [_scaled("ref", 1.4), _scaled("pi", 2.0)],
              [_scaled("ref", 1.02), _scaled("pi", 2.04)]]
    cap = compute_capacities(rounds[0], "ref", again=[(fs, [f"r{i}_{lf.host}" for lf in fs])
                                                      for i, fs in enumerate(rounds[1:], 1)])
    assert cap.consensus_round["ref"] == 2 and cap.agreement["ref"] == 0.0
    assert [(o.host, o.round) for o in cap.outliers] == [("pi", 1)]
    assert cap.outliers[0].value == pytest.approx(0.7) and cap.outliers[0].median == pytest.approx(0.5)


def test_round_tolerance_widens_with_the_profiles_spread():
    """A profile whose steps scatter widely explains a wider disagreement: 3 standard errors of the
    two profiles' step times combined, never below 10%."""
    from torchpp.planner.capacities import MIN_TOLERANCE, relative_error, round_tolerance

    steady, noisy = _scaled("ref", 1.0), _scaled("pi", 2.0)
    for b in (noisy.embed, *noisy.layers, noisy.tail):
        b.forward_samples_s = [b.forward_time_s * k for k in (0.5, 1.5, 0.5, 1.5)]
        b.backward_samples_s = [b.backward_time_s * k for k in (0.5, 1.5, 0.5, 1.5)]
    for b in (steady.embed, *steady.layers, steady.tail):
        b.forward_samples_s, b.backward_samples_s = [b.forward_time_s] * 4, [b.backward_time_s] * 4
    assert relative_error(steady) == 0.0
    cv = statistics.stdev([0.5, 1.5, 0.5, 1.5]) / 2  # relative standard error of 4 steps
    assert relative_error(noisy) == pytest.approx(cv)
    assert round_tolerance(steady, noisy) == pytest.approx(3 * cv)
    assert round_tolerance(steady, steady) == MIN_TOLERANCE


def test_capacities_round_judgement_errors(tmp_path):
    rounds = [[_scaled("ref", 1.0), _scaled("pi", 2.0)], [_scaled("ref", 1.0), _scaled("pi", 2.0)]]
    cap = compute_capacities(rounds[0], "ref", again=[(rounds[1], ["a", "b"])])
    f = tmp_path / "c.json"
    for key, bad, where in (("consensus_round", {"pi": 2}, r"consensus_round\.pi"),
                            ("consensus_round", {"zz": 0}, r"consensus_round\.zz"),
                            ("agreement", {"pi": -1}, r"agreement\.pi"),
                            ("outliers", [{"host": "zz", "round": 0, "value": 1, "median": 1, "tolerance": 0.1}],
                             r"outliers\[0\]\.host")):
        f.write_text(json.dumps({**cap.to_json(), key: bad}))
        with pytest.raises(FormatError, match=where):
            Capacities.load(f)
