"""speed-check: a host's profiled layers timed again; a plan priced at the speed its hosts have now
equals the plan priced from profiles that were that much slower, and no host's ratio reaches another."""
import dataclasses
import json

import pytest

from torchpp.cli import main
from torchpp.cost import Links, MeasuredCost, Profiles
from torchpp.formats import Capacities, FormatError, LayersFile, SpeedCheck, speed_ratios
from torchpp.planner.capacities import compute_capacities
from torchpp.planner.simple import make_plan
from torchpp.planner.synthetic import layers_file, uniform_links
from torchpp.profiling import speed_check
from torchpp.schedules import build
from torchpp.sim.replay import replay

L = 4


def lf(host: str, speed: float = 1.0, call: float = 0.01, opt: float = 2e-8, split_layer: float = 0.003) -> LayersFile:
    f = layers_file(host, num_layers=L, speed=speed, batch=4, fixed_fraction=0.3, layer_param_bytes=2_000_000)
    return dataclasses.replace(f, call_overhead_s=call / speed, optimizer_s_per_byte=opt / speed,
                               backward_split_factor=1.1, backward_split_layer_s=split_layer / speed)


def plan_of(files, hosts, schedule="zb-h1"):
    return make_plan(files[0].model, seq_len=16, global_batch=8, num_microbatches=4,
                     layer_ranges=[(0, 1), (1, 3), (3, 4)], group_sizes=[1, 1, 1], hosts=hosts, schedule=schedule)


def makespan(plan, prof: Profiles) -> float:
    return replay(build(plan), MeasuredCost(plan, prof, Links(uniform_links(["a", "b", "c"], 1e7)))).makespan


def test_compare_reads_the_slowdown_layer_by_layer():
    ref = lf("pi3")
    sc = speed_check.compare(ref, lf("pi3", speed=1 / 1.3), "speed_pi3.json")
    assert sc.ratio == pytest.approx(1.3)
    assert sc.host == "pi3" and sc.batch == 4 and sc.reference == "speed_pi3.json"
    assert len(sc.profiled_s) == len(sc.measured_s) == L
    # forward + backward of each layer at the reference's batch (per-call part included)
    assert sc.profiled_s[0] == pytest.approx(ref.layers[0].forward_time_s + ref.layers[0].backward_time_s)
    assert [m / p for m, p in zip(sc.measured_s, sc.profiled_s)] == pytest.approx([1.3] * L)


def test_a_check_of_another_model_slice_is_refused():
    with pytest.raises(ValueError, match=r"speed_pi3.json: the check measured synthetic \(3 layer"):
        speed_check.compare(lf("pi3"), layers_file("pi3", num_layers=3, batch=4), "speed_pi3.json")


def test_a_host_at_ratio_r_is_priced_as_its_profile_r_times_slower():
    files = [lf("a"), lf("b"), lf("c")]
    plan = plan_of(files, ["a", "b", "c"])
    now = Profiles.from_layers(files)
    now.at_speed({"b": 1.5})
    slower = Profiles.from_layers([files[0], lf("b", speed=1 / 1.5), files[2]])
    assert makespan(plan, now) == pytest.approx(makespan(plan, slower), rel=1e-9)
    assert makespan(plan, now) > makespan(plan, Profiles.from_layers(files)) * 1.05
    # every figure of b, and only b's
    assert now.call["b"] == pytest.approx(0.015) and now.call["a"] == pytest.approx(0.01)
    assert now.optimizer_rate("b")[0] == pytest.approx(3e-8) and now.optimizer_rate("a")[0] == pytest.approx(2e-8)
    assert now.backward_split_layer_s("b") == pytest.approx(0.0045)
    assert now.backward_split_factor("b") == pytest.approx(1.1)


def test_the_reference_hosts_ratio_does_not_reach_hosts_priced_from_it():
    """Hosts with only a capacity take the reference host's table over their capacity; checked
    together, each keeps its own ratio: the reference 2x slower, pi 1.2x."""
    ref, pi = lf("a"), lf("pi", speed=0.5)
    cap = compute_capacities([ref, pi], "a")
    cap = dataclasses.replace(cap, tables={})  # pi priced from the reference's table and its capacity
    files = [ref]
    now = Profiles.from_layers(files, cap)
    now.ensure(["a", "pi"])
    now.at_speed({"a": 2.0, "pi": 1.2})
    base = Profiles.from_layers(files, cap)
    base.ensure(["a", "pi"])
    assert now.layer_seconds("a", 4) == pytest.approx(2.0 * base.layer_seconds("a", 4))
    assert now.layer_seconds("pi", 4) == pytest.approx(1.2 * base.layer_seconds("pi", 4))
    assert now.optimizer_rate("pi")[0] == pytest.approx(1.2 * base.optimizer_rate("pi")[0])


def test_simulate_plan_with_speed_checks_equals_slower_profiles(tmp_path, capsys):
    files = [lf("a"), lf("b"), lf("c")]
    plan = plan_of(files, ["a", "b", "c"], schedule="1f1b")
    plan.save(tmp_path / "plan.json")
    paths = [f.save(tmp_path / f"layers_{f.host}.json") for f in files]
    uniform_links(["a", "b", "c"], 1e7).save(tmp_path / "bw.json")
    slow = tmp_path / "slow"
    slow.mkdir()
    slow_paths = [f.save(slow / f"layers_{f.host}.json") for f in
                  (lf("a", speed=1 / 1.25), files[1], lf("c", speed=1 / 0.8))]
    checks = []
    for h, r in (("a", 1.25), ("c", 0.8)):
        checks.append(SpeedCheck(host=h, reference=f"layers_{h}.json", batch=4, profiled_s=[1.0], measured_s=[r],
                                 ratio=r, iters=3).save(tmp_path / f"speed_check_{h}.json"))

    def predicted(layers, *extra):
        assert main(["simulate", "plan", str(tmp_path / "plan.json"), "--bandwidth", str(tmp_path / "bw.json"),
                     "--layers", *map(str, layers), "--comm", "links", "--trace", str(tmp_path / "t.json"),
                     *extra]) == 0
        out = capsys.readouterr().out
        return float(next(x for x in out.splitlines() if x.startswith("predicted step time")).split()[3]), out

    now, out = predicted(paths, "--speed-check", *map(str, checks))
    assert "speed check (measured / profiled): a x1.250, c x0.800" in out
    assert now == pytest.approx(predicted(slow_paths)[0], rel=1e-6)
    assert now != pytest.approx(predicted(paths)[0], rel=1e-3)


def test_a_speed_check_of_a_host_not_in_the_plan_is_named(tmp_path, capsys):
    files = [lf("a"), lf("b"), lf("c")]
    plan_of(files, ["a", "b", "c"]).save(tmp_path / "plan.json")
    paths = [f.save(tmp_path / f"layers_{f.host}.json") for f in files]
    uniform_links(["a", "b", "c"], 1e7).save(tmp_path / "bw.json")
    p = SpeedCheck(host="zz", reference="x", batch=4, profiled_s=[1.0], measured_s=[1.0], ratio=1.0,
                   iters=1).save(tmp_path / "speed_check_zz.json")
    rc = main(["simulate", "plan", str(tmp_path / "plan.json"), "--bandwidth", str(tmp_path / "bw.json"),
               "--layers", *map(str, paths), "--trace", str(tmp_path / "t.json"), "--speed-check", str(p)])
    assert rc == 2
    assert "--speed-check: field 'host': expected a host of the plan (a, b, c), got 'zz'" in capsys.readouterr().err
    assert not (tmp_path / "t.json").exists()


@pytest.mark.parametrize("edit, field", [
    ({"ratio": 0}, "ratio"),
    ({"measured_s": [1.0]}, "measured_s"),
    ({"profiled_s": [1.0, -2.0], "measured_s": [1.0, 1.0]}, r"profiled_s\[1\]"),
    ({"format": "torchpp.layers/1"}, "format"),
])
def test_a_bad_speed_check_file_names_its_field(tmp_path, edit, field):
    good = SpeedCheck(host="a", reference="x", batch=4, profiled_s=[1.0, 2.0], measured_s=[1.1, 2.2], ratio=1.1,
                      iters=3).to_json()
    p = tmp_path / "speed_check_a.json"
    p.write_text(json.dumps({**good, **edit}))
    with pytest.raises(FormatError, match=rf"{p.name}.*{field}"):
        SpeedCheck.load(p)


def test_one_host_checked_twice_is_an_error_naming_both_files(tmp_path):
    sc = SpeedCheck(host="a", reference="x", batch=4, profiled_s=[1.0], measured_s=[1.0], ratio=1.0, iters=1)
    p1, p2 = sc.save(tmp_path / "one.json"), sc.save(tmp_path / "two.json")
    with pytest.raises(FormatError, match=r"two.json.*host.*one.json"):
        speed_ratios([p1, p2])


def test_the_check_profiles_what_the_reference_profiled(monkeypatch):
    """Same model slice, sizes, threads, seed and precision; the blocks only (no optimizer, no
    split backward: the check is quick and compares what capacities compare)."""
    ref = dataclasses.replace(lf("pi4a"), run=dataclasses.replace(lf("pi4a").run, batches=[1, 2, 4], seed=3,
                                                                    threads=2, iters=5, warmup=1))
    seen = {}

    def fake(pc, progress=None, trace=None):
        seen["pc"] = pc
        return lf("pi4a", speed=0.8)

    monkeypatch.setattr("torchpp.profiling.measure.measure_layers", fake)
    sc = speed_check.check_speed(ref, "speed_pi4a.json")
    pc = seen["pc"]
    assert (pc.model, pc.seq_len, pc.batch, pc.fit_batches, pc.threads, pc.seed, pc.num_layers, pc.iters,
            pc.warmup, pc.host, pc.extras) == ("synthetic", 16, 4, (1, 2), 2, 3, L, 5, 1, "pi4a", False)
    assert sc.ratio == pytest.approx(1.25)


def test_speed_check_command_on_a_real_profile(tmp_path, capsys):
    """End to end on this machine: profile one layer of qwen3-tiny, check it; the file loads back
    and its times are the layer's, measured twice."""
    ref = tmp_path / "speed_local.json"
    assert main(["profile", "--model", "qwen3-tiny", "--layers", "1", "--seq-len", "16", "--batch", "1,2",
                 "--iters", "2", "--warmup", "1", "--no-call-probe", "--quiet", "--host", "local",
                 "--out", str(ref)]) == 0
    out = tmp_path / "speed_check_local.json"
    assert main(["speed-check", "--reference", str(ref), "--out", str(out), "--iters", "2"]) == 0
    assert "than profiled" in capsys.readouterr().out
    sc = SpeedCheck.load(out)
    assert sc.host == "local" and sc.batch == 2 and len(sc.measured_s) == 1 and sc.iters == 2
    assert sc.ratio == pytest.approx(sc.measured_s[0] / sc.profiled_s[0])
    assert 0.1 < sc.ratio < 10  # the same work on the same machine, seconds apart
