"""The running backward's bytes (Kb): held once per device however many micro-batches are in
flight, fitted from probes holding several, and priced alike by every consumer of the model."""
from __future__ import annotations

from dataclasses import replace

import pytest

from torchpp.cost import MemoryEstimator
from torchpp.formats import MemorySample
from torchpp.profiling.calibrate import KE_FRESH_GRADIENT, fit

from test_memory_prediction import assert_priced_once


def _sample(start, end, body, tail, batch, w, order="fb", n=2, end_w=0):
    return MemorySample(start=start, end=end, has_embed=start == 0, has_tail=tail > 0, weights_bytes=w,
                        activation_bytes_per_sample=body + tail, batch=batch, peak_bytes=0,
                        tail_activation_bytes_per_sample=tail, end_weights_bytes=end_w, microbatches=n, order=order)


def test_fit_recovers_what_each_held_micro_batch_keeps_and_the_running_backward():
    """Samples made by a known model (base 30 MB, alpha 3.5, Kp 25 kept per held micro-batch,
    Kb 20 once, Kt 3, Ke as set): one-at-a-time spans alone read Kp + Kb; the held ones split it."""
    truth = dict(base=30e6, alpha=3.5, kp=25.0, kb=20.0, kt=3.0, ke=KE_FRESH_GRADIENT)

    def peak(s):
        body = s.activation_bytes_per_sample - s.tail_activation_bytes_per_sample
        n = s.microbatches if s.order == "gpipe" else 1
        return int(truth["base"] + truth["alpha"] * s.weights_bytes + truth["ke"] * s.end_weights_bytes
                   + s.batch * (n * (truth["kp"] * body + truth["kt"] * s.tail_activation_bytes_per_sample)
                                + truth["kb"] * body))

    spans = [_sample(0, 3, 40_000, 0, 2, 13_000_000), _sample(3, 8, 50_000, 500_000, 8, 19_000_000, end_w=4_000_000),
             _sample(2, 4, 20_000, 0, 8, 6_000_000), _sample(4, 5, 10_000, 0, 2, 3_000_000),
             _sample(5, 8, 30_000, 500_000, 8, 13_000_000, end_w=4_000_000),
             _sample(4, 8, 40_000, 500_000, 2, 16_000_000, end_w=4_000_000), _sample(1, 6, 50_000, 0, 2, 15_000_000),
             _sample(3, 7, 40_000, 0, 8, 12_000_000, "gpipe", 4), _sample(1, 7, 60_000, 0, 2, 18_000_000, "gpipe", 4)]
    spans = [replace(s, peak_bytes=peak(s)) for s in spans]
    one_at_a_time = fit([s for s in spans if s.order == "fb"])
    assert one_at_a_time.Kp == pytest.approx(truth["kp"] + truth["kb"], rel=1e-6) and one_at_a_time.Kb is None
    mm = fit(spans)
    assert mm.Kp == pytest.approx(truth["kp"], rel=1e-6) and mm.Kb == pytest.approx(truth["kb"], rel=1e-6)
    assert mm.Kt == pytest.approx(truth["kt"], rel=1e-6) and mm.r2 == pytest.approx(1.0)
    assert max(abs(r) for r in mm.residuals) < 1.0


def test_priced_once_per_device_by_every_consumer():
    """peak(n) − peak(Kb = 0, n) = s · Kb · A_body for every n; one chunk's chunks_peak is peak;
    the recompute MILP's constant carries it."""
    import numpy as np

    assert_priced_once("kb", lambda a: a.body)
    est = MemoryEstimator(1e8, 4.0, 20.0, "test", kt=2.0, ke=1.0)
    with_kb = replace(est, kb=15.0)
    acts = np.array([5.0, 7.0])
    assert with_kb.recompute_terms(acts, 3.0, 2, 0, 11.0)[0] - est.recompute_terms(acts, 3.0, 2, 0, 11.0)[0] == \
        pytest.approx(15.0 * 11.0)
