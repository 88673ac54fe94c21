"""A split backward (zero-bubble's I then W) costs more than one backward pass; `torchpp profile`
measures by how much on its host and the cost model prices I and W with it."""
import pytest
import torch

from torchpp.cli import main
from torchpp.cost import Profiles
from torchpp.cost.stage import Span, stage_time
from torchpp.formats import Capacities, FormatError, LayersFile
from torchpp.planner.capacities import compute_capacities
from torchpp.planner.synthetic import layers_file


def _lf(host: str, factor: float | None, speed: float = 1.0) -> LayersFile:
    lf = layers_file(host, num_layers=4, speed=speed, batch=4)
    lf.call_overhead_s = 0.003
    lf.backward_split_factor = factor
    return lf


def test_profile_measures_the_split_cost(tmp_path):
    out = tmp_path / "layers_h.json"
    assert main(["profile", "--model", "qwen3-tiny", "--seq-len", "8", "--batch", "2", "--iters", "2",
                 "--warmup", "1", "--threads", "1", "--host", "h", "--out", str(out), "--no-call-probe"]) == 0
    lf = LayersFile.load(out)
    f = lf.backward_split_factor
    assert f is not None and 0.5 < f < 20  # two passes over the graph: near or above one
    assert lf.backward_split_layer_s is not None and 0 <= lf.backward_split_layer_s < 1


def test_profile_at_two_batches_fits_the_split_per_call_cost(tmp_path):
    """With a second batch size, the split's cost per call (what ``backward_input`` and
    ``backward_weight`` add per decoder layer, whatever the micro-batch) is fitted apart from its
    cost per sample; with the deferred linear weights it is small, and never negative."""
    out = tmp_path / "layers_h.json"
    assert main(["profile", "--model", "qwen3-tiny", "--seq-len", "8", "--batch", "1,4", "--iters", "3",
                 "--warmup", "1", "--threads", "1", "--host", "h", "--out", str(out), "--no-call-probe"]) == 0
    lf = LayersFile.load(out)
    assert lf.backward_split_layer_s is not None and lf.backward_split_layer_s >= 0
    assert lf.backward_split_factor is not None and lf.backward_split_factor > 0


def test_fit_split_recovers_a_known_cost():
    from torchpp.profiling.measure import fit_split

    layers, c, f = 4, 0.0015, 1.04
    rows = [(b, f * b + layers * c) for b in (0.02, 0.08)]
    got = fit_split(rows, layers)
    assert got.factor == pytest.approx(f, rel=1e-9) and got.layer_s == pytest.approx(c, rel=1e-9)
    one = fit_split(rows[:1], layers)  # one batch size: everything in the factor
    assert one.layer_s == 0 and one.factor == pytest.approx(rows[0][1] / rows[0][0])
    cheaper = fit_split([(0.02, 0.019), (0.08, 0.079)], layers)  # no dearer than one pass
    assert cheaper.layer_s == 0 and cheaper.factor < 1


def test_old_files_load_and_bad_values_are_refused():
    data = _lf("a", None).to_json()
    assert "backward_split_factor" not in data
    assert LayersFile.parse(data, "old.json").backward_split_factor is None
    assert LayersFile.parse({**data, "backward_split_factor": 1.2}, "x.json").backward_split_factor == 1.2
    with pytest.raises(FormatError, match="backward_split_factor"):
        LayersFile.parse({**data, "backward_split_factor": -1.0}, "bad.json")


@pytest.mark.parametrize("factor", [None, 1.0, 1.25])
def test_i_plus_w_is_the_factor_times_b_plus_two_calls(factor):
    lf = _lf("a", factor)
    p = Profiles.from_layers([lf])
    t = stage_time(p, "a", Span(1, 4))
    f = 1.0 if factor is None else factor
    for n in (1, 4):
        b = t.backward(n) - t.call
        assert t.backward_input(n) + t.backward_weight(n) == pytest.approx(f * b + 2 * t.call, rel=1e-12)
        assert t.backward_input(n) == pytest.approx(t.backward_weight(n), rel=1e-12)  # halves (not measured)
    assert ("x B (measured split cost)" in p.backward_split(["a"])) == (f != 1.0)


@pytest.mark.parametrize("layer_s", [0.0, 0.002])
def test_the_per_layer_cost_is_per_call_and_split_in_halves(layer_s):
    lf = _lf("a", 1.1)
    lf.backward_split_layer_s = layer_s
    p = Profiles.from_layers([lf])
    t = stage_time(p, "a", Span(2, 5))  # three decoder layers
    for n in (1, 4):
        b = t.backward(n) - t.call
        assert t.backward_input(n) + t.backward_weight(n) == pytest.approx(1.1 * b + 3 * layer_s + 2 * t.call)
        assert t.backward_input(n) == pytest.approx(t.backward_weight(n))
    tail = stage_time(p, "a", Span(3, p.num_blocks))  # layers 2, 3 and the tail: two layers
    assert tail.split_call == pytest.approx(2 * layer_s)
    assert ("ms per layer and call" in p.backward_split(["a"])) == (layer_s > 0)


def test_the_embedding_chunk_runs_its_whole_backward_in_w():
    """Its input takes no gradient: the runtime's I returns at once and W is one unsplit backward,
    so the split's factor and per-layer cost do not apply there."""
    lf = _lf("a", 1.3)
    lf.backward_split_layer_s = 0.002
    p = Profiles.from_layers([lf])
    t = stage_time(p, "a", Span(0, 3))
    for n in (1, 4):
        assert t.backward_input(n) == pytest.approx(t.call)
        assert t.backward_weight(n) == pytest.approx(t.backward(n))


def test_the_runtime_computes_nothing_in_the_embedding_chunks_i():
    from torchpp.models.presets import load_config
    from torchpp.models.stages import StageSpec, backward_input, build_stage

    cfg = load_config("qwen3-tiny")
    st = build_stage("qwen3-tiny", cfg, StageSpec(layers=(0, 1), has_embed=True, has_tail=False))
    out = st.forward(torch.randint(0, int(cfg.vocab_size), (2, 8)), None, None)
    dx, task = backward_input(out, torch.ones_like(out), None, [p for p in st.parameters()], [])
    assert dx is None and task.full is not None


def test_hosts_without_a_layers_file_take_their_capacities_entry_or_the_reference_hosts(tmp_path):
    a, b, c = _lf("a", 1.3), _lf("b", 1.1, speed=0.5), _lf("c", None, speed=0.7)
    cap = Capacities.load(compute_capacities([a, b, c], "a").save(tmp_path / "capacities.json"))
    assert cap.backward_split_factor == {"a": 1.3, "b": 1.1}
    p = Profiles.from_layers([a], cap)  # b and c priced from capacities.json
    assert [p.backward_split_factor(h) for h in "abc"] == [1.3, 1.1, 1.3]
    a.backward_split_layer_s, b.backward_split_layer_s = 0.001, 0.003
    cap = Capacities.load(compute_capacities([a, b, c], "a").save(tmp_path / "capacities.json"))
    assert cap.backward_split_layer_s == {"a": 0.001, "b": 0.003}
    p = Profiles.from_layers([a], cap)
    # c was not measured: the reference host's time over c's capacity (a time scales with speed)
    got = [p.backward_split_layer_s(h) for h in "abc"]
    assert got[:2] == [0.001, 0.003] and got[2] == pytest.approx(0.001 / cap.capacity["c"])
    assert Profiles.from_layers([_lf("d", None)]).backward_split_factor("d") == 1.0
    with pytest.raises(FormatError, match="backward_split_factor"):
        Capacities.parse({**cap.to_json(), "backward_split_factor": {"zz": 1.0}}, "c.json")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_the_split_cost_is_measured_at_the_profiles_precision(monkeypatch, dtype):
    """A --dtype bfloat16 profile prices zero-bubble splits with the ratio of what training runs
    (fp32 weights under bf16 autocast), a float16 one with float16 weights."""
    from torchpp.models import stages
    from torchpp.models.presets import load_config
    from torchpp.profiling.measure import ProfileConfig, measure_backward_split

    seen = []
    real = stages.build_stage

    def spy(*a, **kw):
        st = real(*a, **kw)
        seen.append((st.dtype, st.autocast))
        return st

    monkeypatch.setattr(stages, "build_stage", spy)
    pc = ProfileConfig(model="qwen3-tiny", seq_len=8, batch=2, iters=1, warmup=0, dtype=dtype)
    f = measure_backward_split(load_config("qwen3-tiny"), pc)
    want = {"float32": (torch.float32, None), "bfloat16": (torch.float32, torch.bfloat16),
            "float16": (torch.float16, None)}[dtype]
    assert seen == [want] and 0.3 < f.factor < 20 and f.layer_s >= 0
