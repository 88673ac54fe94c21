"""The demo's speed rounds: a round that disagrees is re-taken, and speed checks compare against the
consensus round (the one whose capacity is the host's median), not round 1."""
import json

import pytest

from torchpp.demo import Demo, DemoConfig, LocalHosts
from torchpp.formats import Capacities, LayersFile
from torchpp.planner.synthetic import layers_file


def _round(d, prefix, speeds, layers=2):
    out = []
    for h, s in speeds.items():
        lf = layers_file(h, num_layers=layers, speed=s)
        lf.save(p := d / f"{prefix}_{h}.json")
        out.append(p)
    return out


def test_an_outlying_round_is_re_taken_and_the_check_uses_the_median_round(tmp_path, monkeypatch, capsys):
    """local1 reads 0.5, 0.05 (a round gone wrong) and 0.52 of local0: the middle round is re-taken
    (one more round, all hosts at once) and then agrees; the capacity is the median of the rounds kept,
    and the speed check's reference for local1 is the round whose capacity is that median."""
    demo = Demo(DemoConfig(capacity_layers=2, speed_rounds=3), tmp_path / "out", LocalHosts(2))
    d = demo.path("hosts")
    d.mkdir(parents=True)
    rounds = [_round(d, "speed", {"local0": 1.0, "local1": 0.5}),
              [*_round(d, "layers", {"local0": 1.0}, layers=4), *_round(d, "busy", {"local1": 0.05})],
              _round(d, "again3", {"local0": 1.0, "local1": 0.52})]
    taken = []

    def speed_round(prefix, title, call_probe=False):
        taken.append(prefix)
        return _round(d, prefix, {"local0": 1.0, "local1": 0.49})

    monkeypatch.setattr(demo, "speed_round", speed_round)
    cap = Capacities.load(demo.settled_capacities([list(r) for r in rounds]))
    out = capsys.readouterr().out
    assert taken == ["retake1_2"]
    assert "outlier: local1 round 2: 0.050 is -90% from its median 0.500" in out and "re-taking round(s) 2" in out
    assert cap.outliers == [] and [r["local1"] for r in cap.rounds] == pytest.approx([0.5, 0.49, 0.52])
    assert cap.capacity["local1"] == pytest.approx(0.5) and cap.consensus_round["local1"] == 0
    refs = demo.consensus_references()
    assert json.loads(refs["local1"].read_text()) == json.loads((d / "speed_local1.json").read_text())
    # the reference host's rounds are alike; its check re-runs a few-layer profile, never the whole model
    assert len(LayersFile.load(refs["local0"]).layers) == 2
    # a demo that did not take the rounds itself (capacities from elsewhere) checks against round 1's files
    demo.rounds = []
    assert json.loads(demo.consensus_references()["local1"].read_text()) == json.loads(
        (d / "speed_local1.json").read_text())


def test_rounds_that_keep_disagreeing_are_said_after_the_last_re_take(tmp_path, monkeypatch, capsys):
    demo = Demo(DemoConfig(capacity_layers=2, speed_rounds=3), tmp_path / "out", LocalHosts(2))
    d = demo.path("hosts")
    d.mkdir(parents=True)
    rounds = [_round(d, f"r{k}", {"local0": 1.0, "local1": s}) for k, s in enumerate((0.5, 0.05, 0.52))]
    bad = iter([0.05, 0.9])
    monkeypatch.setattr(demo, "speed_round", lambda prefix, title, call_probe=False: _round(d, prefix, {"local0": 1.0, "local1": next(bad)}))
    cap = Capacities.load(demo.settled_capacities(rounds))
    out = capsys.readouterr().out
    assert out.count("re-taking round(s) 2") == 2
    assert "still outlying after 2 re-takes: local1 round 2: 0.900" in out
    assert [(o.host, o.round) for o in cap.outliers] == [("local1", 1)]


def test_a_re_take_of_round_1_repeats_its_call_probe(tmp_path, monkeypatch):
    """Round 1's files give each host's call overhead and rates: its re-take runs the call probe again
    (later rounds do not), so the capacities keep them."""
    demo = Demo(DemoConfig(capacity_layers=2, speed_rounds=3), tmp_path / "out", LocalHosts(2))
    d = demo.path("hosts")
    d.mkdir(parents=True)
    rounds = [_round(d, f"r{k}", {"local0": 1.0, "local1": s}) for k, s in enumerate((0.05, 0.5, 0.52))]
    calls = []

    def speed_round(prefix, title, call_probe=False):
        calls.append((prefix, call_probe))
        return _round(d, prefix, {"local0": 1.0, "local1": 0.51})

    monkeypatch.setattr(demo, "speed_round", speed_round)
    demo.settled_capacities(rounds)
    assert calls == [("retake1_1", True)]
