"""The running layer's bytes (Kl): held once per device whatever the span's length and the
micro-batches it holds, fitted beside Kp from spans at several micro-batch sizes, and priced
alike by every consumer of the model."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from torchpp.cost import MemoryEstimator, StageMemory
from torchpp.cost.memory import describe
from torchpp.formats import MemoryModel, MemorySample
from torchpp.profiling.calibrate import fit, layer_activation

from test_memory_prediction import assert_priced_once, two_stage_plan

TRUTH = dict(base=30e6, alpha=3.5, kp=25.0, kt=3.0, kl=22.0)
LAYER = 10_000  # bytes per sample of every decoder layer's output


def _sample(start, end, tail, batch):
    layers = end - start
    return MemorySample(start=start, end=end, has_embed=start == 0, has_tail=tail > 0,
                        weights_bytes=3_000_000 * layers, activation_bytes_per_sample=LAYER * layers + tail,
                        batch=batch, peak_bytes=0, tail_activation_bytes_per_sample=tail, microbatches=2,
                        layer_activation_bytes_per_sample=LAYER)


def _peak(s: MemorySample) -> int:
    body = s.activation_bytes_per_sample - s.tail_activation_bytes_per_sample
    return int(TRUTH["base"] + TRUTH["alpha"] * s.weights_bytes
               + s.batch * (TRUTH["kp"] * body + TRUTH["kt"] * s.tail_activation_bytes_per_sample
                            + TRUTH["kl"] * s.layer_activation_bytes_per_sample))


SPANS = [_sample(0, 3, 0, 4), _sample(3, 8, 500_000, 16), _sample(2, 4, 0, 16), _sample(4, 5, 0, 4),
         _sample(5, 8, 500_000, 4), _sample(4, 8, 500_000, 16), _sample(1, 6, 0, 4), _sample(6, 7, 0, 16)]


def test_fit_tells_the_running_layer_from_the_intercept():
    """Samples made by a known model with Kl: the fit (spans at two micro-batch sizes) recovers
    every coefficient; at one size Kl's column is the intercept's, so it is left out (None) and
    the intercept takes it."""
    spans = [replace(s, peak_bytes=_peak(s)) for s in SPANS]
    mm = fit(spans)
    assert mm.Kl == pytest.approx(TRUTH["kl"], rel=1e-6) and mm.base == pytest.approx(TRUTH["base"], rel=1e-6)
    assert mm.Kp == pytest.approx(TRUTH["kp"], rel=1e-6) and mm.Kt == pytest.approx(TRUTH["kt"], rel=1e-6)
    assert max(abs(r) for r in mm.residuals) < 1.0
    one_size = [replace(s, batch=4, peak_bytes=_peak(replace(s, batch=4))) for s in SPANS]
    mm1 = fit(one_size)
    assert mm1.Kl is None and mm1.base == pytest.approx(TRUTH["base"] + 4 * TRUTH["kl"] * LAYER, rel=1e-6)
    assert "Kl 22.000 (one layer running)" in describe(mm)


def test_without_it_a_one_layer_span_at_a_small_batch_is_over_priced():
    """What Kl is for: fitted without it (samples that do not record the layer's bytes), the
    intercept takes the running layer at the probes' mean batch and a one-layer span at the
    small batch is priced above its bytes; with it, exactly."""
    spans = [replace(s, peak_bytes=_peak(s)) for s in SPANS]
    without = fit([replace(s, layer_activation_bytes_per_sample=0) for s in spans])
    assert without.Kl is None
    small = _sample(9, 10, 0, 4)
    small = replace(small, peak_bytes=_peak(small))
    price = lambda mm: MemoryEstimator.fitted(mm).peak(  # noqa: E731
        small.weights_bytes, LAYER, 0.0, 4, 1, act_body=LAYER, act_layer=LAYER)
    assert price(without) > 1.01 * small.peak_bytes
    assert price(fit(spans)) == pytest.approx(small.peak_bytes, rel=1e-6)


def test_priced_once_per_device_by_every_consumer():
    """peak(n) − peak(Kl = 0, n) = s · Kl · (the stage's largest decoder layer) for every n, not
    its embedding's or tail's; one chunk's chunks_peak is peak; the recompute MILP's constant
    carries it."""
    lf, profiles, plan = two_stage_plan()
    for st in plan.stages:
        assert StageMemory(profiles, MemoryEstimator.analytic()).activations(st).layer == layer_activation(
            lf, *st.layers) > 0
    assert_priced_once("kl", lambda a: a.layer)
    est = MemoryEstimator(1e8, 4.0, 20.0, "test", kt=2.0, kb=3.0)
    with_kl = replace(est, kl=15.0)
    acts = np.array([5.0, 7.0])
    assert (with_kl.recompute_terms(acts, 3.0, 2, 0, 11.0, 0.0, 7.0)[0]
            - est.recompute_terms(acts, 3.0, 2, 0, 11.0, 0.0, 7.0)[0] == pytest.approx(15.0 * 7.0))


def test_the_file_keeps_it(tmp_path):
    spans = [replace(s, peak_bytes=_peak(s)) for s in SPANS]
    mm = fit(spans)
    back = MemoryModel.load(mm.save(tmp_path / "memory_model.json"))
    assert back.Kl == pytest.approx(mm.Kl)
    assert [s.layer_activation_bytes_per_sample for s in back.samples] == [LAYER] * len(SPANS)
    assert MemoryEstimator.fitted(back).kl == pytest.approx(TRUTH["kl"], rel=1e-6)
