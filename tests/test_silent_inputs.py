"""Inputs that were once answered silently or with a traceback (issue 37): each is now one line
naming the file, the field and what was expected (exit 2), or a correct answer.

In-process through ``torchpp.cli.main`` on files torchpp itself made; none needs torch.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from torchpp.cli import main
from torchpp.planner.synthetic import layers_file, uniform_links


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("silent")
    for h, speed in (("a", 1.0), ("b", 2.0)):
        layers_file(h, speed=speed).save(d / f"layers_{h}.json")
    uniform_links(["a", "b"]).save(d / "bw.json")
    (d / "devices.json").write_text(json.dumps({"a": 4, "b": 4}))
    w = {"root": d, "la": d / "layers_a.json", "lb": d / "layers_b.json", "bw": d / "bw.json",
         "devices": d / "devices.json", "caps": d / "caps.json", "plan": d / "planned" / "plan.json",
         "traces": d / "traces"}
    assert main(["capacities", "--inputs", str(w["la"]), str(w["lb"]), "--ref-host", "a", "--out", str(w["caps"])]) == 0
    assert main(["plan", *_search(w), "--out-dir", str(d / "planned")]) == 0
    assert main(["simulate", "plan", str(w["plan"]), "--bandwidth", str(w["bw"]), "--layers", str(w["la"]),
                 str(w["lb"]), "--trace", str(w["traces"] / "timeline_step1_all.json")]) == 0
    return w


def _search(w: dict[str, Path], **swap: Path) -> list[str]:
    f = {**w, **swap}
    return ["--layers", str(f["la"]), str(f["lb"]), "--capacities", str(f["caps"]), "--bandwidth", str(f["bw"]),
            "--devices", str(f["devices"])]


def _refused(capsys, argv: list[str], *expected: str) -> str:
    """Run ``torchpp argv``: exit 2 and one stderr line holding every ``expected`` piece."""
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and ": error: " in err, err
    for piece in expected:
        assert piece in err, (piece, err)
    return err


def _mutated(src: Path, dst: Path, edit: Any) -> Path:
    data = json.loads(src.read_text())
    edit(data)
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_text(json.dumps(data))
    return dst


def test_capacities_table_batch_beyond_any_profile_is_refused(world, capsys):
    """A table batch of 1e40 made every per-sample time vanish (a 1-stage plan instead of the
    measured answer); the batch is a profile's and is bounded like a layers file's ``run.batch``."""
    for v in (10**40, 5000):
        caps = _mutated(world["caps"], world["root"] / f"caps_batch{v}.json",
                        lambda c: c["tables"]["a"].__setitem__("batch", v))
        _refused(capsys, ["plan", *_search(world, caps=caps), "--out-dir", str(world["root"] / "o")],
                 str(caps), "tables.a.batch", "<= 4096")
