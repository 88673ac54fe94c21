"""The heap a device's chunks leave (the memory model's ``Kc``): once per chunk beyond a device's
first, in every consumer's price of a rank (``device_memory``), none on a one-chunk rank, and the
larger of it and a split backward's ``Kz`` heap where both apply; ``memory_model.json`` keeps it."""
from dataclasses import replace

import pytest

from torchpp.cost import MemoryEstimator, Profiles, StageMemory, device_memory
from torchpp.formats import FormatError, MemoryModel
from torchpp.planner.synthetic import layers_file
from torchpp.plans import make_chunked_plan

L = 8
KC = 20 * 2**20
EST = MemoryEstimator(1.5e7, 4.3, 23.0, "test", kt=3.6, kb=6.7, kl=23.8)


def _plan(schedule: str, ranges, v: int, hosts):
    lf = layers_file("a", num_layers=L, batch=4, layer_param_bytes=7_000_000, act_bytes_per_sample=49_152,
                     embed_param_bytes=25_000_000, tail_param_bytes=25_000_000)
    plan = make_chunked_plan(lf.model, seq_len=32, global_batch=32, num_microbatches=8, layer_ranges=ranges,
                             schedule=schedule, chunks_per_device=v, group_sizes=[1] * (len(ranges) // v),
                             hosts=hosts)
    return plan, Profiles.from_layers([replace(lf, host=h) for h in sorted(set(hosts))])


EIGHT = [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5), (5, 6), (6, 7), (7, 8)]


@pytest.mark.parametrize("schedule", ["interleaved", "v"])
def test_each_chunk_beyond_a_devices_first_adds_kc_once(schedule):
    """Two chunks on each of 4 ranks: every rank's price moves by exactly Kc, whatever it holds."""
    plan, prof = _plan(schedule, EIGHT, 2, ["a", "b", "c", "d"])
    before, after = device_memory(plan, prof, EST), device_memory(plan, prof, replace(EST, kc=KC))
    assert set(before) == {0, 1, 2, 3}
    for r in before:
        assert len(plan.stages_of_rank(r)) == 2
        assert after[r] - before[r] == pytest.approx(KC)


def test_one_chunk_devices_hold_no_chunk_heap():
    """1F1B on 4 ranks (one chunk each): Kc changes nothing."""
    plan, prof = _plan("1f1b", [(0, 2), (2, 4), (4, 6), (6, 8)], 1, ["a", "b", "c", "d"])
    assert device_memory(plan, prof, replace(EST, kc=KC)) == device_memory(plan, prof, EST)


def test_three_chunks_pay_it_twice():
    """Interleaved with 4 chunks on 2 ranks (two chunks each) and the same 8 layers as 4 chunks on
    2 ranks: Kc per chunk beyond the first."""
    ranges = [(0, 2), (2, 4), (4, 6), (6, 8)]
    plan, prof = _plan("interleaved", ranges, 2, ["a", "b"])
    mem = StageMemory(prof, EST)
    kc = StageMemory(prof, replace(EST, kc=KC))
    for r in plan.ranks:
        chunks = [(c, c.device(r).samples) for c in plan.stages_of_rank(r)]
        held = [[(c.index, 2)] for c, _ in chunks]
        for k in (1, 2):
            assert kc.chunks_peak(chunks[:k], held) - mem.chunks_peak(chunks[:k], held) == pytest.approx(KC * (k - 1))
    est = replace(EST, kc=KC)
    assert est.chunks_heap(3) == pytest.approx(2 * KC)


def test_a_split_backward_device_holds_the_larger_heap():
    """ZBV: the Kz heap of a chunk past its I and the chunks' Kc are one heap beyond the live
    tensors; the device holds the larger, not both."""
    plan, prof = _plan("zbv", EIGHT, 2, ["a", "b", "c", "d"])
    base = replace(EST, kw=-8.0)
    with_kz = replace(base, kz=30.0)
    kz_only, kc_only = device_memory(plan, prof, with_kz), device_memory(plan, prof, replace(base, kc=KC))
    none, both = device_memory(plan, prof, base), device_memory(plan, prof, replace(with_kz, kc=KC))
    for r in none:
        kz_heap = kz_only[r] - none[r]
        assert kz_heap > 0 or plan.stages_of_rank(r)[0].has_embed
        assert kc_only[r] - none[r] == pytest.approx(KC)
        assert both[r] - none[r] == pytest.approx(max(kz_heap, KC))


def test_the_file_keeps_kc_and_older_files_have_none(tmp_path):
    mm = MemoryModel(base=1e7, alpha=4.0, Kp=20.0, Kc=float(KC))
    back = MemoryModel.load(mm.save(tmp_path / "m.json"))
    assert back.Kc == KC
    assert MemoryEstimator.fitted(back).kc == KC
    assert "Kc 20.0 MiB" in MemoryEstimator.fitted(back).source
    old = MemoryModel.load(MemoryModel(base=1e7, alpha=4.0, Kp=20.0).save(tmp_path / "old.json"))
    assert old.Kc is None and MemoryEstimator.fitted(old).kc == 0.0
    bad = tmp_path / "bad.json"
    bad.write_text((tmp_path / "m.json").read_text().replace(f'"Kc": {float(KC)}', '"Kc": -1.0'))
    with pytest.raises(FormatError, match="Kc"):
        MemoryModel.load(bad)


def test_calibration_prices_a_two_chunk_probe_as_the_planner_prices_that_rank_and_fits_kc_on_the_rest():
    """A ``chunks`` probe at position p of 4 holding layers [p, p+1) and [p+4, p+5) is the rank at
    p of an 8-chunk interleaved plan (8 micro-batches of 4): ``chunks_price`` equals
    ``device_memory`` of that rank (Kc 0), and ``fit_chunks`` reads Kc as the median of what the
    probes held beyond it."""
    from torchpp.formats import MemorySample
    from torchpp.profiling.calibrate import chunks_price, fit_chunks
    from torchpp.profiling.memory_probe import chunks_order

    plan, prof = _plan("interleaved", EIGHT, 2, ["a", "b", "c", "d"])
    lf = layers_file("a", num_layers=L, batch=4, layer_param_bytes=7_000_000, act_bytes_per_sample=49_152,
                     embed_param_bytes=25_000_000, tail_param_bytes=25_000_000)
    mm = MemoryModel(base=1.5e7, alpha=4.3, Kp=23.0, Kt=3.6, Kb=6.7, Kl=23.8, Kc=5e6)
    want = device_memory(plan, prof, replace(MemoryEstimator.fitted(mm), kc=0.0))
    samples = []
    for pos, extra in ((1, 19e6), (2, 21e6), (3, 30e6)):
        s = MemorySample(start=pos, end=pos + 1, has_embed=False, has_tail=False, weights_bytes=0,
                         activation_bytes_per_sample=0, batch=4, peak_bytes=0, microbatches=8, order="chunks",
                         second=(pos + 4, pos + 5), position=pos)
        rank = plan.stages[pos].devices[0].rank
        assert [c.index for c in plan.stages_of_rank(rank)] == [pos, pos + 4]
        assert chunks_price(mm, lf, s) == pytest.approx(want[rank])
        samples.append(replace(s, peak_bytes=int(want[rank] + extra)))
    fitted = fit_chunks(replace(mm, Kc=None), lf, samples)
    assert fitted.Kc == pytest.approx(21e6, abs=1)
    assert [s.predicted_bytes for s in fitted.samples[-3:]] == pytest.approx([want[r] + 21e6 for r in (1, 2, 3)])
    # the probe runs the order the rank runs
    pl = plan.placement()
    assert chunks_order(4, 2, 8)[1] == __import__("torchpp.schedules", fromlist=["x"]).position_order(
        "interleaved", pl, pl.position[2], 8)


def test_chunk_probe_spans_are_two_disjoint_body_chunks():
    from torchpp.profiling.calibrate import CHUNK_LAYERS, chunk_spans

    pairs = chunk_spans(16, 6, seed=0)
    assert len(pairs) == 6 and len(set(pairs)) == 6
    for (a, b), (c, d) in pairs:
        assert 1 <= a < b <= c < d <= 16 and b < 16
        assert b - a <= CHUNK_LAYERS and d - c <= CHUNK_LAYERS
