"""The optimizer step measured by `torchpp profile` prices first plans.

profile times the runtime's optimizer step into ``optimizer_s_per_byte``; the planner prices each
host's step with its own rate (layers file, capacities.json's map, or the reference's over its
capacity) unless ``--optimizer-s-per-gb`` is given; old files without the field still load.
"""
import json

import pytest
import torch

from torchpp.cli import main
from torchpp.formats import Capacities, FormatError, LayersFile, write_json
from torchpp.planner import api
from torchpp.planner.capacities import compute_capacities
from torchpp.planner.synthetic import layers_file, uniform_links

L, LAYER_BYTES, EMBED_BYTES, TAIL_BYTES = 4, 2_000_000, 3_000_000, 3_100_000
RATE = 5e-9  # seconds per parameter byte (5 s/GB)


@pytest.fixture(autouse=True)
def _threads():
    old = torch.get_num_threads()
    yield
    torch.set_num_threads(old)


def _layers(host: str, rate: float | None, speed: float = 1.0, tied: bool = False) -> LayersFile:
    lf = layers_file(host, num_layers=L, speed=speed, batch=4, layer_param_bytes=LAYER_BYTES,
                     embed_param_bytes=EMBED_BYTES, tail_param_bytes=TAIL_BYTES, tied=tied)
    lf.optimizer_s_per_byte = rate
    return lf


def _inputs(d, files: list[LayersFile], hosts: list[str], cap: Capacities | None = None, **kw) -> api.PlanInputs:
    paths = [lf.save(d / f"layers_{lf.host}.json") for lf in files]
    devices = write_json(d / "devices.json", {h: 100 for h in hosts})
    bw = uniform_links(hosts or ["x", "y"], 1e9).save(d / "bandwidth.json")
    return api.PlanInputs(layers=paths, bandwidth=bw, devices=devices,
                          capacities=cap.save(d / "capacities.json") if cap else None, **kw)


def _one_stage_step(d, rate: float | None, tied: bool = False, **kw) -> float:
    """Step time of the one-device plan (one stage, micro-batches of 4) of host ``a``."""
    res = api.plan(_inputs(d, [_layers("a", rate, tied=tied)], ["a"], **kw), api.PlanOptions(global_batch=8,
                                                                                 micro_batch_sizes=[4]))
    assert res.plan.num_stages == 1 and res.plan.world_size == 1
    return res.plan.predicted["step_time_s"]


# ----------------------------------------------------------------------------- profile
@pytest.mark.parametrize("layers", [None, "1"])
def test_profile_writes_a_positive_optimizer_rate(tmp_path, layers, capsys):
    out = tmp_path / "layers_h.json"
    extra = ["--layers", layers] if layers else []
    assert main(["profile", "--model", "qwen3-tiny", "--seq-len", "8", "--batch", "1", "--iters", "2",
                 "--warmup", "0", "--threads", "1", "--host", "h", "--out", str(out), *extra]) == 0
    lf = LayersFile.load(out)
    assert lf.model.num_layers == (1 if layers else 4)
    # a few MiB of fp32 parameters take microseconds to seconds per GB on any CPU: a real time, not 0
    assert lf.optimizer_s_per_byte is not None and 1e-13 < lf.optimizer_s_per_byte < 1e-6
    assert json.loads(out.read_text())["optimizer_s_per_byte"] == lf.optimizer_s_per_byte
    assert "optimizer step" in capsys.readouterr().out


# ----------------------------------------------------------------------------- formats
def test_old_layers_and_capacities_files_load_without_the_rate(tmp_path):
    old = _layers("a", None)
    data = old.to_json()
    assert "optimizer_s_per_byte" not in data  # not measured: absent, as files written before it
    assert LayersFile.parse(data, "old.json").optimizer_s_per_byte is None
    assert LayersFile.parse({**data, "optimizer_s_per_byte": 2e-9}, "x.json").optimizer_s_per_byte == 2e-9
    with pytest.raises(FormatError, match="optimizer_s_per_byte"):
        LayersFile.parse({**data, "optimizer_s_per_byte": -1.0}, "bad.json")
    cap = compute_capacities([old, _layers("b", None, speed=0.5)], "a")
    assert "optimizer_s_per_byte" not in cap.to_json() and Capacities.parse(cap.to_json(), "c").optimizer_s_per_byte == {}
    with pytest.raises(FormatError, match="optimizer_s_per_byte"):
        Capacities.parse({**cap.to_json(), "optimizer_s_per_byte": {"zz": 1e-9}}, "c.json")


def test_capacities_carry_each_measured_hosts_rate(tmp_path):
    cap = compute_capacities([_layers("a", RATE), _layers("b", 3 * RATE, speed=0.5), _layers("c", None)], "a")
    assert cap.optimizer_s_per_byte == {"a": RATE, "b": 3 * RATE}
    back = Capacities.load(cap.save(tmp_path / "capacities.json"))
    assert back.optimizer_s_per_byte == {"a": RATE, "b": 3 * RATE}


# ----------------------------------------------------------------------------- planner
@pytest.mark.parametrize("tied", [False, True])
def test_measured_rate_lengthens_a_one_stage_plan_by_param_bytes_times_rate(tmp_path, tied):
    (tmp_path / "without").mkdir(), (tmp_path / "with").mkdir()
    base = _one_stage_step(tmp_path / "without", None, tied)
    priced = _one_stage_step(tmp_path / "with", RATE, tied)
    # tied: the tail's bytes include the embedding's weight (its lm_head), updated once on one device
    params = EMBED_BYTES + L * LAYER_BYTES + TAIL_BYTES - (EMBED_BYTES if tied else 0)
    assert priced - base == pytest.approx(params * RATE, rel=1e-9)
    assert params * RATE > 0.05  # the difference is not lost in rounding


def test_explicit_flag_overrides_the_measured_rate(tmp_path):
    for d in ("none", "zero", "given"):
        (tmp_path / d).mkdir()
    base = _one_stage_step(tmp_path / "none", None)
    assert _one_stage_step(tmp_path / "zero", RATE, optimizer_s_per_gb=0.0) == pytest.approx(base, rel=1e-12)
    given = _one_stage_step(tmp_path / "given", RATE, optimizer_s_per_gb=2.0)  # 2 s/GB, not the measured 5
    params = EMBED_BYTES + L * LAYER_BYTES + TAIL_BYTES
    assert given - base == pytest.approx(params * 2e-9, rel=1e-9)


def test_hosts_without_a_layers_file_get_capacities_rate_or_the_reference_over_capacity(tmp_path):
    a, b = _layers("a", RATE), _layers("b", 3 * RATE, speed=0.5)
    cap = compute_capacities([a, b], "a")
    cap.capacity["c"] = 0.25  # a host known only by its capacity
    costs = api.load(_inputs(tmp_path, [a], ["a", "b", "c"], cap))
    assert costs.optimizer_s_per_byte == pytest.approx({"a": RATE, "b": 3 * RATE, "c": RATE / 0.25})
    src = costs.optimizer_source
    assert src.startswith("measured per host by profile") and "capacities.json" in src and "capacity 0.25" in src
    given = api.load(_inputs(tmp_path, [a], ["a", "b", "c"], cap, optimizer_s_per_gb=1.5))
    assert given.optimizer_s_per_byte == pytest.approx(1.5e-9) and given.optimizer_source.startswith("given")


def test_plan_output_says_where_the_optimizer_rate_came_from(tmp_path, capsys):
    for name, rate, extra in (("measured", RATE, []), ("none", None, []),
                              ("given", RATE, ["--optimizer-s-per-gb", "3"])):
        d = tmp_path / name
        d.mkdir()
        inp = _inputs(d, [_layers("a", rate), _layers("b", rate, speed=0.5)], ["a", "b"])
        assert main(["plan", "--layers", *map(str, inp.layers), "--bandwidth", str(inp.bandwidth), "--devices",
                     str(inp.devices), "--global-batch", "8", "--out-dir", str(d / "out"), *extra]) == 0
        out = capsys.readouterr().out
        want = {"measured": "optimizer step: measured per host by profile: a 5 s/GB",
                "none": "optimizer step: none: not measured", "given": "optimizer step: given: 3 s/GB"}[name]
        assert want in out and want in (d / "out" / "summary.txt").read_text()
        assert json.loads((d / "out" / "plan_meta.json").read_text())["predicted"]["optimizer"].startswith(
            want.split(": ", 1)[1])


def test_simulate_plan_prices_the_optimizer_as_the_planner_does(tmp_path, capsys):
    """One cost model: `torchpp simulate plan` (the demo's and analyze's prediction) gives the step
    time the planner wrote into plan.json, measured optimizer steps included."""
    a, b = _layers("a", RATE), _layers("b", 3 * RATE, speed=0.5)
    cap = compute_capacities([a, b], "a")
    cap.capacity["c"] = 0.25  # priced from a's table and rate, over its capacity
    inp = _inputs(tmp_path, [a], ["a", "b", "c"], cap)
    res = api.plan(inp, api.PlanOptions(global_batch=16, micro_batch_sizes=[2]))
    assert res.plan.world_size >= 2, res.plan.world_size
    path = res.plan.save(tmp_path / "plan.json")
    assert main(["simulate", "plan", str(path), "--bandwidth", str(inp.bandwidth), "--layers", *map(str, inp.layers),
                 "--capacities", str(inp.capacities), "--comm", "links", "--trace", str(tmp_path / "pred.json")]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("predicted step time"))
    assert float(line.split()[3]) == pytest.approx(res.plan.predicted["step_time_s"], abs=1e-6)  # printed to 1 us
    trace = json.loads((tmp_path / "pred.json").read_text())
    opt = [e["dur"] for e in trace["traceEvents"] if e.get("name") == "optimizer"]
    assert opt and min(opt) > 0
