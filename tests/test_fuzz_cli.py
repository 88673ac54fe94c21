"""Hostile inputs: every verb that reads flags or files refuses bad ones in one line (exit 2).

Generated tables of bad values (numbers out of range or not finite, unsafe host names, output
paths that are directories or lie under a file, missing / non-UTF-8 / non-JSON files, and files
with one field broken) are run in-process through ``torchpp.cli.main``: each must return 2,
print exactly one stderr line, no traceback, within a few seconds. None needs torch.
"""
from __future__ import annotations

import contextlib
import io
import json
import shutil
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable

import pytest

from torchpp.cli import main
from torchpp.planner.synthetic import layers_file, uniform_links

SECONDS_PER_CASE = 20.0
"""A case slower than this is unbounded work (the audit saw 300 s and more), not a slow machine:
one case takes well under a second idle, but a loaded 2-core machine has stretched one past 5 s."""
BAD_INTS = ["0", "-1", "-4", "1e12", "1000000000000", "abc", "", "1.5", "nan", "inf"]
BAD_FLOATS = ["inf", "-inf", "nan", "1e308", "-1", "abc", ""]
BAD_HOSTS = ["../../evil", "a/b", "a|a", "", " ", "a b", "..", ".hidden", "x" * 70, "a;rm"]


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict[str, Path]:
    """Valid inputs for every verb (made by torchpp itself), plus hostile paths."""
    d = tmp_path_factory.mktemp("fuzz")
    for h, speed in (("a", 1.0), ("b", 2.0)):
        layers_file(h, speed=speed).save(d / f"layers_{h}.json")
    uniform_links(["a", "b"]).save(d / "bw.json")
    (d / "devices.json").write_text(json.dumps({"a": 4, "b": 4}))
    (d / "links.csv").write_text("a,b,1\nb,a,1\n")
    w = {k: d / v for k, v in dict(la="layers_a.json", lb="layers_b.json", bw="bw.json", devices="devices.json",
                                    csv="links.csv", caps="caps.json", plan="planned/plan.json", traces="traces",
                                    dir="adir", file="afile", exp="exp.json", cluster="cluster.json").items()}
    w["root"] = d
    assert _run(["capacities", "--inputs", str(w["la"]), str(w["lb"]), "--ref-host", "a", "--out", str(w["caps"])])[0] == 0
    assert _run(["plan", *_search(w), "--out-dir", str(d / "planned")])[0] == 0
    assert _run(["simulate", "plan", str(w["plan"]), "--bandwidth", str(w["bw"]), "--layers", str(w["la"]),
                 str(w["lb"]), "--trace", str(w["traces"] / "timeline_step1_all.json")])[0] == 0
    w["dir"].mkdir()
    w["file"].write_text("x")
    (d / "nonutf8.json").write_bytes(b'{"format": "\xff\xfe"}')
    (d / "notjson.json").write_text("{not json")
    (d / "list.json").write_text("[]")
    (d / "empty.json").write_text("{}")
    (d / "v9.json").write_text('{"format": "torchpp.plan/9"}')
    (d / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    shutil.copy(Path(__file__).parents[1] / "configs" / "sim_experiment.json", w["exp"])
    shutil.copy(Path(__file__).parents[1] / "configs" / "cluster" / "pi3.json", w["cluster"])
    return w


def _search(w: dict[str, Path]) -> list[str]:
    return ["--layers", str(w["la"]), str(w["lb"]), "--capacities", str(w["caps"]), "--bandwidth", str(w["bw"]),
            "--devices", str(w["devices"])]


def _run(argv: list[str]) -> tuple[int, str, float]:
    err, out = io.StringIO(), io.StringIO()
    t0 = time.perf_counter()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            rc = main(argv)
        except SystemExit as e:  # main should return, but count an exit as its code
            rc = e.code if isinstance(e.code, int) else 1
        except BaseException as e:  # noqa: BLE001 (a traceback is the failure being counted)
            import traceback
            traceback.print_exc(file=err)
            rc = f"raised {type(e).__name__}"
    return rc, err.getvalue(), time.perf_counter() - t0


# ----------------------------------------------------------------------------- the tables
def _flag_cases(w: dict[str, Path]) -> list[tuple[str, list[str]]]:
    """Out-of-range or non-finite numbers on every numeric flag."""
    out = str(w["root"] / "out")
    fixed = ["plan", "--strategy", "pp", "--out", out + ".json"]
    search = ["plan", *_search(w), "--out-dir", out]
    replan = ["replan", "--plan", str(w["plan"]), "--traces", str(w["traces"]), "--out-dir", out]
    calib = ["calibrate-memory", "--layers", str(w["la"]), "--model", "qwen3-tiny"]
    prof = ["profile", "--model", "qwen3-tiny"]
    sweep = ["simulate", "sweep", "-c", str(w["exp"]), "--output", out + ".csv"]
    run = ["simulate", "run", "--no-gantt"]
    ints = [(fixed, f) for f in ("--global-batch", "--stages", "--microbatches", "--seq-len")]
    ints += [(search, f) for f in ("--global-batch", "--max-stages", "--exact-devices", "--max-group",
                                   "--micro-batch-sizes")]
    ints += [(replan, f) for f in ("--global-batch", "--max-stages", "--exact-devices", "--max-group", "--steps")]
    ints += [(calib, f) for f in ("--threads", "--samples", "--seq-len")]
    ints += [(prof, f) for f in ("--seq-len", "--iters", "--threads", "--layers")]
    ints += [(run, f) for f in ("-n", "--stages", "--sync-freq")] + [(sweep, "--workers")]
    floats = [(run, f) for f in ("--fwd-len", "--bwd-len", "--prop-len", "--sync-base-len", "--fwd-impact",
                                 "--bwd-impact", "--recv-capacity")]
    floats += [(search, "--activation-factor"), (search, "--optimizer-s-per-gb"), (calib, "--timeout"),
               (sweep, "--priority-step"), (["throttle", "cpu"], None)]
    cases = [("int flag", [*p, f"{f}={v}"]) for p, f in ints for v in BAD_INTS]
    for p, f in floats:
        cases += [("float flag", [*p, f"{f}={v}"] if f else [*p, "--", v, "--", "true"]) for v in BAD_FLOATS]
    cases += [("float flag", ["throttle", "cpu", v, "--", "true"]) for v in ("0", "1e-9", "1e9")]
    cases += [("memory size", ["throttle", "mem", v, "--", "true"]) for v in ("1e30G", "1", "0", "-1G", "1e-9", "x")]
    return cases


def _host_cases(w: dict[str, Path]) -> list[tuple[str, list[str]]]:
    out = str(w["root"] / "out.json")
    cases = [("host name", ["plan", "--strategy", "pp", "--out", out, f"--hosts={h},b"]) for h in BAD_HOSTS]
    cases += [("host name", ["plan", "--strategy", "pp", "--out", out, f"--hosts={h}"]) for h in ("a,a", "b,c,b")]
    cases += [("host name", ["profile", "--model", "qwen3-tiny", f"--host={h}"]) for h in BAD_HOSTS]
    cases += [("host name", ["capacities", "--inputs", str(w["la"]), f"--ref-host={h}", "--out", out])
              for h in BAD_HOSTS]
    return cases


def _output_cases(w: dict[str, Path]) -> list[tuple[str, list[str]]]:
    """Every output flag given a directory, a path under a file, or (for folders) a file."""
    f, under = str(w["file"]), str(w["file"] / "sub" / "x.json")
    files = [(["plan", "--strategy", "pp", "--out"], []),
             (["capacities", "--inputs", str(w["la"]), str(w["lb"]), "--ref-host", "a", "--out"], []),
             (["bandwidth", "parse", "--csv", str(w["csv"]), "--out"], []),
             (["simulate", "run", "--no-gantt", "--trace"], []), (["simulate", "run", "--gantt"], []),
             (["simulate", "plan", str(w["plan"]), "--bandwidth", str(w["bw"]), "--layers", str(w["la"]),
               str(w["lb"]), "--trace"], []),
             (["simulate", "sweep", "-c", str(w["exp"]), "--output"], []),
             (["calibrate-memory", "--layers", str(w["la"]), "--model", "qwen3-tiny", "--out"], []),
             (["profile", "--model", "qwen3-tiny", "--out"], []), (["profile", "--model", "qwen3-tiny", "--trace"], [])]
    dirs = [(["plan", *_search(w), "--out-dir"], []), (["analyze", str(w["traces"]), "--out"], []),
            (["replan", "--plan", str(w["plan"]), "--traces", str(w["traces"]), "--out-dir"], []),
            (["simulate", "all", "-c", str(w["exp"]), "--out-dir"], []),
            (["simulate", "heatmap", str(w["csv"]), "-o"], [])]
    cases = [("output path", [*p, v]) for p, _ in files for v in (str(w["dir"]), under, str(w["root"]))]
    cases += [("output path", [*p, v]) for p, _ in dirs for v in (f, under, str(w["file"] / "sub"))]
    return cases


BAD_FILES = ["missing.json", "adir", "nonutf8.json", "notjson.json", "list.json", "empty.json", "v9.json",
             "deep.json", "afile"]


def _input_cases(w: dict[str, Path]) -> list[tuple[str, list[str]]]:
    """Every input slot given a missing, directory, non-UTF-8, non-JSON, empty or wrong-format file."""
    o = str(w["root"] / "o")
    s = {k: str(v) for k, v in w.items()}
    slots: list[Callable[[str], list[str]]] = [
        lambda x: ["plan", "--layers", x, s["lb"], "--capacities", s["caps"], "--bandwidth", s["bw"],
                   "--devices", s["devices"], "--out-dir", o],
        lambda x: ["plan", *_search(w)[:5], "--capacities", x, "--out-dir", o],
        lambda x: ["plan", "--layers", s["la"], s["lb"], "--bandwidth", x, "--devices", s["devices"], "--out-dir", o],
        lambda x: ["plan", "--layers", s["la"], s["lb"], "--bandwidth", s["bw"], "--devices", x, "--out-dir", o],
        lambda x: ["plan", *_search(w), "--memory-model", x, "--out-dir", o],
        lambda x: ["capacities", "--inputs", s["la"], x, "--ref-host", "a", "--out", o + ".json"],
        lambda x: ["simulate", "plan", x, "--bandwidth", s["bw"], "--layers", s["la"], s["lb"], "--trace", o],
        lambda x: ["simulate", "plan", s["plan"], "--bandwidth", x, "--layers", s["la"], s["lb"], "--trace", o],
        lambda x: ["simulate", "plan", s["plan"], "--bandwidth", s["bw"], "--layers", x, "--trace", o],
        lambda x: ["simulate", "sweep", "-c", x, "--output", o + ".csv"],
        lambda x: ["analyze", s["traces"], "--plan", x, "--out", o],
        lambda x: ["analyze", s["traces"], "--predicted", x, "--out", o],
        lambda x: ["replan", "--plan", x, "--traces", s["traces"], "--out-dir", o],
        lambda x: ["replan", "--plan", s["plan"], "--traces", s["traces"], "--devices", x, "--out-dir", o],
        lambda x: ["calibrate-memory", "--layers", x, "--model", "qwen3-tiny", "--out", o + ".json"],
        lambda x: ["cluster", "up", "-c", x],
    ]
    cases = [("input file", slot(str(w["root"] / b))) for slot in slots for b in BAD_FILES
             if not (b == "empty.json" and slot(b)[1] == "sweep")]  # {}: every experiment field has a default
    cases += [("input file", ["bandwidth", "parse", "--csv", str(w["root"] / b), "--out", o + ".json"])
              for b in ("missing.csv", "adir", "nonutf8.json", "notjson.json")]
    return cases


def _set(data: Any, path: str, value: Any) -> Any:
    """``data`` with the field at dotted ``path`` (list indices as numbers) set to ``value``."""
    data = json.loads(json.dumps(data))
    *head, last = [int(p) if p.isdigit() else p for p in path.split(".")]
    node = data
    for p in head:
        node = node[p] if isinstance(node, list) or p in node else node[str(p)]  # "0": a rank-keyed object
    node[int(last) if isinstance(node, list) else (last if last in node else str(last))] = value
    return data


PLAN_MUTATIONS = [("seq_len", -1), ("seq_len", 10**9), ("global_batch", 10**12), ("global_batch", 0),
                  ("inputs", 5), ("inputs", {"a": 5}), ("predicted", 5), ("predicted", "x"), ("format", "torchpp.plan/9"),
                  ("stages.0.devices.0.share", 0.3), ("stages.0.devices.0.share", 5), ("stages.0.devices.0.share", -1),
                  ("stages.0.devices.0.host", "../../evil"), ("stages.0.devices.0.host", "a|a"),
                  ("stages.0.devices.0.rank", -1), ("stages.0.devices.0.rank", 10**9), ("stages.0.layers", [0, 99]),
                  ("stages", []), ("stages.0.recompute", [1]), ("model.num_layers", 10**9),
                  ("num_microbatches", 10**9), ("micro_batch_size", "4"), ("schedule", "zb"), ("stages.0", 5)]
BW_MUTATIONS = [("bytes_per_sec.a|b", 1e400), ("bytes_per_sec.a|b", -1), ("bytes_per_sec.a|b", 0),
                ("bytes_per_sec.a|a", 1e9), ("bytes_per_sec.evil/x|b", 1e9), ("bytes_per_sec.a|b", "fast"),
                ("bytes_per_sec.a|b", 1e300), ("latency_s", {"a|b": -1}), ("format", "torchpp.bandwidth/9"),
                ("bytes_per_sec", [])]
DEV_MUTATIONS = [("a", 1e300), ("a", -4), ("a", 0), ("a", "4G"), ("a", {"memory_gb": 1e300}),
                 ("a", {"memory_gb": 4, "rank": -1}), ("evil/x", 4), ("a|a", 4), ("a", None),
                 ("a", {"memory_gb": 4, "rank": 99}), ("a", {"memory_gb": 4, "rank": 2})]
LAYERS_MUTATIONS = [("layers.0.param_bytes", 10**30), ("layers.0.param_bytes", -1), ("layers.0.forward_time_s", -1),
                    ("layers.0.forward_time_s", 1e300), ("layers.0.activation_bytes_per_sample", 1e30),
                    ("model.num_layers", 10**9), ("host", "../../evil"), ("run.seq_len", 0),
                    ("format", "torchpp.layers/9"), ("layers", []), ("embed", None), ("run.batch", 10**12)]
CAPS_MUTATIONS = [("capacity.a", 0), ("capacity.a", 1e300), ("capacity.a", -1), ("ref_host", "zz"),
                  ("format", "torchpp.capacities/9"), ("capacity", {"../x": 1.0}), ("tables.a.batch", 10**40),
                  ("tables.a.batch", 1e40)]
MEM_MUTATIONS = [("base", -1e9), ("base", 1e300), ("alpha", -1), ("Kp", 1e300), ("format", "torchpp.memory_model/9"),
                 ("Kt", -1)]
TRACE_MUTATIONS = [("format", "torchpp.trace/9"), ("traceEvents", 5), ("traceEvents", [5]),
                   ("metadata.plan_hash", "sha256:0000000000000000"), ("metadata.world_size", float("inf")),
                   ("metadata.world_size", 99), ("metadata.ranks.0.stage", "x"), ("metadata.ranks.0.clock_rtt_s", "x")]
EXP_MUTATIONS = [("n", [10**9]), ("stages", [0]), ("fwd_len", [1e308]), ("bwd_len", [-1]), ("fwd_impact", [1.5]),
                 ("format", "torchpp.experiment/9"), ("n", []), ("sync_freq", []), ("sync_freq", [64]),
                 ("n", {"start": 3, "stop": 1, "step": 1})]
CLUSTER_MUTATIONS = [("hosts.0.memory", "1e30G"), ("hosts.0.memory", 1), ("hosts.0.memory", "0"),
                     ("hosts.0.cpu", 1e-9), ("hosts.0.cpu", 1e9), ("hosts.0.cpu", "inf"), ("hosts.0.name", "../x"),
                     ("name", "../../x"), ("hosts.0.rate", "1e308mbit"), ("format", "torchpp.cluster/9")]


def _trace_event_mutations(trace: dict[str, Any]) -> list[tuple[str, Any]]:
    """NaN timestamps, negative durations and malformed fields of the first compute event."""
    i = next(i for i, e in enumerate(trace["traceEvents"]) if e.get("ph") == "X")
    return [(f"traceEvents.{i}.{k}", v) for k, v in (("ts", float("nan")), ("dur", -5.0), ("ts", "x"), ("pid", "x"),
                                                     ("dur", float("inf")), ("args", 5), ("args.stage", "x"),
                                                     ("args.bytes", -1), ("pid", -1), ("ts", None), ("pid", 99),
                                                     ("name", "F99"), ("args.layers", 5), ("args.layers", [3, 0]))]


def _content_cases(w: dict[str, Path]) -> list[tuple[str, list[str]]]:
    """One field of a valid file broken, fed to the verbs that read that file."""
    d, o = w["root"], str(w["root"] / "o")
    s = {k: str(v) for k, v in w.items()}
    trace_file = w["traces"] / "timeline_step1_all.json"
    trace = json.loads(trace_file.read_text())
    targets = [("plan", w["plan"], PLAN_MUTATIONS, [
                   lambda x: ["simulate", "plan", x, "--bandwidth", s["bw"], "--layers", s["la"], s["lb"], "--trace", o],
                   lambda x: ["analyze", s["traces"], "--plan", x, "--out", o]]),
               ("bandwidth", w["bw"], BW_MUTATIONS, [lambda x: ["plan", *_search(w)[:5], "--bandwidth", x,
                                                                "--devices", s["devices"], "--out-dir", o]]),
               ("devices", w["devices"], DEV_MUTATIONS, [lambda x: ["plan", *_search(w)[:7], "--devices", x,
                                                                    "--out-dir", o]]),
               ("layers", w["la"], LAYERS_MUTATIONS, [
                   lambda x: ["capacities", "--inputs", x, s["lb"], "--ref-host", "b", "--out", o + ".json"]]),
               ("capacities", w["caps"], CAPS_MUTATIONS, [lambda x: ["plan", *_search(w)[:3], "--capacities", x,
                                                                     *_search(w)[5:], "--out-dir", o]]),
               ("memory model", None, MEM_MUTATIONS, [lambda x: ["plan", *_search(w), "--memory-model", x,
                                                                 "--out-dir", o]]),
               ("trace", trace_file, TRACE_MUTATIONS + _trace_event_mutations(trace), [
                   lambda x: ["analyze", str(Path(x).parent), "--plan", s["plan"], "--out", o],
                   lambda x: ["replan", "--plan", s["plan"], "--traces", str(Path(x).parent), *_search(w)[:5],
                              "--out-dir", o]]),
               ("experiment", w["exp"], EXP_MUTATIONS, [lambda x: ["simulate", "sweep", "-c", x, "--output", o]]),
               ("cluster config", w["cluster"], CLUSTER_MUTATIONS, [lambda x: ["cluster", "up", "-c", x]])]
    mm = {"format": "torchpp.memory_model/1", "base": 1e8, "alpha": 1.0, "Kp": 1.0}
    cases = []
    for name, src, mutations, verbs in targets:
        base = mm if src is None else json.loads(src.read_text())
        for j, (path, value) in enumerate(mutations):
            folder = d / "mut" / f"{name.replace(' ', '_')}{j}"
            folder.mkdir(parents=True, exist_ok=True)
            f = folder / (src.name if src is not None else "mm.json")
            f.write_text(json.dumps(_set(base, path, value)))
            cases += [(f"{name} field", verb(str(f))) for verb in verbs]
    return cases


def _audit_cases(w: dict[str, Path]) -> list[tuple[str, list[str]]]:
    """The audit's unbounded reads and tracebacks: devices, FIFOs, huge files, a cluster that is not up."""
    import os

    d = w["root"]
    fifo = d / "links.fifo"
    if not fifo.exists():
        os.mkfifo(fifo)
    big = d / "huge.csv"
    if not big.exists():
        with open(big, "w") as f:
            f.write("a,b,1\nb,a,1\n" * 1_000_000)
    o = str(d / "audit_out.json")
    topo = str(Path(__file__).parents[1] / "configs" / "topologies" / "wifi_8.json")
    sim_topo = ["simulate", "topology", str(w["plan"]), "--topology", topo, "--model", "qwen3-tiny", "--flops", "1e12"]
    cases = [("audit", [*sim_topo, f"{f}={v}"]) for f in ("--flops", "--tp") for v in ("0", "-1", "nan", "inf", "1e400")]
    for j, bad in enumerate(({"flops": -1}, {"flops": "x"}, [], {"flops": float("inf")}, {"devices": {"g": 5}},
                             {"devices": {}})):
        spec = d / f"audit_spec{j}.json"
        spec.write_text(json.dumps(bad))
        cases.append(("audit", ["plan", "--estimate", "--model", "qwen3-tiny", "--device-spec", str(spec),
                                "--topology", topo, "--devices", "8", "--out-dir", str(d / "audit_topo")]))
    return cases + [("audit", ["bandwidth", "parse", "--csv", src, "--out", o])
                    for src in ("/dev/zero", str(fifo), str(big))] \
        + [("audit", ["run", "--cluster", "nonexistent", "--plan", str(w["plan"]), "--checkpoint-dir",
                      str(d / "audit_ck"), "--", "--steps", "1"])]


def all_cases(w: dict[str, Path]) -> list[tuple[str, list[str]]]:
    return (_flag_cases(w) + _host_cases(w) + _output_cases(w) + _input_cases(w) + _content_cases(w)
            + _audit_cases(w))


def _outcome(rc: Any, err: str, dt: float) -> str:
    lines = err.strip().splitlines()
    if "Traceback" in err or not isinstance(rc, int):
        return "traceback"
    if dt > SECONDS_PER_CASE:
        return "slow"
    if rc == 0:
        return "accepted"
    if rc != 2 or len(lines) != 1 or ": error: " not in lines[0]:
        return f"exit {rc}, {len(lines)} line(s)"
    return "one-line error"


def test_fuzz_every_verb_refuses_bad_input_in_one_line(world, monkeypatch, capsys):
    import torchpp.cluster.cluster as cluster

    monkeypatch.setattr(cluster, "up", lambda *a, **k: pytest.fail("cluster up reached with a bad config"))
    cases = all_cases(world)
    assert len(cases) >= 500
    table: Counter = Counter()
    bad = []
    for category, argv in cases:
        rc, err, dt = _run(argv)
        outcome = _outcome(rc, err, dt)
        table[category, outcome] += 1
        if outcome != "one-line error":
            bad.append(f"{outcome}: torchpp {' '.join(argv)}\n    {err.strip()[-400:]}")
    with capsys.disabled():
        print(f"\n{'category':<22} {'outcome':<16} count")
        for (category, outcome), n in sorted(table.items()):
            print(f"{category:<22} {outcome:<16} {n}")
        print(f"{'total':<22} {'':<16} {sum(table.values())}")
    assert not bad, f"{len(bad)} of {len(cases)} bad inputs not refused in one line:\n" + "\n".join(bad[:40])
