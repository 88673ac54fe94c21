"""The hostile-input audit's cases, one test each: refused in one line before any work, nothing written."""
from __future__ import annotations

import json
import math
import shutil
import time
from pathlib import Path

import pytest

from torchpp.cli import main
from torchpp.formats import FormatError, Plan, write_json
from torchpp.planner.synthetic import layers_file, uniform_links

from test_fuzz_cli import _run, world  # noqa: F401  (the fuzz test's valid inputs)


def _refused(argv: list[str], *needles: str, seconds: float = 5.0) -> str:
    rc, err, dt = _run(argv)
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, (rc, err)
    assert dt < seconds, f"{dt:.1f} s"
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


def test_huge_sizes_refused_at_once(world):
    out = world["root"] / "huge"
    _refused(["plan", "--strategy", "pp", "--global-batch", "1000000000000", "--out", str(out)], "--global-batch",
             "4096")
    _refused(["plan", "--layers", str(world["la"]), "--bandwidth", str(world["bw"]), "--devices",
              str(world["devices"]), "--global-batch", "1000000000000", "--out-dir", str(out)])
    _refused(["simulate", "run", "-n", "100000000", "--no-gantt"], "-n")
    _refused(["simulate", "run", "-n", "4096", "--stages", "1024", "--no-gantt"], "actions")
    assert not out.exists()


@pytest.mark.parametrize("flag,value", [("--global-batch", "0"), ("--global-batch", "-4"), ("--max-stages", "0"),
                                        ("--max-stages", "-1"), ("--exact-devices", "-1"), ("--max-group", "0")])
def test_search_limits_refused_not_reported_as_no_plan(world, flag, value):
    line = _refused(["plan", "--layers", str(world["la"]), str(world["lb"]), "--bandwidth", str(world["bw"]),
                     "--devices", str(world["devices"]), flag, value, "--out-dir", str(world["root"] / "o")], flag)
    assert "no plan fits" not in line


def test_written_files_are_files_torchpp_reads(world, tmp_path):
    csv = tmp_path / "links.csv"
    csv.write_text("a,b,1e308\nb,a,1\n")
    _refused(["bandwidth", "parse", "--csv", str(csv), "--out", str(tmp_path / "bw.json")], "line 1.gbps")
    assert not (tmp_path / "bw.json").exists()
    _refused(["plan", "--strategy", "pp", "--seq-len", "-1", "--out", str(tmp_path / "p.json")], "--seq-len")
    assert not (tmp_path / "p.json").exists()
    with pytest.raises(ValueError):
        write_json(tmp_path / "nan.json", {"x": math.nan})
    assert not (tmp_path / "nan.json").exists()


def test_shares_must_add_up(world, tmp_path):
    plan = json.loads(world["plan"].read_text())
    for shares in ((0.3, 0.3), (0.9, 0.9), (0.01, 5)):
        for d, s in zip(plan["stages"][0]["devices"], shares):
            d["share"] = s
        (tmp_path / "p.json").write_text(json.dumps(plan))
        with pytest.raises(FormatError, match="share"):
            Plan.load(tmp_path / "p.json")


def test_plan_fields_typed(world, tmp_path):
    plan = json.loads(world["plan"].read_text())
    for key, value, needle in (("inputs", 5, "inputs"), ("predicted", 5, "predicted"),
                               ("format", "torchpp.plan/9", "format")):
        (tmp_path / "p.json").write_text(json.dumps({**plan, key: value}))
        _refused(["simulate", "plan", str(tmp_path / "p.json"), "--bandwidth", str(world["bw"]), "--layers",
                  str(world["la"]), str(world["lb"]), "--trace", str(tmp_path / "t.json")], needle)


def test_traces_of_another_plan_refused(world, tmp_path):
    other = tmp_path / "other.json"
    rc, err, _ = _run(["plan", "--layers", str(world["la"]), str(world["lb"]), "--bandwidth", str(world["bw"]),
                       "--devices", str(world["devices"]), "--global-batch", "16", "--out-dir", str(tmp_path / "o")])
    assert rc == 0, err
    shutil.copy(tmp_path / "o" / "plan.json", other)
    _refused(["analyze", str(world["traces"]), "--plan", str(other), "--out", str(tmp_path / "r")], "not for --plan")
    _refused(["replan", "--plan", str(other), "--traces", str(world["traces"]), "--out-dir", str(tmp_path / "r")],
             "not for --plan")
    assert not (tmp_path / "r").exists()
    rc, err, _ = _run(["analyze", str(world["traces"]), "--plan", str(world["plan"]), "--out", str(tmp_path / "r")])
    assert rc == 0, err


@pytest.mark.parametrize("mutate,needle", [
    (lambda t: t.update(format="torchpp.trace/9"), "format"),
    (lambda t: _first_x(t).update(ts=math.nan), "ts"),
    (lambda t: _first_x(t).update(dur=-5.0), "dur"),
])
def test_bad_traces_refused(world, tmp_path, mutate, needle):
    trace = json.loads((world["traces"] / "timeline_step1_all.json").read_text())
    mutate(trace)
    (tmp_path / "timeline_step1_all.json").write_text(json.dumps(trace))
    _refused(["analyze", str(tmp_path), "--out", str(tmp_path / "r")], needle)


def _first_x(trace: dict) -> dict:
    return next(e for e in trace["traceEvents"] if e.get("ph") == "X")


def test_unsafe_and_repeated_hosts(world, tmp_path):
    _refused(["profile", "--model", "qwen3-tiny", "--host", "../../evil"], "--host")
    _refused(["plan", "--strategy", "pp", "--hosts", "a,a", "--out", str(tmp_path / "p.json")], "twice")
    bw = uniform_links(["a", "b"]).to_json()
    bw["bytes_per_sec"]["a|a"] = 1e9
    (tmp_path / "bw.json").write_text(json.dumps(bw))
    _refused(["plan", "--layers", str(world["la"]), str(world["lb"]), "--bandwidth", str(tmp_path / "bw.json"),
              "--devices", str(world["devices"]), "--out-dir", str(tmp_path / "o")], "self-link")


def test_output_paths_checked_before_work(world, tmp_path):
    (tmp_path / "f").write_text("x")
    _refused(["plan", "--strategy", "pp", "--out", str(tmp_path)], "directory")
    _refused(["capacities", "--inputs", str(world["la"]), "--ref-host", "a", "--out", str(tmp_path / "f" / "c.json")],
             "under the file")
    _refused(["analyze", str(world["traces"]), "--out", str(tmp_path / "f")], "file")


def test_unreadable_files_named(world, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_bytes(b"\xff\xfe{}")
    assert str(bad) in _refused(["capacities", "--inputs", str(bad), "--ref-host", "a", "--out",
                                 str(tmp_path / "c.json")], "UTF-8")
    csv = tmp_path / "l.csv"
    csv.write_bytes(b"a,b,\xff\n")
    assert str(csv) in _refused(["bandwidth", "parse", "--csv", str(csv), "--out", str(tmp_path / "b.json")])
    _refused(["bandwidth", "parse", "--csv", str(tmp_path), "--out", str(tmp_path / "b.json")], str(tmp_path))


def test_memory_and_sizes_in_files(world, tmp_path):
    (tmp_path / "d.json").write_text(json.dumps({"a": 1e300, "b": 4}))
    _refused(["plan", "--layers", str(world["la"]), str(world["lb"]), "--bandwidth", str(world["bw"]), "--devices",
              str(tmp_path / "d.json"), "--out-dir", str(tmp_path / "o")], "a")
    lf = layers_file("a")
    lf.layers[0].param_bytes = 10**30
    write_json(tmp_path / "l.json", lf.to_json())
    _refused(["capacities", "--inputs", str(tmp_path / "l.json"), "--ref-host", "a", "--out",
              str(tmp_path / "c.json")], "param_bytes")
    (tmp_path / "mm.json").write_text(json.dumps({"format": "torchpp.memory_model/1", "base": -1e9, "alpha": 1,
                                                  "Kp": 1}))
    _refused(["plan", "--layers", str(world["la"]), str(world["lb"]), "--bandwidth", str(world["bw"]), "--devices",
              str(world["devices"]), "--memory-model", str(tmp_path / "mm.json"), "--out-dir", str(tmp_path / "o")],
             "base")


def test_numeric_flags(world, tmp_path):
    _refused(["simulate", "run", "--bwd-len", "1e308", "--no-gantt"], "--bwd-len")
    _refused(["simulate", "sweep", "-c", str(world["exp"]), "--workers", "0", "--output", str(tmp_path / "s.csv")],
             "--workers")
    _refused(["calibrate-memory", "--layers", str(world["la"]), "--model", "qwen3-tiny", "--threads", "0"], "--threads")
    _refused(["calibrate-memory", "--layers", str(world["la"]), "--model", "qwen3-tiny", "--timeout", "0"], "--timeout")
    _refused(["throttle", "cpu", "inf", "--", "true"], "cores")


def test_cluster_limits_refused(tmp_path):
    from torchpp.cluster.config import ClusterConfig

    base = json.loads((Path(__file__).parents[1] / "configs" / "cluster" / "pi3.json").read_text())
    for field, value in (("memory", "1e30G"), ("memory", 1), ("cpu", 1e-9)):
        cfg = json.loads(json.dumps(base))
        cfg["hosts"][0][field] = value
        (tmp_path / "c.json").write_text(json.dumps(cfg))
        with pytest.raises(FormatError, match=f"hosts\\[0\\].{field}.*(between|from)"):
            ClusterConfig.load(tmp_path / "c.json")
    _refused(["throttle", "mem", "1e30G", "--", "true"], "memory limit")
    _refused(["throttle", "mem", "1", "--", "true"], "memory limit")


def test_throttle_net_missing_device_one_line():
    _refused(["throttle", "net", "--dev", "nosuchdev0", "--rate", "10mbit"], "--dev", "nosuchdev0")
    _refused(["throttle", "net", "--dev", "lo", "--netns", "torchpp-nosuch", "--rate", "10mbit"], "--netns")


def test_training_refuses_a_sequence_longer_than_the_model_positions(tmp_path):
    """Checked while preparing, before any collective or any memory spent on the batch."""
    from torchpp.formats import FormatError
    from torchpp.models.presets import load_config, model_info
    from torchpp.plans import make_plan
    from torchpp.runtime.trainer import TrainConfig, prepare

    cfg = load_config("qwen3-tiny")
    info = model_info(cfg, "qwen3-tiny")
    too_long = int(cfg.max_position_embeddings) + 1
    path = tmp_path / "plan.json"
    make_plan(info, seq_len=too_long, global_batch=2, num_microbatches=1, layer_ranges=[(0, info.num_layers)],
              group_sizes=[1]).save(path)
    with pytest.raises(FormatError, match=rf"seq_len.*at most {too_long - 1}"):
        prepare(TrainConfig(plan=path, steps=1), world_size=1)
