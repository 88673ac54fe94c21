"""Under `torchpp run --elastic`, a rank that exits 2 (a bad train argument, plan or file) stops
the run with the rank's own line: no host is dropped and nothing is re-planned."""
from __future__ import annotations

import json

import pytest

from test_elastic import _env, first_plan, measurements
from torchpp.elastic.driver import ConfigurationError, Driver, ElasticConfig, LocalLauncher


@pytest.mark.parametrize("train_args", [["--steps", "0"], ["--stpes", "3"]])
def test_a_train_flag_error_stops_the_run_with_the_ranks_line(tmp_path, train_args):
    cfg = ElasticConfig(plan=first_plan(tmp_path / "plan.json"), train_args=[*train_args, "--threads", "1"],
                        checkpoint_dir=tmp_path / "ck", work_dir=tmp_path / "work", timeout_s=20, startup_s=150,
                        max_restarts=3, **measurements(tmp_path))
    driver = Driver(cfg, LocalLauncher(_env()))
    with pytest.raises(ConfigurationError) as err:
        driver.run()
    line = str(err.value)
    expect = "--steps: expected a positive number" if train_args[0] == "--steps" else "unrecognized arguments: --stpes"
    assert expect in line and "\n" not in line, line
    assert len(driver.attempts) == 1 and not driver.failed
    decisions = [json.loads(x) for x in driver.decisions.read_text().splitlines()]
    assert [d["kind"] for d in decisions] == ["stop"], decisions


def test_replan_searches_what_the_first_search_allowed_and_then_whatever_fits(tmp_path):
    from torchpp.elastic.survivors import first_search_schedule, plan_survivors
    from torchpp.formats import Plan

    plan = first_plan(tmp_path / "plan.json")
    assert first_search_schedule(plan) == "auto"  # no plan_meta.json: every kind
    (tmp_path / "plan_meta.json").write_text(json.dumps({"schedule": "interleaved-zb"}))
    assert first_search_schedule(plan) == "interleaved-zb"
    cfg = ElasticConfig(plan=plan, train_args=[], checkpoint_dir=tmp_path / "ck", work_dir=tmp_path / "work",
                        timeout_s=20, startup_s=150, max_restarts=1, **measurements(tmp_path))
    # one survivor: no chunked kind fits one device, so the re-plan takes what does
    new = plan_survivors(cfg, Plan.load(plan), ["h0"], tmp_path / "re")
    assert new.plan.world_size == 1 and new.hosts == ["h0"]
