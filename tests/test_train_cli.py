"""`torchpp.train`'s command line is derived from ``TrainConfig``: one field, one option."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Literal

import pytest

from torchpp.runtime.cli import add_config_options, config_from_args, field_docs
from torchpp.runtime.trainer import TrainConfig
from torchpp.train import build_parser


def test_every_field_is_an_option_with_its_docstring_as_help():
    parser, docs = build_parser(), field_docs(TrainConfig)
    actions = {a.dest: a for a in parser._actions}
    for f in dataclasses.fields(TrainConfig):
        assert f.name in docs, f"TrainConfig.{f.name} has no docstring: it is the option's help"
        a = actions[f.name]
        assert a.option_strings[0] == "--" + f.name.replace("_", "-")
        assert a.help == docs[f.name]
        if f.default is not dataclasses.MISSING:
            assert a.default == f.default, f.name


def test_defaults_give_the_dataclass_defaults():
    args = build_parser().parse_args(["--plan", "p.json"])
    assert config_from_args(TrainConfig, args) == TrainConfig(plan=Path("p.json"))


def test_values_are_read_by_type():
    args = build_parser().parse_args([
        "--plan", "p.json", "--steps", "3", "--lr", "0.5", "--optimizer", "sgd", "--adam-betas", "0.8,0.9",
        "--trace-steps", "2,5", "--resume", "--checkpoint-dir", "ck", "--attn-implementation", "eager",
        "--threads", "2"])
    cfg = config_from_args(TrainConfig, args)
    assert (cfg.steps, cfg.lr, cfg.optimizer, cfg.adam_betas, cfg.trace_steps) == (3, 0.5, "sgd", (0.8, 0.9), (2, 5))
    assert cfg.resume and cfg.checkpoint_dir == Path("ck") and cfg.attn_implementation == "eager"
    assert cfg.threads == 2


@pytest.mark.parametrize("argv", [["--optimizer", "lamb"], ["--adam-betas", "0.9"], ["--trace-steps", "a"],
                                  ["--steps", "x"]])
def test_bad_values_are_one_argparse_error(argv, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["--plan", "p.json", *argv])
    assert e.value.code == 2
    assert argv[0] in capsys.readouterr().err


def test_a_new_field_needs_only_a_type_and_a_docstring():
    """What another option takes: a field. Every supported type, as a later field would add it."""
    import argparse

    @dataclasses.dataclass(kw_only=True)
    class Config:
        path: Path
        """Required path."""
        count: int = 1
        """How many."""
        ratio: float | None = None
        """A ratio."""
        mode: Literal["a", "b"] = "a"
        """Which mode."""
        on: bool = False
        """A switch."""
        kept: bool = True
        """On unless --no-kept."""
        sizes: tuple[int, ...] = (1,)
        """Sizes."""

    p = argparse.ArgumentParser()
    add_config_options(p, Config)
    cfg = config_from_args(Config, p.parse_args(["--path", "x", "--ratio", "0.5", "--mode", "b", "--on",
                                                 "--no-kept", "--sizes", "4,8"]))
    assert cfg == Config(path=Path("x"), ratio=0.5, mode="b", on=True, kept=False, sizes=(4, 8))
    assert {a.dest: a.help for a in p._actions}["count"] == "How many."


def test_a_type_without_a_reading_is_refused_by_name():
    import argparse

    @dataclasses.dataclass
    class Config:
        table: dict[str, int] = dataclasses.field(default_factory=dict)
        """Not a command-line value."""

    with pytest.raises(TypeError, match="table"):
        add_config_options(argparse.ArgumentParser(), Config)
