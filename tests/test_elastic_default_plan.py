"""Elastic on the planner's own choice: `torchpp plan` with its default --schedule picks a chunked
kind for three hosts whose lm_head is slow; under `torchpp run --elastic` one host's rank is
killed, the survivors are planned again (any kind that fits them, not only the first plan's)
and the run finishes its steps on the two hosts left."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from test_runtime_failures import ROOT, _env
from torchpp.formats import MULTI_CHUNK, Plan
from torchpp.models.presets import load_config
from torchpp.planner.synthetic import layers_file, uniform_links
from torchpp.runtime import checkpoint as ckpt
from torchpp.runtime.launch import kill_rank_after_checkpoint

HOSTS = ("h0", "h1", "h2")
STEPS, KILL_AFTER = 4, 1


def _measurements(d: Path) -> list[str]:
    """Three equal hosts of qwen3-tiny (synthetic times: a slow tail, heavy layers), as `torchpp plan` reads them."""
    cfg = load_config("qwen3-tiny")
    args = ["--layers"]
    for h in HOSTS:
        f = d / f"layers_{h}.json"
        layers_file(h, num_layers=4, batch=2, seq_len=16, model_name="qwen3-tiny", hidden_size=cfg.hidden_size,
                    vocab_size=cfg.vocab_size, tied=True, layer_param_bytes=20_000_000, embed_param_bytes=130_000,
                    tail_param_bytes=130_000, tail_fwd_s=2.0).save(f)
        args.append(str(f))
    uniform_links(HOSTS, 1e8).save(d / "bandwidth.json")
    (d / "devices.json").write_text(json.dumps({h: 4.0 for h in HOSTS}))
    return [*args, "--devices", str(d / "devices.json"), "--bandwidth", str(d / "bandwidth.json")]


@pytest.mark.timeout(1800)  # a plan and two attempts of 3 and 2 ranks: 600 s ran out on a 2-core machine under load
def test_the_default_plan_loses_a_host_and_finishes_on_the_survivors(tmp_path):
    meas = _measurements(tmp_path)
    made = subprocess.run([sys.executable, "-m", "torchpp.cli", "plan", *meas, "--out-dir", str(tmp_path / "plan")],
                          env=_env(), cwd=ROOT, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300)
    assert made.returncode == 0, made.stderr[-3000:]
    plan = Plan.load(tmp_path / "plan" / "plan.json")
    assert plan.schedule in MULTI_CHUNK and plan.world_size == 3, (plan.schedule, plan.world_size)
    victim = plan.world_size - 1
    lost = plan.device_of_rank(victim).host
    ck, work, logs = tmp_path / "ck", tmp_path / "work", tmp_path / "logs"
    box: dict = {}
    killer = threading.Thread(target=kill_rank_after_checkpoint, args=(ck, KILL_AFTER, victim, box),
                              kwargs={"timeout_s": 600}, daemon=True)
    killer.start()
    run = subprocess.run([sys.executable, "-m", "torchpp.cli", "run", "--elastic", "--plan",
                          str(tmp_path / "plan" / "plan.json"), *meas, "--checkpoint-dir", str(ck), "--work-dir",
                          str(work), "--timeout-s", "30", "--startup-s", "400", "--max-restarts", "1", "--",
                          "--steps", str(STEPS), "--threads", "1", "--checkpoint-every", "1", "--log-dir", str(logs)],
                         env=_env(), cwd=ROOT, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=1200)
    killer.join(1)
    assert "killed_at" in box, run.stdout[-3000:]
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    attempts = re.findall(r"^attempt (\d): (\d) rank\(s\) on ([^,\n]+(?:, [^,\n]+)*), from step (\d+): (\w+)(.*)$",
                          run.stdout, re.M)
    assert len(attempts) == 2, run.stdout[-3000:]
    assert attempts[0][1] == "3" and attempts[0][4] == "failure" and lost in attempts[0][5], attempts
    assert attempts[1][1] == "2" and attempts[1][4] == "done" and lost not in attempts[1][2], attempts
    assert KILL_AFTER <= int(attempts[1][3]) < STEPS, attempts
    assert ckpt.is_complete(ckpt.step_dir(ck, STEPS))
    decisions = [json.loads(x) for x in (work / "decisions.jsonl").read_text().splitlines()]
    assert [d["kind"] for d in decisions] == ["failure", "plan", "resume"], decisions
    second = Plan.load(decisions[1]["plan"])
    assert second.world_size == 2 and lost not in {d.host for s in second.stages for d in s.devices}
    steps = [json.loads(x) for x in (logs / "metrics.jsonl").read_text().splitlines()]
    assert max(e["step"] for e in steps if "loss" in e) == STEPS
