"""The call probe: `torchpp profile` measures the runtime's seconds per compute call on its host,
capacities.json carries each host's, and the cost model prices them on every call."""
import json
import statistics

import pytest

from torchpp.cli import main
from torchpp.cost import Links, Profiles
from torchpp.formats import Bandwidth, Capacities, LayersFile
from torchpp.planner.capacities import compute_capacities
from torchpp.planner.replan import call_gaps, find_merged
from torchpp.planner.synthetic import layers_file
from torchpp.plans import make_plan
from torchpp.profiling import call_probe
from torchpp.profiling.call_probe import CallProbeConfig, CallProbeError, CallProbeResult, probe_call_overhead
from torchpp.sim.measured import price
from torchpp.trace.analyze import events_from_trace
from torchpp.trace.chrome import load_trace


@pytest.mark.parametrize("fork", [True, False])
def test_probe_measures_what_replan_reads_off_its_traces(tmp_path, fork):
    """The runtime's own pipeline run, traced; its mean equals call_gaps over the traced steps
    (ranks forked from this process, or fresh ones)."""
    cfg = CallProbeConfig(steps=3, timeout_s=120, fork=fork, microbatches=4)
    res = probe_call_overhead(cfg, workdir=tmp_path)
    assert res.call_overhead_s > 0 and res.steps == [2, 3]
    found = find_merged(tmp_path / "call_probe_traces")
    assert [n for n, _ in found] == [2, 3]  # step 1 (warm-up) is not measured
    gaps = [g for _, path in found for gs in call_gaps(events_from_trace(load_trace(path))).values() for g in gs]
    assert len(gaps) == 2 * 2 * (2 * 4 - 1)  # steps × ranks × gaps between 8 compute calls
    assert res.call_overhead_s == pytest.approx(statistics.fmean(gaps), rel=1e-12)
    assert sorted(res.gaps_s) == sorted(gaps)


def test_probe_config_refuses_an_unmeasurable_run():
    with pytest.raises(ValueError, match="steps"):
        CallProbeConfig(steps=1)
    with pytest.raises(ValueError, match="microbatches"):
        CallProbeConfig(microbatches=0)


def test_default_probe_ranks_never_compute_at_once(tmp_path):
    """Both ranks share the host: with one micro-batch per step one computes while the other
    waits, so neither's gaps hold CPU the other computed with (the merged timeline's clock)."""
    from torchpp.trace.analyze import COMPUTE_KINDS

    cfg = CallProbeConfig(steps=4, timeout_s=120)
    assert cfg.microbatches == 1
    probe_call_overhead(cfg, workdir=tmp_path)
    for _, path in find_merged(tmp_path / "call_probe_traces"):
        comp = sorted((e.start, e.end, e.rank) for e in events_from_trace(load_trace(path)) if e.kind in COMPUTE_KINDS)
        assert len(comp) == 4  # F and B on each rank
        for (s0, e0, r0), (s1, e1, r1) in zip(comp, comp[1:]):
            assert s1 >= e0 - 1e-4 or r0 == r1, (path, comp)


def _fake_probe(value):
    calls = []

    def probe(cfg=CallProbeConfig()):
        calls.append(cfg)
        return CallProbeResult(call_overhead_s=value, gaps_s=[value], steps=[2], wall_s=0.0)
    return probe, calls


def _profile(tmp_path, *extra):
    out = tmp_path / "layers_h.json"
    rc = main(["profile", "--model", "qwen3-tiny", "--seq-len", "8", "--batch", "1", "--iters", "1", "--warmup", "0",
               "--threads", "1", "--host", "h", "--out", str(out), "--quiet", *extra])
    assert rc == 0
    return LayersFile.load(out)


@pytest.mark.parametrize("extra", [(), ("--layers", "1")], ids=["full", "speed file"])
def test_profile_writes_the_probe_value(tmp_path, monkeypatch, extra):
    probe, calls = _fake_probe(0.00321)
    monkeypatch.setattr(call_probe, "probe_call_overhead", probe)
    lf = _profile(tmp_path, *extra)
    assert lf.call_overhead_s == 0.00321 and len(calls) == 1 and calls[0].threads == 1
    assert calls[0].steps == CallProbeConfig().steps == 64  # its mean holds on a small CPU quota


def test_call_probe_steps_are_the_probes(tmp_path, monkeypatch):
    """A quick check of the profile (the benchmarks' quick modes) runs a probe of a few steps."""
    probe, calls = _fake_probe(0.002)
    monkeypatch.setattr(call_probe, "probe_call_overhead", probe)
    assert _profile(tmp_path, "--call-probe-steps", "3").call_overhead_s == 0.002 and calls[0].steps == 3


def test_no_call_probe_skips_it_and_help_names_it(tmp_path, monkeypatch, capsys):
    probe, calls = _fake_probe(1.0)
    monkeypatch.setattr(call_probe, "probe_call_overhead", probe)
    assert _profile(tmp_path, "--no-call-probe").call_overhead_s == 0.0 and not calls
    capsys.readouterr()
    try:
        main(["profile", "--help"])
    except SystemExit:
        pass
    assert "--no-call-probe" in capsys.readouterr().out


def test_a_failed_probe_warns_and_writes_zero(tmp_path, monkeypatch, capsys):
    def broken(cfg=None):
        raise CallProbeError("the runtime's pipeline run failed: rank 1: boom")
    monkeypatch.setattr(call_probe, "probe_call_overhead", broken)
    capsys.readouterr()
    assert _profile(tmp_path).call_overhead_s == 0.0  # --quiet, yet the failure is said
    err = capsys.readouterr().err
    assert err.count("warning: the call probe failed") == 1 and "boom" in err and "call_overhead_s = 0" in err


# ----------------------------------------------------------------------------- capacities.json
def _files():
    files = [layers_file("a", speed=1.0), layers_file("b", speed=0.5), layers_file("c", speed=0.25)]
    files[0].call_overhead_s, files[1].call_overhead_s = 0.002, 0.007  # c was not probed
    return files


def test_capacities_carry_each_hosts_call_overhead(tmp_path):
    cap = compute_capacities(_files(), "a")
    assert cap.call_overhead_s == {"a": 0.002, "b": 0.007}  # an unprobed host (0) is left out
    cap.save(tmp_path / "capacities.json")
    back = Capacities.load(tmp_path / "capacities.json")
    assert back.call_overhead_s == {"a": 0.002, "b": 0.007}
    assert json.loads((tmp_path / "capacities.json").read_text())["format"] == "torchpp.capacities/1"


def test_an_old_capacities_file_loads_without_it(tmp_path):
    old = {"format": "torchpp.capacities/1", "ref_host": "a", "capacity": {"a": 1.0, "b": 0.5}}
    (tmp_path / "c.json").write_text(json.dumps(old))
    cap = Capacities.load(tmp_path / "c.json")
    assert cap.call_overhead_s == {}
    seed = Capacities.parse({"ref_host": "a", "capacity": {"a": 1.0}}, "seed.json")  # seed 000's form
    assert seed.call_overhead_s == {}


def test_capacities_call_overhead_is_validated():
    with pytest.raises(Exception, match="call_overhead_s"):
        Capacities.parse({"format": "torchpp.capacities/1", "ref_host": "a", "capacity": {"a": 1.0},
                          "call_overhead_s": {"a": -1.0}}, "c.json")


def test_capacity_priced_hosts_get_their_own_measured_value():
    files = _files()
    cap = compute_capacities(files, "a")
    scaled = Capacities(ref_host="a", capacity=cap.capacity, call_overhead_s=cap.call_overhead_s)  # no tables
    for c in (cap, scaled):
        p = Profiles.from_layers([files[0]], c)
        p.ensure(["b", "c"])
        assert p.call["a"] == 0.002 and p.call["b"] == 0.007
        assert p.call["c"] == pytest.approx(0.002 / cap.capacity["c"])  # not probed: the reference's, scaled
    old = Capacities(ref_host="a", capacity=cap.capacity)  # a file from before the field: as before
    p = Profiles.from_layers([files[0]], old)
    p.ensure(["b"])
    assert p.call["b"] == pytest.approx(0.002 / cap.capacity["b"])


# ----------------------------------------------------------------------------- pricing
@pytest.mark.parametrize("host", ["a", "b"], ids=["own layers file", "capacities.json"])
def test_call_overhead_lengthens_a_single_stage_step_by_calls_times_overhead(host):
    """One stage, one device, m micro-batches: one forward and one backward call each, so the
    step grows by exactly 2·m·overhead, whether the host has a layers file or only a capacity."""
    files = _files()
    cap = compute_capacities(files, "a")
    m = 4
    plan = make_plan(files[0].model, seq_len=files[0].run.seq_len, global_batch=8, num_microbatches=m,
                     layer_ranges=[(0, 4)], group_sizes=[1], hosts=[host])
    links = Links(Bandwidth(bytes_per_sec={}), "-")
    with_call = Profiles.from_layers([files[0]], cap)
    without = Profiles.from_layers([files[0]], cap)
    without.ensure([host])
    without.call[host] = 0.0
    step_with, _ = price(plan, with_call, links)
    step_without, _ = price(plan, without, links)
    c = {"a": 0.002, "b": 0.007}[host]
    assert step_with - step_without == pytest.approx(2 * m * c, rel=1e-9)


def test_probe_refuses_before_starting_ranks_where_memory_is_short(monkeypatch):
    """On a small host two more processes would have the kernel kill the profile itself: the probe
    says so (and starts nothing) instead."""
    monkeypatch.setattr(call_probe, "memory_room", lambda: 100 * 2**20)
    monkeypatch.setattr(call_probe, "probe_memory_needed", lambda *_: 600 * 2**20)
    started = []
    monkeypatch.setattr("torchpp.runtime.launch.RankPool.__init__", lambda *a, **k: started.append(1))
    with pytest.raises(CallProbeError, match="600 MiB.*100 MiB"):
        probe_call_overhead(CallProbeConfig())
    assert not started


def test_forked_ranks_need_less_memory_than_fresh_ones():
    assert call_probe.probe_memory_needed(CallProbeConfig()) < call_probe.probe_memory_needed(
        CallProbeConfig(fork=False)) == call_probe.PROBE_RANKS_BYTES


def test_memory_room_is_positive_and_at_most_the_machine_s():
    import psutil

    assert 0 < call_probe.memory_room() <= psutil.virtual_memory().total


def test_an_emulated_hosts_memory_limit_bounds_the_room(monkeypatch):
    """In a cluster namespace the cgroup files are hidden (a fresh /sys): `cluster run` passes the
    host's limit as TORCHPP_HOST_MEMORY, and the probe's check reads it."""
    from torchpp.cluster.cluster import host_env

    state = {"name": "c", "master_addr": "10.0.0.1", "master_port": 29500,
             "hosts": [{"name": "pi", "cpu": 0.25, "memory": 750 * 2**20}]}
    assert host_env(state, 0, base={})["TORCHPP_HOST_MEMORY"] == str(750 * 2**20)
    monkeypatch.setenv("TORCHPP_HOST_MEMORY", str(300 * 2**20))
    assert call_probe.memory_room() < 300 * 2**20
