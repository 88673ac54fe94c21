"""The ``rows`` tied-weight sync: its plan field, its price in the one cost model, and the planner's
choice of it (and of compressed links) on a 3-Pi cluster at 10 Mbit/s, fp32 at 1 Gbit/s."""
from __future__ import annotations

import json

import pytest

from torchpp.cost import Links, MeasuredCost, Profiles, tied_rows_bytes
from torchpp.formats import FormatError, LayersFile, Plan, Sync, tied_rows
from torchpp.models.presets import load_config, model_info
from torchpp.planner import api
from torchpp.planner.simple import make_plan
from torchpp.planner.synthetic import layers_file, uniform_links
from torchpp.planner.wire import parse_allow
from torchpp.schedules import Action, Kind

PIS = ("pi0", "pi1", "pi2")


def _pipeline(groups=(1, 1, 1)) -> Plan:
    info = model_info(load_config("qwen3-tiny"), "qwen3-tiny")
    return make_plan(info, seq_len=16, global_batch=6, num_microbatches=3, layer_ranges=[(0, 1), (1, 3), (3, 4)],
                     group_sizes=list(groups), schedule="1f1b")


def test_rows_field_round_trips_and_is_exact(tmp_path):
    p = _pipeline()
    p.tied_sync = Sync(kind="rows", rows=90)
    p.save(tmp_path / "p.json")
    assert json.loads((tmp_path / "p.json").read_text())["tied_sync"] == {"kind": "rows", "rows": 90}
    back = Plan.load(tmp_path / "p.json")
    assert back == p and back.lossy == [] and not back.tied_sync.lossy
    assert tied_rows(Sync(kind="rows"), 512, 96) == 96 and tied_rows(Sync(kind="rows"), 64, 96) == 64
    assert tied_rows(Sync(kind="rows", rows=90), 512, 96) == 90


@pytest.mark.parametrize("mutate,field", [
    (lambda d: d["stages"][0].update(sync={"kind": "rows"}), "stages[0].sync.kind"),
    (lambda d: d.update(tied_sync={"kind": "rows", "rows": -1}), "tied_sync.rows"),
    (lambda d: d.update(tied_sync={"kind": "rows", "wire": "int8"}), "tied_sync.wire"),
])
def test_rows_field_refused_where_it_cannot_apply(tmp_path, mutate, field):
    d = _pipeline((2, 1, 1)).to_json()
    mutate(d)
    (tmp_path / "bad.json").write_text(json.dumps(d))
    with pytest.raises(FormatError) as e:
        Plan.load(tmp_path / "bad.json")
    assert f"'{field}'" in str(e.value), str(e.value)


@pytest.mark.parametrize("groups", [(2, 1, 1), (1, 1, 2), (2, 1, 2)])
def test_rows_applies_to_data_parallel_end_stages(tmp_path, groups):
    p = _pipeline(groups)
    p.tied_sync = Sync(kind="rows")
    p.save(tmp_path / "p.json")
    assert Plan.load(tmp_path / "p.json").tied_sync.kind == "rows"
    if len(p.stages[0].devices) > 1:  # a cast to bf16 keeps the untouched rows zero
        p.stages[0].sync = Sync(kind="allreduce", wire="bf16")
        p.save(tmp_path / "bf16.json")
        assert Plan.load(tmp_path / "bf16.json").tied_sync.kind == "rows"


@pytest.mark.parametrize("sync", [Sync(kind="allreduce", wire="int8"), Sync(kind="powersgd")])
def test_rows_refused_after_a_sync_that_leaves_gradient_outside_the_rows(tmp_path, sync):
    p = _pipeline((2, 1, 1))
    p.tied_sync, p.stages[0].sync = Sync(kind="rows"), sync
    with pytest.raises(FormatError, match="tied_sync.kind") as e:
        p.save(tmp_path / "p.json")
    assert "stages[0]" in str(e.value)


def _gloo_broadcast(hosts, root, nbytes, hop) -> float:
    """When the last member has a broadcast, following gloo's ``broadcast`` loop as written (virtual
    ranks relative to the root, a mask cleared bit by bit, a member sends once it has received)."""
    k, dim = len(hosts), max(1, (len(hosts) - 1).bit_length())
    has = {0: 0.0}
    for i in range(dim):
        mask = ((1 << dim) - 1) & ~((1 << (i + 1)) - 1)
        for v in range(k):
            peer = v ^ (1 << i)
            if v & mask or peer >= k or v & (1 << i):
                continue
            has[peer] = has[v] + hop(hosts[(v + root) % k], hosts[(peer + root) % k], nbytes)
    assert sorted(has) == list(range(k))
    return max(has.values())


@pytest.mark.parametrize("k", [2, 3, 4, 5, 7, 8])
def test_tree_broadcast_follows_gloos_binomial_tree(k):
    import random

    rng = random.Random(k)
    hosts = [f"h{i}" for i in range(k)]
    bw = uniform_links(hosts, 1e6, latency_s=0.002)
    for key in bw.bytes_per_sec:
        bw.bytes_per_sec[key] = rng.choice([1e5, 1e6, 1e7])
    links = Links(bw)
    for root in range(k):
        want = _gloo_broadcast(hosts, root, 5e4, links.rested_time)
        assert links.tree_broadcast(hosts, root, 5e4) == pytest.approx(want)
    # uniform links: a member's copy has crossed as many links as its relative rank has one bits (the
    # root's sends leave together), so the last arrives after the most one bits of any rank below k
    even = Links(uniform_links(hosts, 1e6, latency_s=0.002))
    hops = max(bin(v).count("1") for v in range(k))
    assert even.tree_broadcast(hosts, 1, 5e4) == pytest.approx(hops * (0.002 + 0.05))


def test_rows_with_a_data_parallel_first_stage_priced_as_two_broadcasts():
    """First stage on pi0 and pi1, the last on pi3: the gradient rows leave pi0, the weights' rows pi3,
    each to the whole tied group (ranks 0, 1, 3), pi0-pi1 a slow link."""
    hosts = ["pi0", "pi1", "pi2", "pi3"]
    files = [_pi(h) for h in hosts]
    prof = Profiles.from_layers(files)
    plan = make_plan(files[0].model, seq_len=64, global_batch=6, num_microbatches=3,
                     layer_ranges=[(0, 1), (1, 2), (2, 3)], group_sizes=[2, 1, 1], schedule="1f1b", hosts=hosts)
    bw = uniform_links(hosts, 1.25e6, latency_s=0.001)
    bw.bytes_per_sec[bw.key("pi0", "pi1")] = 1.25e5
    links = Links(bw)
    plan.tied_sync = Sync(kind="rows", rows=64)
    ar = Action(Kind.ALLREDUCE, 0, group=(0, 1, 3), tied=True)
    got = MeasuredCost(plan, prof, links).allreduce_s(ar)
    rows = 64 * 1024
    group = ["pi0", "pi1", "pi3"]
    assert got == pytest.approx(links.tree_broadcast(group, 0, rows) + links.tree_broadcast(group, 2, rows))
    # from pi0: pi1 over the slow link; from pi3 (relative ranks pi3, pi0, pi1): pi0, then pi1 from pi3
    assert got == pytest.approx((0.001 + rows / 1.25e5) + (0.001 + rows / 1.25e6))


def _pi(host: str, **kw) -> LayersFile:
    """qwen3-small on a Pi (3 layers, hidden 256, a tied 4096 x 256 embedding), profiled at 2 x 64 tokens,
    its codecs at four times the CPU per byte ``torchpp profile`` measured on a 2-core x86 host."""
    lf = layers_file(host, num_layers=3, batch=2, seq_len=64, layer_fwd_s=0.04, layer_bwd_s=0.08,
                     embed_fwd_s=0.002, tail_fwd_s=0.03, layer_param_bytes=3_150_000,
                     embed_param_bytes=4096 * 256 * 4, tail_param_bytes=4096 * 256 * 4 + 1024,
                     act_bytes_per_sample=64 * 256 * 4, hidden_size=256, vocab_size=4096,
                     model_name="qwen3-small-like", **kw)
    lf.codec_s_per_byte = {"bf16": [0.8e-9, 0.7e-9], "fp16": [0.8e-9, 0.7e-9], "int8": [7.7e-9, 2.2e-9],
                           "powersgd": [4.3e-9, 1.0e-9]}
    return lf


def test_rows_priced_as_the_touched_rows_each_way():
    files = [_pi(h) for h in PIS]
    prof = Profiles.from_layers(files)
    plan = make_plan(files[0].model, seq_len=64, global_batch=6, num_microbatches=3,
                     layer_ranges=[(0, 1), (1, 2), (2, 3)], group_sizes=[1, 1, 1], schedule="1f1b", hosts=list(PIS))
    links = Links(uniform_links(list(PIS), 1.25e6, latency_s=0.001))
    ar = Action(Kind.ALLREDUCE, 0, group=(0, 2), tied=True)
    dense = MeasuredCost(plan, prof, links).allreduce_s(ar)
    assert dense == pytest.approx(links.ring_allreduce(["pi0", "pi2"], 4096 * 256 * 4))
    plan.tied_sync = Sync(kind="rows")  # every token of the step: 6 x 64 = 384 rows of 1 kB
    assert tied_rows_bytes(prof, plan) == 384 * 256 * 4
    rows = MeasuredCost(plan, prof, links).allreduce_s(ar)
    assert rows == pytest.approx(2 * (0.001 + 384 * 1024 / 1.25e6))
    plan.tied_sync = Sync(kind="rows", rows=64)  # byte tokens: a few dozen distinct ids a step
    assert MeasuredCost(plan, prof, links).allreduce_s(ar) == pytest.approx(2 * (0.001 + 64 * 1024 / 1.25e6))
    assert rows < dense / 5


def _cluster(tmp_path, rate: float) -> api.PlanInputs:
    """Three equal Pis, none of which holds qwen3-small's training state alone (64 MB each)."""
    for h in PIS:
        _pi(h).save(tmp_path / f"layers_{h}.json")
    uniform_links(list(PIS), rate, latency_s=0.0005).save(tmp_path / "bandwidth.json")
    (tmp_path / "devices.json").write_text(json.dumps({h: 0.064 for h in PIS}))
    return api.PlanInputs(layers=[tmp_path / f"layers_{h}.json" for h in PIS], bandwidth=tmp_path / "bandwidth.json",
                          devices=tmp_path / "devices.json")


def test_planner_compresses_on_a_10_mbit_3_pi_cluster_and_keeps_fp32_at_a_gigabit(tmp_path):
    allow = parse_allow("bf16,int8")  # (PowerSGD, lossier and its CPU unpriced, is priced near the rows here)
    (tmp_path / "slow").mkdir()
    (tmp_path / "fast").mkdir()
    slow = _cluster(tmp_path / "slow", 1.25e6)
    fp32 = api.plan(slow, api.PlanOptions(global_batch=6)).plan
    assert fp32.num_stages > 1 and fp32.lossy == [] and fp32.tied_sync is None  # no single Pi holds it
    got = api.plan(slow, api.PlanOptions(global_batch=6, allow_lossy=allow, tied_rows=64)).plan
    assert got.tied_sync is not None and got.tied_sync.kind == "rows"  # the exact sync takes the tied weight
    assert any(s.wire == "int8" for s in got.stages[:-1])  # the activations' links are compressed
    assert got.predicted["step_time_s"] < fp32.predicted["step_time_s"] / 3
    fast = _cluster(tmp_path / "fast", 1.25e8)
    base = api.plan(fast, api.PlanOptions(global_batch=6)).plan
    gig = api.plan(fast, api.PlanOptions(global_batch=6, allow_lossy=allow, tied_rows=64)).plan
    # at 1 Gbit/s the activations' transfers hide behind compute: every link stays fp32 (a data-parallel
    # group's all-reduce, an eighth of this step, may still be compressed where that pays 3%)
    assert all(s.wire is None for s in gig.stages)
    assert [s.layers for s in gig.stages] == [s.layers for s in base.stages]


def test_powersgd_of_the_tied_weight_is_priced_by_its_factors():
    """torch's PowerSGD sends P (vocabulary x r) and Q (hidden x r) of the 4096 x 256 tied weight:
    (4096 + 256) r values, not 2r/hidden of the weight (which takes it as hidden x hidden); its
    arithmetic is priced from the host's measured rate."""
    files = [_pi(h) for h in PIS]
    prof = Profiles.from_layers(files)
    plan = make_plan(files[0].model, seq_len=64, global_batch=6, num_microbatches=3,
                     layer_ranges=[(0, 1), (1, 2), (2, 3)], group_sizes=[1, 1, 1], schedule="1f1b", hosts=list(PIS))
    links = Links(uniform_links(list(PIS), 1.25e6))
    plan.tied_sync = Sync(kind="powersgd", rank=8)
    got = MeasuredCost(plan, prof, links).allreduce_s(Action(Kind.ALLREDUCE, 0, group=(0, 2), tied=True))
    cpu = 4096 * 256 * 4 * (4.3e-9 + 1.0e-9) * 8 / 4  # its matrix products, measured at rank 4, scale with the rank
    assert got == pytest.approx(links.ring_allreduce(["pi0", "pi2"], 4 * 8 * (4096 + 256)) + cpu)
    assert Sync(kind="powersgd", rank=8).allreduce_bytes(4e6, 256) == pytest.approx(4e6 * 16 / 256)  # other weights


def test_plan_command_takes_tied_rows(tmp_path, capsys):
    from torchpp.cli import main

    inputs = _cluster(tmp_path, 1.25e6)
    argv = ["plan", "--layers", *map(str, inputs.layers), "--bandwidth", str(inputs.bandwidth), "--devices",
            str(inputs.devices), "--global-batch", "6", "--seq-len", "64", "--allow-lossy", "int8"]
    assert main([*argv, "--tied-rows", "64", "--out-dir", str(tmp_path / "o")]) == 0
    assert json.loads((tmp_path / "o" / "plan.json").read_text())["tied_sync"] == {"kind": "rows", "rows": 64}
    assert "tied-weight sync: the touched rows (exact)" in capsys.readouterr().out
    assert main([*argv, "--tied-rows", "-1", "--out-dir", str(tmp_path / "bad")]) == 2
    assert "--tied-rows" in capsys.readouterr().err


def test_powersgd_rate_is_profiled_and_kept_in_the_layers_file(tmp_path):
    from torchpp.profiling.measure import codec_costs

    got = codec_costs(8, 32)
    assert set(got) == {"bf16", "fp16", "int8", "powersgd"} and got["powersgd"][0] > 0 <= got["powersgd"][1]
    lf = _pi("pi0")
    lf.save(tmp_path / "l.json")
    assert LayersFile.load(tmp_path / "l.json").codec_s_per_byte["powersgd"] == [4.3e-9, 1.0e-9]
