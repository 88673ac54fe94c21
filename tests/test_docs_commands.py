"""Every command shown in README.md, docs/ and benchmarks/README.md is checked here.

Each fenced ``bash`` block is read command by command: a ``torchpp`` verb, ``torchpp.train`` or a
benchmark must name only options its parser has, every repository file it names must exist, and
every ``python -m`` module must import. The cheap commands also run for real with small
arguments; the ones that cannot run here (they set up the venv, need root, or train for minutes)
are listed in ``NOT_RUN`` with the reason, and that list must match what the pages show.
"""
from __future__ import annotations

import argparse
import ast
import glob
import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "benchmarks" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# Commands that only have their options and files checked here, by their first words.
NOT_RUN: dict[str, str] = {
    "bash launch/demo.sh": "sets up .venv and runs the whole demo (minutes); test_demo runs its quick form",
    "bash launch/test.sh": "sets up .venv and runs the whole suite",
    "torchpp demo": "minutes of training; tests/test_demo.py runs the loop",
    "torchpp profile": "profiles a model for tens of seconds; tests/test_profile.py runs it",
    "torchpp capacities": "needs layers files from profile; tests/test_planner_inputs.py runs it",
    "torchpp bandwidth probe": "one process per host under torchrun; tests cover the probe",
    "torchpp calibrate-memory": "trains random spans in fresh processes (minutes)",
    "torchpp plan": "needs measured files; tests/test_planner_*.py run it",
    "torchpp replan": "needs a run's traces; tests/test_planner_replan*.py run it",
    "torchpp analyze": "needs a run's traces; tests/test_analyze.py runs it",
    "torchpp speed-check": "re-times a host's profile; tests/test_speed_check.py runs it",
    "torchpp simulate plan": "needs measured files; tests/test_replay.py prices plans",
    "torchpp simulate check-reference": "exits 1 on the one case known to differ; tests/test_sim_seed002.py runs every case",
    "torchpp simulate all": "a whole sweep with heatmaps; tests/test_sim_sweep.py runs small ones",
    "torchpp cluster": "root: network namespaces, cgroups and tc (tests marked root)",
    "torchpp throttle": "root: cgroups and tc (tests marked root)",
    "torchrun": "multi-process training; tests/test_runtime*.py and test_training_essentials run it",
    "python benchmarks/": "benchmarks take minutes; their options are checked",
    "sudo": "root: emulated clusters (tests marked root); the command's options are checked",
    "torchpp data prepare": "the README's own-data section; tests/test_readme_own_data.py runs it as written",
    "MODEL=": "the README's own-data section's variables; tests/test_readme_own_data.py sets them",
    "python -c": "the README's own-data section loads the export; tests/test_readme_own_data.py runs it",
}

# Commands run for real, with the arguments the page shows (in a temporary directory).
RUN = ("torchpp simulate run", "torchpp bandwidth parse")


def shown_commands() -> list[tuple[str, str]]:
    """(page, command) for every command line of every fenced bash block."""
    out = []
    for page in PAGES:
        text = page.read_text()
        for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
            for line in block.replace("\\\n", " ").splitlines():
                if line.strip():
                    out.append((str(page.relative_to(ROOT)), line.strip()))
    return out


COMMANDS = shown_commands()


def words(command: str) -> list[str]:
    """The command's words: comments, ``[optional]`` brackets and ``sudo``/venv prefixes removed."""
    ws = shlex.split(command.replace("[", " ").replace("]", " "), comments=True)
    while ws and ws[0] == "sudo":
        ws = ws[1:]
    if ws and ws[0].endswith("bin/python"):
        ws[0] = "python"
    return ws


def subparser(parser: argparse.ArgumentParser, ws: list[str]) -> tuple[argparse.ArgumentParser, list[str]]:
    """The (sub)parser that ``ws``'s leading positional words choose, and the words left."""
    while ws:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs or ws[0] not in subs[0].choices:
            break
        parser, ws = subs[0].choices[ws[0]], ws[1:]
    return parser, ws


def check_options(parser: argparse.ArgumentParser, ws: list[str], command: str) -> None:
    known = set(parser._option_string_actions)
    for w in ws:
        if w == "--":
            break
        if w.startswith("-") and not re.fullmatch(r"-\d.*", w):
            assert w.split("=")[0] in known, f"{command!r}: {parser.prog} has no option {w}"


def script_options(path: Path) -> set[str] | None:
    """The option strings a script's argparse parser declares (None: it has no parser)."""
    tree = ast.parse(path.read_text())
    opts = {a.value for n in ast.walk(tree) if isinstance(n, ast.Call)
            and getattr(n.func, "attr", "") == "add_argument" for a in n.args
            if isinstance(a, ast.Constant) and isinstance(a.value, str) and a.value.startswith("-")}
    return opts if "ArgumentParser" in path.read_text() else None


def check_files(ws: list[str], command: str) -> None:
    """Files of this repository that the command names exist."""
    for w in ws:
        if re.match(r"(configs|benchmarks|launch|torchpp|tests)/", w):
            assert glob.glob(str(ROOT / w)), f"{command!r} names {w}, which does not exist"


def check(command: str) -> None:
    """Options and files of one command (and of the command it runs after ``--``)."""
    ws = words(command)
    check_files(ws, command)
    inner = ws[ws.index("--") + 1:] if "--" in ws else []
    if ws[0] == "torchpp":
        from torchpp.cli import build_parser
        parser, rest = subparser(build_parser(), ws[1:])
        assert parser.prog != "torchpp", f"{command!r}: no such verb"
        check_options(parser, rest, command)
    elif ws[0] == "torchrun" or ws[:3] == ["python", "-m", "torchpp.train"]:
        from torchpp.train import build_parser
        check_options(build_parser(), ws[ws.index("torchpp.train") + 1:], command)
    elif all(re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", w) for w in ws):
        pass  # variables the commands below use
    elif ws[0] == "python" and ws[1] == "-c":
        compile(ws[2], command, "exec")  # the code parses
    elif ws[0] == "python" and ws[1] == "-m":
        assert importlib.util.find_spec(ws[2]) is not None, f"{command!r}: no module {ws[2]}"
    elif ws[0] == "python":
        opts = script_options(ROOT / ws[1])
        given = [w for w in ws[2:] if w.startswith("--")]
        assert opts is not None or not given, f"{command!r}: {ws[1]} takes no options"
        assert set(given) <= (opts or set()), f"{command!r}: {ws[1]} has no option {set(given) - opts}"
    elif ws[0] == "bash":
        assert (ROOT / ws[1]).is_file(), f"{command!r}: no script {ws[1]}"
    else:
        raise AssertionError(f"{command!r}: a command this test does not know; teach it or list it")
    if inner:
        check(shlex.join(inner))


@pytest.mark.parametrize("page,command", COMMANDS, ids=[f"{p}:{c[:60]}" for p, c in COMMANDS])
def test_shown_command_parses(page: str, command: str) -> None:
    check(command)
    ws = words(command)
    runs = any(shlex.join(ws).startswith(r) for r in RUN)
    listed = any(command.startswith(k) or shlex.join(ws).startswith(k) for k in NOT_RUN)
    assert runs or listed, f"{page}: {command!r} is neither run here nor listed in NOT_RUN with a reason"


def test_not_run_list_is_current() -> None:
    """Every reason in NOT_RUN still belongs to a command the pages show."""
    shown = [c for _, c in COMMANDS] + [shlex.join(words(c)) for _, c in COMMANDS]
    stale = [k for k in NOT_RUN if not any(c.startswith(k) for c in shown)]
    assert not stale, f"NOT_RUN lists commands no page shows: {stale}"


@pytest.mark.parametrize("prefix", RUN)
def test_cheap_commands_run(prefix: str, tmp_path: Path) -> None:
    """The cheap commands, exactly as shown, run and write what they say."""
    shown = [shlex.join(words(c)) for _, c in COMMANDS if shlex.join(words(c)).startswith(prefix)]
    assert shown, f"no page shows {prefix!r} any more"
    (tmp_path / "links.csv").write_text("a,b,1.0\nb,a,1.0\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "MPLBACKEND": "Agg"}
    for cmd in shown:
        ws = words(cmd)
        r = subprocess.run([sys.executable, "-m", "torchpp.cli", *ws[1:]], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, f"{cmd}: {r.stderr[-2000:]}"
        for i, w in enumerate(ws):
            if w in ("--out", "--gantt") and i + 1 < len(ws):
                assert (tmp_path / ws[i + 1]).exists(), f"{cmd} wrote no {ws[i + 1]}"
