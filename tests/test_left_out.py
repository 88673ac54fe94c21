"""Profile what fits the host: blocks a host cannot hold are left out of its profile, priced from the
hosts that timed them (scaled by speed) and never placed on it."""
from __future__ import annotations

import dataclasses
import itertools
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import psutil
import pytest

from torchpp.cost import Profiles
from torchpp.formats import Bandwidth, FormatError, LayersFile
from torchpp.planner import api
from torchpp.planner.capacities import compute_capacities
from torchpp.planner.synthetic import layers_file, uniform_links
from torchpp.plans import make_plan

ROOT = Path(__file__).resolve().parents[1]
L, MB = 4, 2**20
ENDS = 200 * MB


def synthetic(host: str, speed: float) -> LayersFile:
    return layers_file(host, num_layers=L, speed=speed, batch=4, fixed_fraction=0.2, layer_param_bytes=MB,
                       embed_param_bytes=ENDS, tail_param_bytes=ENDS, act_bytes_per_sample=4096)


def left_out(lf: LayersFile, limit: int) -> LayersFile:
    """``lf`` as a host that could not hold the embedding and tail would have written it."""
    blank = lambda b: dataclasses.replace(b, forward_time_s=0.0, backward_time_s=0.0, forward_fixed_s=0.0,  # noqa: E731
                                          backward_fixed_s=0.0, forward_samples_s=[], backward_samples_s=[])
    return dataclasses.replace(lf, embed=blank(lf.embed), tail=blank(lf.tail), left_out=["embed", "tail"],
                               memory_limit_bytes=limit)


def test_layers_file_with_left_out_blocks_round_trips_and_is_validated(tmp_path):
    lf = left_out(synthetic("pi", 0.5), 2 << 30)
    lf.save(tmp_path / "l.json")
    back = LayersFile.load(tmp_path / "l.json")
    assert back.left_out == ["embed", "tail"] and back.memory_limit_bytes == 2 << 30 and back.embed.forward_time_s == 0
    old = synthetic("big", 1.0).to_json()
    assert "left_out" not in old and "memory_limit_bytes" not in old  # files without the field: as before
    data = json.loads((tmp_path / "l.json").read_text())
    for edit, field_name in ((lambda d: d["left_out"].append("layer0"), "left_out[2]"),
                             (lambda d: d["embed"].update(forward_time_s=0.5), "embed.forward_time_s"),
                             (lambda d: d.update(left_out=[]), "embed.forward_time_s")):
        bad = json.loads(json.dumps(data))
        edit(bad)
        with pytest.raises(FormatError, match=field_name.replace("[", r"\[").replace("]", r"\]")):
            LayersFile.parse(bad, "l.json")


def test_left_out_blocks_are_priced_from_the_hosts_that_timed_them_at_this_hosts_speed():
    big, pi_truth = synthetic("big", 1.0), synthetic("pi", 0.5)
    got = Profiles.from_layers([big, left_out(pi_truth, 100 * MB)])
    want = Profiles.from_layers([big, pi_truth])
    for table in ("fwd", "bwd", "fwd0", "bwd0"):
        np.testing.assert_allclose(getattr(got, table)["pi"], getattr(want, table)["pi"], rtol=1e-12)
    assert got.left_out == {"pi": ["embed", "tail"]} and got.memory_limit == {"pi": 100 * MB}
    assert "embed not timed there: from big" in got.origin["pi"]
    with pytest.raises(FormatError, match="'left_out': expected a layers file among those given that timed embed"):
        Profiles.from_layers([left_out(big, 100 * MB), left_out(pi_truth, 100 * MB)])


def test_capacities_compare_what_both_timed_and_carry_the_priced_table():
    big, pi_truth = synthetic("big", 1.0), synthetic("pi", 0.5)
    cap = compute_capacities([big, left_out(pi_truth, 100 * MB)], "big")
    assert cap.capacity["pi"] == pytest.approx(0.5)
    truth = compute_capacities([big, pi_truth], "big").tables["pi"]
    np.testing.assert_allclose(cap.tables["pi"].forward_time_s, truth.forward_time_s, rtol=1e-12)
    np.testing.assert_allclose(cap.tables["pi"].backward_fixed_s, truth.backward_fixed_s, rtol=1e-12)
    # a capacity from capacities.json scales the borrowed times alike
    prof = Profiles.from_layers([big, left_out(pi_truth, 100 * MB)], dataclasses.replace(cap, capacity={"big": 1.0,
                                                                                                      "pi": 0.25}))
    assert prof.fwd["pi"][0] == pytest.approx(4 * prof.fwd["big"][0])


def _all_plans(model, hosts):
    """Every pipeline of one device per stage (each set and order of hosts, each cut), and all
    hosts as one group, at every micro-batch count, 1F1B and GPipe."""
    for m, sched in itertools.product((1, 2, 4, 8), ("1f1b", "gpipe")):
        kw = dict(seq_len=16, global_batch=8, num_microbatches=m, schedule=sched)
        if 8 // m >= len(hosts):
            yield make_plan(model, layer_ranges=[(0, L)], group_sizes=[len(hosts)], hosts=list(hosts), **kw)
        for k in range(1, len(hosts) + 1):
            for order, cuts in itertools.product(itertools.permutations(hosts, k),
                                                 itertools.combinations(range(1, L), k - 1)):
                bounds = [0, *cuts, L]
                yield make_plan(model, layer_ranges=list(zip(bounds, bounds[1:])), group_sizes=[1] * k,
                                hosts=list(order), **kw)


def test_planner_never_gives_the_left_out_blocks_to_the_host_that_cannot_hold_them(tmp_path):
    """Brute force on a tiny instance: every plan that gives pi the embedding or the tail overruns
    pi's memory (its profile's limit, lower than devices.json says), and the planner's plan is as
    fast as the fastest that fits."""
    hosts = ["big", "lap", "pi"]
    for lf in (synthetic("big", 1.0), synthetic("lap", 0.8), left_out(synthetic("pi", 0.9), 100 * MB)):
        lf.save(tmp_path / f"layers_{lf.host}.json")
    Bandwidth.save(uniform_links(hosts, 1e8), tmp_path / "bandwidth.json")
    (tmp_path / "devices.json").write_text(json.dumps({h: 8 for h in hosts}))
    inputs = api.PlanInputs(layers=[tmp_path / f"layers_{h}.json" for h in hosts],
                            bandwidth=tmp_path / "bandwidth.json", devices=tmp_path / "devices.json")
    res = api.plan(inputs, api.PlanOptions(global_batch=8, schedule="1f1b,gpipe", recompute=False))
    chosen = res.plan
    ends = [d.host for s in chosen.stages if s.has_embed or s.has_tail for d in s.devices]
    assert ends and "pi" not in ends
    assert any(d.host == "pi" for s in chosen.stages for d in s.devices)  # pi still works, on decoder layers
    priced = [api.price(p, res.problem, res.problem.budget) for p in _all_plans(chosen.model, hosts)]
    for p in priced:
        on_pi = any(d.host == "pi" for s in p.plan.stages if s.has_embed or s.has_tail for d in s.devices)
        assert not (on_pi and p.fits), [(s.layers, [d.host for d in s.devices]) for s in p.plan.stages]
    best = min(p.step_time_s for p in priced if p.fits)
    assert chosen.predicted["step_time_s"] <= best * (1 + 1e-9)


def test_profile_leaves_out_the_ends_it_cannot_hold_of_a_config_only_model(tmp_path):
    """A config.json alone (151,936-word tied vocabulary, tiny layers) under a memory limit that
    holds the layers but not the embedding's weight, gradient and logits: one line says each, the
    layers are timed, the ends carry the model's bytes and no time, and the peak stays under it."""
    from transformers import Qwen3Config

    Qwen3Config(vocab_size=151_936, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, tie_word_embeddings=True).save_pretrained(tmp_path / "m")
    assert [p.name for p in (tmp_path / "m").iterdir()] == ["config.json"]
    env = {"PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    # 200 MiB above what the profile command itself holds when it reads the limit (torch, transformers and the
    # model's modules, which building the model from its config imports: its own error says) hold the layers, not
    # the 155 MiB of logits and their gradient with the embedding's weight and gradient (78 MiB)
    probe = subprocess.run([sys.executable, "-m", "torchpp.cli", "profile", "--model", str(tmp_path / "m"), "--memory",
                            "1", "--seq-len", "64", "--no-call-probe", "--quiet"], env=env, capture_output=True,
                           text=True, timeout=300)
    held = re.search(r"less the (\d+) MiB this process holds", probe.stderr)
    assert probe.returncode == 2 and held, probe.stderr
    limit = (int(held.group(1)) + 200) * MB
    r = subprocess.run([sys.executable, "-m", "torchpp.cli", "profile", "--model", str(tmp_path / "m"), "--host", "pi",
                        "--memory", str(limit), "--seq-len", "64", "--iters", "1", "--warmup", "0", "--no-call-probe",
                        "--out", str(tmp_path / "layers_pi.json")], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    notes = [x for x in r.stderr.splitlines() if x.startswith("profile: ")]
    assert len(notes) == 2 and "config.json without weights: random weights" in notes[0]
    assert notes[1].startswith("profile: left out embed and tail: ") and "--memory" in notes[1]
    lf = LayersFile.load(tmp_path / "layers_pi.json")
    assert lf.left_out == ["embed", "tail"] and lf.memory_limit_bytes == limit
    assert lf.embed_param_bytes == lf.embed.param_bytes == 151_936 * 64 * 4
    assert lf.tail.activation_bytes_per_sample == 64 * 151_936 * 4  # the logits of the real vocabulary
    assert lf.embed.forward_time_s == 0 and all(b.forward_time_s > 0 for b in lf.layers)
    assert lf.peak_rss_bytes < limit
    wide = subprocess.run([sys.executable, "-m", "torchpp.cli", "profile", "--model", str(tmp_path / "m"), "--host",
                           "lap", "--memory", "64G", "--seq-len", "64", "--iters", "1", "--warmup", "0",
                           "--no-call-probe", "--quiet", "--out", str(tmp_path / "layers_lap.json")],
                          env=env, capture_output=True, text=True, timeout=600)
    assert wide.returncode == 0 and "left out" not in wide.stderr, wide.stderr
    assert LayersFile.load(tmp_path / "layers_lap.json").left_out == []


def test_a_limit_that_holds_not_even_the_layers_is_one_line_naming_layers(tmp_path):
    r = subprocess.run([sys.executable, "-m", "torchpp.cli", "profile", "--model", "qwen3-tiny", "--memory", "1M",
                        "--no-call-probe", "--quiet"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                       env={"PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert "decoder layer(s) alone need at least" in r.stderr and "--memory" in r.stderr
    assert psutil.Process().memory_info().rss > 0


def test_speed_check_compares_the_layers_of_a_profile_that_left_blocks_out():
    from torchpp.profiling import speed_check

    ref, now = left_out(synthetic("pi", 1.0), 100 * MB), left_out(synthetic("pi", 1 / 1.3), 100 * MB)
    assert speed_check.compare(ref, now, "layers_pi.json").ratio == pytest.approx(1.3)
