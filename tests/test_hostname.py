"""One host name rule (torchpp.hostname) shared by profile, bandwidth probe, traces and speed checks."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from torchpp.hostname import host_name, host_source, machine_name
from torchpp.runtime.launch import popen_ranks, wait_ranks

ROOT = Path(__file__).resolve().parents[1]


def test_rule_order_flag_then_torchpp_host_then_host_then_hostname():
    env = {"TORCHPP_HOST": "pi1", "HOST": "pi2"}
    assert host_name("lap", env) == "lap" and host_source("lap", env) == "--host"
    assert host_name(None, env) == "pi1" and host_source(None, env) == "TORCHPP_HOST"
    assert host_name(None, {"HOST": "pi2"}) == "pi2" and host_source(None, {"HOST": "pi2"}) == "HOST"
    assert host_name(None, {}) == socket.gethostname() == machine_name()
    assert host_name(None, {}, default="ref") == "ref" and host_source(None, {}) == "hostname"
    assert host_name(None, {"TORCHPP_HOST": "", "HOST": "pi2"}) == "pi2"  # empty means unset


@pytest.mark.parametrize("var", ["TORCHPP_HOST", "HOST"])
def test_a_bad_name_in_the_environment_names_the_variable(var):
    with pytest.raises(ValueError, match=f"^{var}: expected a host name"):
        host_name(None, {var: "a/b"})


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHPP_HOST", "HOST")}
    return {**env, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", **extra}


def test_profile_file_and_host_field_follow_torchpp_host(tmp_path):
    r = subprocess.run([sys.executable, "-m", "torchpp.cli", "profile", "--model", "qwen3-tiny", "--layers", "1",
                        "--seq-len", "8", "--iters", "1", "--warmup", "0", "--no-call-probe", "--quiet"],
                       cwd=tmp_path, env=_env(TORCHPP_HOST="pi7"), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "layers_pi7.json").read_text())["host"] == "pi7"
    bad = subprocess.run([sys.executable, "-m", "torchpp.cli", "profile", "--model", "qwen3-tiny", "--quiet"],
                         cwd=tmp_path, env=_env(TORCHPP_HOST="no good"), capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0 and "TORCHPP_HOST" in bad.stderr


def test_bandwidth_probe_and_traces_name_ranks_by_the_same_rule(tmp_path):
    """Two ranks on one machine played as hosts pi0 and pi1: the probe's links and the training
    traces both name them so, without the hostname or a rank suffix."""
    from torchpp.models.presets import load_config, model_info
    from torchpp.planner.simple import make_plan

    names = lambda r: {"TORCHPP_HOST": f"pi{r}"}  # noqa: E731
    procs = popen_ranks([sys.executable, "-m", "torchpp.cli", "bandwidth", "probe", "--sizes", "64K", "--repeats",
                         "1", "--pings", "2", "--out-dir", str(tmp_path)], 2, env=_env(), per_rank=names,
                        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    assert [rc for rc, _, _ in wait_ranks(procs, timeout_s=240)] == [0, 0]
    links = json.loads((tmp_path / "bandwidth.json").read_text())["bytes_per_sec"]
    assert sorted(links) == ["pi0|pi1", "pi1|pi0"]

    info = model_info(load_config("qwen3-tiny"), "qwen3-tiny")
    make_plan(info, seq_len=16, global_batch=4, num_microbatches=2, layer_ranges=[(0, 2), (2, 4)],
              group_sizes=[1, 1], schedule="1f1b").save(tmp_path / "plan.json")
    procs = popen_ranks([sys.executable, "-m", "torchpp.train", "--plan", str(tmp_path / "plan.json"), "--steps", "2",
                         "--threads", "1", "--timeout-s", "120", "--trace-dir", str(tmp_path / "tr"),
                         "--trace-steps", "2"], 2, env=_env(), per_rank=names,
                        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    assert [rc for rc, _, _ in wait_ranks(procs, timeout_s=300)] == [0, 0]
    merged = json.loads((tmp_path / "tr" / "timeline_step2_all.json").read_text())
    procs_named = sorted(e["args"]["name"] for e in merged["traceEvents"]
                         if e.get("ph") == "M" and e.get("name") == "process_name")
    assert [n.rsplit("host ", 1)[1] for n in procs_named] == ["pi0", "pi1"], procs_named


def test_speed_check_refuses_another_hosts_reference(tmp_path, monkeypatch, capsys):
    from torchpp.cli import main
    from torchpp.planner.synthetic import layers_file

    layers_file("pi1").save(tmp_path / "layers_pi1.json")
    monkeypatch.setenv("TORCHPP_HOST", "pi2")
    assert main(["speed-check", "--reference", str(tmp_path / "layers_pi1.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "expected this host's layers file ('pi2', from TORCHPP_HOST), got 'pi1'" in err


def test_emulated_hosts_are_named_over_a_torchpp_host_in_the_callers_environment():
    """`torchpp cluster run` names each host; a TORCHPP_HOST exported in the caller's shell must not
    name them all alike."""
    from torchpp.cluster.cluster import host_env

    state = {"name": "t", "master_addr": "10.77.0.1", "master_port": 29511,
             "hosts": [{"name": "a", "cpu": 0.5}, {"name": "b", "cpu": 1.5}]}
    envs = [host_env(state, i, base={"TORCHPP_HOST": "mine"}) for i in (0, 1)]
    assert [host_name(None, env) for env in envs] == ["a", "b"]
