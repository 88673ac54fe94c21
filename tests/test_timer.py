"""The span timer: monotonic, both backends agree, thread-safe, overflow reported, one fallback warning."""
import threading
import time
import warnings

import numpy as np
import pytest

from torchpp.profiling import timer as tm

BACKENDS = ["cpp", "python"] if tm._ext is not None else ["python"]


@pytest.mark.parametrize("b", BACKENDS)
def test_spans_are_monotonic_and_cover_a_sleep(b):
    t = tm.SpanTimer(64, prefer=b)
    assert t.backend == b
    slots = []
    for i in range(10):
        s = t.begin(i)
        time.sleep(0.001)
        assert t.end(s) > 0
        slots.append(s)
    rows = t.read()
    assert rows.shape == (10, 3) and rows.dtype == np.int64
    assert rows[:, 0].tolist() == list(range(10)) and slots == list(range(10))
    assert (rows[:, 2] - rows[:, 1] >= 1_000_000).all()  # each span covers its 1 ms sleep
    flat = rows[:, 1:].ravel()
    assert (np.diff(flat) >= 0).all()  # start_0 <= end_0 <= start_1 <= ...


@pytest.mark.parametrize("b", BACKENDS)
def test_mark_record_open_and_reset(b):
    t = tm.SpanTimer(8, prefer=b)
    a = t.mark(7)
    t.record(3, 10, 20)
    s = t.begin(5)
    rows = t.read()
    assert rows[0].tolist() == [7, a, a] and rows[1].tolist() == [3, 10, 20]
    assert rows[2, 2] == tm.OPEN and rows[2, 1] >= a
    t.end(s)
    assert t.read()[2, 2] >= rows[2, 1]
    t.reset()
    assert t.count() == 0 and t.read().shape == (0, 3)


@pytest.mark.parametrize("b", BACKENDS)
def test_overflow_is_counted_not_silent(b):
    t = tm.SpanTimer(3, prefer=b)
    for i in range(5):
        t.end(t.begin(i))
    assert t.count() == 3 and t.dropped() == 2 and t.capacity() == 3
    assert t.read()[:, 0].tolist() == [0, 1, 2]
    assert t.begin(9) == -1 and t.end(-1) == 0
    with pytest.raises(ValueError):
        tm.SpanTimer(0, prefer=b)


@pytest.mark.parametrize("b", BACKENDS)
def test_threads_never_share_a_slot(b):
    t = tm.SpanTimer(40_000, prefer=b)
    n, k = 4, 5_000

    def work(tid):
        for i in range(k):
            t.end(t.begin(tid * k + i))

    ths = [threading.Thread(target=work, args=(j,)) for j in range(n)]
    for th in ths:
        th.start()
    for th in ths:
        th.join()
    rows = t.read()
    assert t.count() == n * k and t.dropped() == 0
    assert sorted(rows[:, 0].tolist()) == list(range(n * k))  # no record overwritten
    assert (rows[:, 2] >= rows[:, 1]).all()


@pytest.mark.skipif(tm._ext is None, reason="C++ timer not built")
def test_both_backends_share_one_clock():
    a = tm.now_ns("python")
    b = tm.now_ns("cpp")
    c = tm.now_ns("python")
    assert a <= b <= c


def test_fallback_warns_once_and_names_python(monkeypatch):
    monkeypatch.setattr(tm, "_ext", None)
    monkeypatch.setattr(tm, "_IMPORT_ERROR", "ImportError: test")
    monkeypatch.setattr(tm, "_warned", False)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert tm.backend() == "python"
        assert tm.SpanTimer(4).backend == "python"
        tm.now_ns()
    msgs = [str(x.message) for x in w if issubclass(x.category, RuntimeWarning)]
    assert len(msgs) == 1 and "pure-Python timer" in msgs[0]


def test_env_forces_python_and_rejects_unknown(monkeypatch):
    monkeypatch.setenv("TORCHPP_TIMER", "python")
    assert tm.SpanTimer(4).backend == "python"
    with pytest.raises(ValueError, match="timer backend"):
        tm.backend("gpu")
