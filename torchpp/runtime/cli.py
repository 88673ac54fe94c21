"""`torchpp.train`'s command line, derived from ``TrainConfig``'s fields.

One place to add an option: a field of ``TrainConfig`` with a type and a docstring becomes
``--field-name``, its help the docstring, its default the field's. The type says how the text is
read: ``bool`` is a switch, ``Literal[...]`` a choice, ``tuple[int, ...]`` and ``tuple[float,
float]`` comma-separated lists, ``X | None`` an optional ``X``; a field without a default is
required. The values are checked by ``TrainConfig.__post_init__``, not here.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import textwrap
import types
import typing
from pathlib import Path
from typing import Any, Callable


def field_docs(cls: type) -> dict[str, str]:
    """Each field's docstring (the string literal written under it), as one line."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, after in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            docs[node.target.id] = " ".join(after.value.value.split()).replace("``", "")
    return docs


def _list_of(item: Callable[[str], Any], count: int | None, name: str) -> Callable[[str], tuple]:
    """Comma-separated values of ``item`` (exactly ``count`` of them when given)."""
    def parse(text: str) -> tuple:
        try:
            out = tuple(item(x) for x in text.split(",") if x.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated {name}s, got {text!r}") from None
        if count is not None and len(out) != count:
            raise argparse.ArgumentTypeError(f"expected {count} comma-separated {name}s, got {text!r}")
        return out
    parse.__name__ = f"{name} list"
    return parse


def _reader(field: str, hint: Any) -> dict[str, Any]:
    """argparse keywords (type, choices, action) that read a value of type ``hint``."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1:
            return _reader(field, rest[0])
    if hint is bool:
        return {"action": argparse.BooleanOptionalAction}  # a default of False becomes a plain switch
    if typing.get_origin(hint) is typing.Literal:
        return {"choices": list(args), "type": type(args[0])}
    if typing.get_origin(hint) is tuple and args and args[0] in (int, float):
        variadic = len(args) == 2 and args[1] is Ellipsis
        return {"type": _list_of(args[0], None if variadic else len(args), args[0].__name__)}
    if hint in (str, int, float, Path):
        return {"type": hint}
    raise TypeError(f"TrainConfig.{field}: no command-line reading for type {hint!r}; give it one in "
                    "torchpp/runtime/cli.py")


def add_config_options(parser: argparse.ArgumentParser, cls: type) -> None:
    """One ``--name`` per field of the dataclass ``cls``, help from the field's docstring."""
    hints, docs = typing.get_type_hints(cls), field_docs(cls)
    for f in dataclasses.fields(cls):
        kw = _reader(f.name, hints[f.name])
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if not required:
            kw["default"] = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        if kw.get("action") is argparse.BooleanOptionalAction and kw.get("default") is False:
            kw["action"] = "store_true"
        elif "action" not in kw and "choices" not in kw:
            kw["metavar"] = f.name.upper()
        parser.add_argument("--" + f.name.replace("_", "-"), dest=f.name, required=required,
                            help=docs.get(f.name, ""), **kw)


def config_from_args(cls: type, args: argparse.Namespace) -> Any:
    """The dataclass ``cls`` from parsed arguments (its ``__post_init__`` checks the values)."""
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


def build_parser(description: str | None = None) -> argparse.ArgumentParser:
    """The parser of `torchpp.train`: every ``TrainConfig`` field an option."""
    from .trainer import TrainConfig

    p = argparse.ArgumentParser(prog="torchpp.train", description=description,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_config_options(p, TrainConfig)
    return p
