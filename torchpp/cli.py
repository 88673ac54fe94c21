"""`torchpp <verb>`: every step of the loop as a command that reads and writes files."""
from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from typing import NoReturn, Sequence

from .errors import UsageError  # noqa: F401  (re-exported: `torchpp.cli.UsageError`)

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# verb -> ("module[:function]" whose function, ``configure`` unless named, configures the verb's
# parser, one-line help). It adds the arguments (and sub-verbs) and sets ``func`` to a
# callable(args) -> exit code.
VERBS: dict[str, tuple[str, str]] = {
    "profile": ("torchpp.profiling.cli", "measure per-block forward/backward times and bytes on this host"),
    "plan": ("torchpp.planner.cli", "make plan.json (even/dp/pp split, or the optimising planner)"),
    "speed-check": ("torchpp.profiling.cli:configure_speed_check", "time this host's profiled layers again: how much slower it runs now"),
    "capacities": ("torchpp.planner.cli:configure_capacities", "per-host speed relative to a reference host, from layers files"),
    "bandwidth parse": ("torchpp.planner.cli:configure_bandwidth", "iperf3-style links CSV to bandwidth.json"),
    "calibrate-memory": ("torchpp.profiling.cli:configure_calibrate", "fit the memory model from random spans' peak RSS"),
    "replan": ("torchpp.planner.replan.cli", "correct per-host costs, links and memory from a run's timelines, then plan again"),
    "simulate": ("torchpp.sim.cli", "event-driven simulator: run, sweep, heatmap, all, plan, check-reference"),
    "analyze": ("torchpp.trace.cli", "analyse merged timelines: bubbles, critical path, predicted vs measured"),
    "throttle": ("torchpp.cluster.cli:configure_throttle", "limit CPU, memory or a link: cpu|mem|net [-- COMMAND], status, clear"),
    "cluster": ("torchpp.cluster.cli:configure_cluster", "emulated cluster of namespaces: up -c CONFIG, run -- CMD, down, status"),
    "run": ("torchpp.elastic.cli", "start a plan's ranks; --elastic: re-plan over the hosts left when one fails"),
    "demo": ("torchpp.demo", "the whole loop on an embedded default: profile, plan, train, analyse, replan, train"),
    "data prepare": ("torchpp.data.cli", "tokenize text once into a memory-mapped corpus (tokens.bin + index.json)"),
    "bandwidth probe": ("torchpp.cluster.cli:configure_probe", "all-pairs p2p throughput/latency over gloo -> CSV + bandwidth.json"),
}


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports a bad argument as one line, ``torchpp <verb>: error: ...`` (exit 2).

    The usage text is what ``-h`` is for; scripts and people reading logs want the one line
    that names the argument. Sub-verbs' parsers inherit this class (argparse copies it).
    """

    def error(self, message: str) -> "NoReturn":  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {one_line(message)} (see {self.prog} -h)\n")


def one_line(text: object) -> str:
    """``text`` on one line: messages quote files and values that may hold newlines."""
    return " ".join(str(text).split())


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The parser of `torchpp`; two-word verbs ("bandwidth parse") become sub-verbs of their first word.

    With ``argv`` only the verb it names is configured (its module imported), so `torchpp --help`
    and a verb that needs neither torch nor transformers start without them; without ``argv``
    every verb is (the whole command line, for documentation and tests).
    """
    parser = OneLineParser(prog="torchpp", description=__doc__)
    sub = parser.add_subparsers(dest="verb", metavar="VERB", required=True)
    groups: dict[str, argparse._SubParsersAction] = {}
    parsers: dict[str, argparse.ArgumentParser] = {}
    for verb, (_, help_) in VERBS.items():
        head, _, tail = verb.partition(" ")
        if tail:
            if head not in groups:
                groups[head] = sub.add_parser(head, help=f"{head} commands").add_subparsers(
                    dest="subverb", metavar="SUBVERB", required=True)
            parsers[verb] = groups[head].add_parser(tail, help=help_, description=help_)
        else:
            parsers[verb] = sub.add_parser(verb, help=help_, description=help_)
    for verb in (VERBS if argv is None else chosen_verbs(argv)):
        module, _, function = VERBS[verb][0].partition(":")
        getattr(importlib.import_module(module), function or "configure")(parsers[verb])
    return parser


def chosen_verbs(argv: Sequence[str]) -> list[str]:
    """The verb ``argv`` names (``[]`` when it names none: `torchpp --help`, `torchpp bandwidth`).

    The top-level parser takes no options but ``-h``, so the first two words that are not options
    say which verb runs; anything else is left for argparse to report.
    """
    words = [a for a in argv if not a.startswith("-")][:2]
    if not words:
        return []
    if words[0] in VERBS:
        return [words[0]]
    pair = " ".join(words)
    return [pair] if pair in VERBS else []


def main(argv: list[str] | None = None) -> int:
    """Run one verb; every expected input error is one line on stderr and exit code 2."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        parser = build_parser(argv)
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse has printed its one line (or the help)
        return e.code if isinstance(e.code, int) else 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print(f"torchpp {args.verb}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 (only the input errors below; anything else is re-raised)
        message = input_error(e)
        if message is None:
            raise
        print(f"torchpp {_verb(args)}: error: {one_line(message)}", file=sys.stderr)
        return 2


def _verb(args: argparse.Namespace) -> str:
    """``plan``, ``bandwidth parse``, ``simulate run``: the words that named the command."""
    sub = next((getattr(args, k) for k in ("subverb", "simverb", "what") if getattr(args, k, None)), None)
    return f"{args.verb} {sub}" if isinstance(sub, str) else args.verb


def input_error(e: BaseException) -> str | None:
    """The one-line message of an error caused by the input (bad value, file or path), else None.

    ``formats.FormatError`` and ``UsageError`` are ValueErrors that already name file, field and
    expectation; OS errors name the path they failed on; a JSON or text decoding error is
    reported by the loaders with its file.
    """
    if isinstance(e, UnicodeDecodeError):
        return f"not UTF-8 text ({e.reason} at byte {e.start})"
    if isinstance(e, json.JSONDecodeError):
        return f"not valid JSON ({e.msg} at line {e.lineno} column {e.colno})"
    if isinstance(e, ValueError):
        return str(e)
    if isinstance(e, (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError,
                      FileExistsError)) or (isinstance(e, OSError) and e.filename is not None):
        where = e.filename if e.filename2 is None else f"{e.filename} -> {e.filename2}"
        return f"{where}: {e.strerror or e}" if where is not None else str(e)
    return None


if __name__ == "__main__":
    sys.exit(main())
