"""`torchrun -m torchpp.train --plan plan.json`: train a HF causal LM as the plan says.

Every rank runs this module. A bad plan or argument gives one error line on every rank
(exit 2) before any collective; ranks started with different plans, models, data or options,
or an unusable --checkpoint-dir, give one error line on every rank (exit 2) before any step;
a failed or stalled peer gives one line naming the action and the peer (exit 1) within
--timeout-s.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")



def _say(line: str) -> None:
    """One write per line: ranks share torchrun's stderr, and print's separate newline let two ranks'
    lines run together."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()

def build_parser() -> argparse.ArgumentParser:
    """Every ``TrainConfig`` field is an option (``torchpp/runtime/cli.py``): add a field, not a line here."""
    from .runtime.cli import build_parser as derived

    return derived(__doc__)


def show_progress() -> None:
    """Rank 0's progress lines (the ``torchpp.train`` logger) on stdout, one line each, as they come."""
    log = logging.getLogger("torchpp.train")
    if not log.handlers:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False


class _BadArguments(Exception):
    """argparse's complaint, to be said in one line like every other error of a rank."""


def _refuse(rank: str, problem: str, timeout_s: float) -> int:
    """One line on this rank, and the same problem posted for the other ranks before they build
    their process group (``runtime.preflight``): every rank then exits 2 with its own line."""
    from .runtime.preflight import tell_peers

    _say(f"torchpp.train: rank {rank}: error: {problem}")
    tell_peers(problem, timeout_s)
    sys.stdout.flush()
    os._exit(2)  # a store's threads must not delay the exit


def main(argv: list[str] | None = None) -> int:
    rank = os.environ.get("RANK", "0")
    parser = build_parser()

    def bad_arguments(message: str) -> None:
        raise _BadArguments(" ".join(message.split()) + " (see torchpp.train -h)")

    parser.error = bad_arguments  # type: ignore[method-assign]
    if argv is None:  # a rank process: it ends when its launcher does (a call from Python is not one)
        from .runtime.lifecycle import die_with_parent

        die_with_parent()
    try:
        args = parser.parse_args(argv)
    except _BadArguments as e:
        if argv is not None:
            _say(f"torchpp.train: rank {rank}: error: {e}")
            return 2
        return _refuse(rank, str(e), parser.get_default("timeout_s"))
    show_progress()
    from .data import DataError
    from .formats import FormatError
    from .models.presets import ModelSpecError
    from .runtime.comm import PeerError
    from .runtime.exchange import DisagreementError
    from .runtime.cli import config_from_args
    from .runtime.trainer import TrainConfig, prepare, train, world_from_env

    if args.output_dir is None and not args.no_output:  # as HF Trainer's output_dir: nothing lost by default
        from .runtime.safekeeping import default_output_dir

        args.output_dir = default_output_dir(args.plan)
    try:
        cfg = config_from_args(TrainConfig, args)
        prepared = prepare(cfg, world_from_env()[1])
    except (FormatError, ModelSpecError, DataError, ValueError) as e:
        if argv is not None:  # called from Python: no peers started with it
            _say(f"torchpp.train: rank {rank}: error: {e}")
            return 2
        return _refuse(rank, str(e), args.timeout_s if args.timeout_s > 0 else parser.get_default("timeout_s"))
    try:
        summary = train(cfg, prepared)
    except DisagreementError as e:
        _say(f"torchpp.train: rank {rank}: error: {e}")
        sys.stdout.flush()
        os._exit(2)  # the same error on every rank; nothing was trained or written
    except (PeerError, DataError, ModelSpecError) as e:
        _say(f"torchpp.train: error: {e}")
        sys.stdout.flush()
        os._exit(1)  # waiter threads and a broken process group must not delay the exit
    except KeyboardInterrupt:
        _say(f"torchpp.train: rank {rank}: interrupted")
        os._exit(130)
    if summary.stopped_by:
        sys.stdout.flush()
        return 128 + summary.stopped_by if summary.stopped_by > 0 else 1
    return 0


if __name__ == "__main__":
    code = main()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    # Everything is written and closed: skip the interpreter's teardown, whose garbage collection of
    # torch's and transformers' objects takes seconds (tens on a loaded host) while the launcher waits
    os._exit(code)
