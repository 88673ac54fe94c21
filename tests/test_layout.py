"""torchpp's layering, read off the source with ``ast`` (nothing is imported or run).

DESIGN.md 'Layout': each part (a top-level module or package of torchpp) imports only parts
below it, so there is no import cycle between parts; library code never imports a command-line
module; functions are short enough to read at once. Imports inside functions count as much as
those at the top of a module: a lazy import is still a dependency.
"""
from __future__ import annotations

import ast
import functools
from collections import defaultdict
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "torchpp"

LAYERS: tuple[tuple[str, ...], ...] = (
    ("__init__", "errors", "validate", "_timer"),
    ("formats", "argtypes", "hostname"),
    ("schedules",),
    ("models", "plans", "data", "wire"),
    ("cost", "topology", "trace"),
    ("sim",),
    ("planner",),
    ("runtime",),
    ("profiling", "cluster"),
    ("elastic",),
    ("train", "demo", "cli"),
    ("__main__",),
)
"""Parts from the bottom up, in DESIGN.md's 'Layout' order: a part may import parts of earlier rows
only (not its own row's). Parts DESIGN does not list: ``plans`` builds plans (below the simulator
and the planner), ``topology`` the network graphs the simulator routes over, ``_timer`` the
compiled span timer, ``hostname`` the one rule that names a host, ``wire`` the wire codecs (the
runtime's p2p uses them, profiling measures them), ``elastic`` drives the runtime, the emulated cluster and the planner. Where
the code sits lower than DESIGN's list: ``data`` (the runtime reads it), ``trace`` (the
simulator, the runtime and profiling write traces); ``profiling`` sits above the runtime (its
call probe runs the runtime's actions)."""

CLI_NAMES = ("cli", "train", "demo", "__main__")
"""Modules that parse arguments and print for people (and any ``*_cli``); no library module imports them."""

MAX_FUNCTION_LINES = 80
FUNCTION_LENGTH_EXEMPT_FOLDERS: tuple[str, ...] = ()
"""Folders of torchpp whose functions are not held to MAX_FUNCTION_LINES yet (being split)."""


def rank_of() -> dict[str, int]:
    return {part: i for i, row in enumerate(LAYERS) for part in row}


def sources() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def part(path: Path) -> str:
    rel = path.relative_to(PACKAGE).parts
    return rel[0].removesuffix(".py")


def is_cli(name: str) -> bool:
    return name in CLI_NAMES or name.endswith("_cli")


def imported(path: Path, node: ast.Import | ast.ImportFrom) -> list[list[str]]:
    """The torchpp modules (as name components below ``torchpp``) an import statement names."""
    if isinstance(node, ast.Import):
        return [a.name.split(".")[1:] for a in node.names if a.name.startswith("torchpp.")]
    if node.level:
        here = list(path.parent.relative_to(PACKAGE).parts)
        base = here[: len(here) - (node.level - 1)]
    elif node.module == "torchpp" or (node.module or "").startswith("torchpp."):
        base, node = [], ast.ImportFrom(module=node.module.partition(".")[2] or None, names=node.names, level=0)
    else:
        return []
    if node.module:
        return [base + node.module.split(".")]
    return [base + [a.name] for a in node.names]


@functools.cache
def imports() -> list[tuple[Path, int, list[str]]]:
    """Every import of a torchpp module in torchpp, at module level or inside functions."""
    out = []
    for path in sources():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                out += [(path, node.lineno, t) for t in imported(path, node) if t]
    return out


def part_edges() -> dict[tuple[str, str], list[str]]:
    """(importing part, imported part) -> where (file:line)."""
    edges: dict[tuple[str, str], list[str]] = defaultdict(list)
    for path, line, target in imports():
        a, b = part(path), target[0]
        if a != b:
            edges[(a, b)].append(f"{path.relative_to(PACKAGE.parent)}:{line}")
    return edges


def test_every_part_has_a_layer():
    parts = {part(p) for p in sources()} | {b for _, b in part_edges()}
    missing = sorted(parts - set(rank_of()))
    assert not missing, f"parts of torchpp with no row in LAYERS: {missing}"


def test_no_import_cycle_between_parts():
    graph: dict[str, set[str]] = defaultdict(set)
    for a, b in part_edges():
        graph[a].add(b)
    cycles = graph_cycles(graph)
    assert not cycles, "import cycles between parts of torchpp: " + "; ".join(sorted(cycles))


def test_parts_import_only_parts_below_them():
    rank = rank_of()
    upward = [f"{a} -> {b} ({', '.join(where[:3])})" for (a, b), where in sorted(part_edges().items())
              if a in rank and b in rank and rank[b] >= rank[a]]
    assert not upward, "imports of a part at or above the importer's row in LAYERS:\n  " + "\n  ".join(upward)


def module_of(target: list[str]) -> str:
    """The torchpp module (dotted, below ``torchpp``) an import names: the deepest existing file or
    package of its components (``from ..cost import Links`` is the package ``cost``)."""
    best = "__init__"
    for i in range(1, len(target) + 1):
        base = PACKAGE.joinpath(*target[:i])
        if base.with_suffix(".py").is_file():
            return ".".join(target[:i])
        if (base / "__init__.py").is_file():
            best = ".".join(target[:i])
        else:
            break
    return best


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" and len(rel.parts) > 1 else rel.parts
    return ".".join(parts)


def module_cycles() -> set[str]:
    """Import circles between torchpp's modules (inside a folder included), imports inside functions
    and under ``TYPE_CHECKING`` counted; a package's ``__init__`` is the package's module."""
    graph: dict[str, set[str]] = defaultdict(set)
    for path, _, target in imports():
        a, b = module_name(path), module_of(target)
        if a != b:
            graph[a].add(b)
    return graph_cycles(graph)


def graph_cycles(graph: dict[str, set[str]]) -> set[str]:
    """The circles a depth-first walk of ``graph`` meets, each written from its smallest node."""
    cycles: set[str] = set()
    done: set[str] = set()

    def visit(u: str, path: list[str]) -> None:
        for v in sorted(graph[u]):
            if v in path:
                cyc = path[path.index(v):]
                k = cyc.index(min(cyc))
                cycles.add(" -> ".join(cyc[k:] + cyc[:k] + [min(cyc)]))
            elif v not in done:
                visit(v, path + [v])
        done.add(u)

    for u in sorted(graph):
        visit(u, [u])
    return cycles


def test_no_import_cycle_between_modules():
    """DESIGN.md: no import circle anywhere, inside folders included (shared types at the bottom)."""
    cycles = module_cycles()
    assert not cycles, "import cycles between modules of torchpp:\n  " + "\n  ".join(sorted(cycles))


def test_the_cycle_check_sees_a_circle_inside_a_folder(monkeypatch):
    """A lazy import back into a folder's own module is a circle the check reports."""
    fake = [(PACKAGE / "planner" / "a.py", 1, ["planner", "b"]), (PACKAGE / "planner" / "b.py", 9, ["planner", "a"])]
    monkeypatch.setitem(globals(), "imports", lambda: fake)
    monkeypatch.setattr(Path, "is_file", lambda self: self.name in ("a.py", "b.py", "__init__.py"))
    assert module_cycles() == {"planner.a -> planner.b -> planner.a"}


def test_no_library_module_imports_a_command_line_module():
    bad = [f"{path.relative_to(PACKAGE.parent)}:{line} imports torchpp.{'.'.join(target)}"
           for path, line, target in imports()
           if not is_cli(path.stem) and any(is_cli(name) for name in target)]
    assert not bad, "library modules importing a command-line module:\n  " + "\n  ".join(bad)


@pytest.mark.parametrize("limit", [MAX_FUNCTION_LINES])
def test_no_long_functions(limit):
    long = []
    for path in sources():
        rel = path.relative_to(PACKAGE)
        if len(rel.parts) > 1 and rel.parts[0] in FUNCTION_LENGTH_EXEMPT_FOLDERS:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > limit:
                    long.append(f"{rel}:{node.name} ({n} lines)")
    assert not long, f"functions over {limit} lines: {', '.join(long)}"


def test_the_walk_sees_function_level_and_relative_imports():
    """The reader resolves what the checks rely on: relative levels, ``from . import x`` and
    imports inside functions."""
    pkg = PACKAGE / "planner" / "replan" / "cli.py"
    src = "from ...formats import Plan\nfrom .. import api\ndef f():\n    from torchpp.sim import measured\n"
    found = []
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found += imported(pkg, node)
    assert found == [["formats"], ["planner", "api"], ["sim"]]


SPEAKS_FOR_PEOPLE = ("cli", "train", "demo", "__main__")
"""The only module names that may parse arguments (import argparse) or print: ``cli.py``,
``<folder>/cli.py``, ``train.py``, ``demo.py`` (and ``__main__``, which hands over to ``cli``)."""

MAY_PARSE_OR_PRINT: dict[str, str] = {
    "argtypes.py": "argparse types for the command lines (ArgumentTypeError keeps their message)",
    "profiling/memory_probe.py": "the worker process `calibrate-memory` starts per span: its argv and its one "
                                 "JSON line on stdout are the protocol between the two processes",
    "runtime/local_cli.py": "the launcher of the demo's local ranks (`python -m torchpp.runtime.local_cli`, torchrun's "
                            "part without its agent): its argv and its one line on a failed rank",
}
"""Library modules allowed to import argparse or print, each with its reason."""


def parses_or_prints(path: Path) -> list[str]:
    """Where a module imports argparse or calls print (``name:line what``)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if (isinstance(node, ast.Import) and any(a.name == "argparse" for a in node.names)) or (
                isinstance(node, ast.ImportFrom) and node.module == "argparse"):
            out.append(f"{path.name}:{node.lineno} imports argparse")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print":
            out.append(f"{path.name}:{node.lineno} prints")
    return out


def test_only_command_lines_parse_arguments_or_print():
    """Library code returns values and raises; only the command lines talk to people."""
    bad, stale = [], []
    for path in sources():
        rel = path.relative_to(PACKAGE).as_posix()
        if path.stem in SPEAKS_FOR_PEOPLE:
            continue
        found = parses_or_prints(path)
        if rel in MAY_PARSE_OR_PRINT:
            stale += [] if found else [rel]
        else:
            bad += [f"{rel}: {f.split(' ', 1)[1]} ({f.split(' ')[0]})" for f in found]
    assert not bad, "library modules that parse arguments or print (move it to a cli.py):\n  " + "\n  ".join(bad)
    assert not stale, f"MAY_PARSE_OR_PRINT lists modules that no longer parse or print; remove them: {stale}"


def test_the_print_check_sees_argparse_and_print(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("from argparse import ArgumentParser\ndef f():\n    print('x')\n")
    assert parses_or_prints(src) == ["m.py:1 imports argparse", "m.py:3 prints"]
