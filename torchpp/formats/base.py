"""Reading, checking and writing the versioned JSON records (the one reader every format uses)."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, TypeVar

from .. import validate as V


T = TypeVar("T")


class FormatError(ValueError):
    """A file (or in-memory record) does not match its schema."""

    def __init__(self, source: str, field_path: str, expected: str, got: Any = dataclasses.MISSING):
        self.source, self.field_path, self.expected = source, field_path, expected
        msg = f"{source}: field '{field_path}': expected {expected}"
        if got is not dataclasses.MISSING:
            shown = repr(got)
            msg += f", got {shown if len(shown) <= 80 else shown[:77] + '...'}"
        super().__init__(msg)


# ----------------------------------------------------------------------------- reading helpers
class Reader:
    """Typed access to one JSON object with error messages that name file and field."""

    def __init__(self, data: Any, source: str, path: str = ""):
        self.source, self.path = source, path
        if not isinstance(data, Mapping):
            raise FormatError(source, path or "<root>", "a JSON object", data)
        self.data = data

    def _p(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def has(self, key: str) -> bool:
        return key in self.data and self.data[key] is not None

    def raw(self, key: str, default: Any = dataclasses.MISSING) -> Any:
        if key not in self.data:
            if default is dataclasses.MISSING:
                raise FormatError(self.source, self._p(key), "a value (field is missing)")
            return default
        return self.data[key]

    def str(self, key: str, default: Any = dataclasses.MISSING, choices: Iterable[str] | None = None) -> str:
        v = self.raw(key, default)
        if v is default and default is not dataclasses.MISSING:
            return v
        if not isinstance(v, str):
            raise FormatError(self.source, self._p(key), "a string", v)
        if choices is not None and v not in choices:
            raise FormatError(self.source, self._p(key), f"one of {sorted(choices)}", v)
        return v

    def bool(self, key: str, default: Any = dataclasses.MISSING) -> bool:
        v = self.raw(key, default)
        if v is default and default is not dataclasses.MISSING:
            return v
        if not isinstance(v, bool):
            raise FormatError(self.source, self._p(key), "true or false", v)
        return v

    def int(self, key: str, default: Any = dataclasses.MISSING, min_value: int | None = None,
            max_value: int | None = None) -> int:
        v = self.raw(key, default)
        if v is default and default is not dataclasses.MISSING:
            return v
        if isinstance(v, bool) or not isinstance(v, int):
            raise FormatError(self.source, self._p(key), "an integer", v)
        if min_value is not None and v < min_value:
            raise FormatError(self.source, self._p(key), f"an integer >= {min_value}", v)
        if max_value is not None and v > max_value:
            raise FormatError(self.source, self._p(key), f"an integer <= {max_value}", v)
        return v

    def float(self, key: str, default: Any = dataclasses.MISSING, min_value: float | None = None,
              positive: bool = False, max_value: float | None = V.MAX_NUMBER) -> float:
        v = self.raw(key, default)
        if v is default and default is not dataclasses.MISSING:
            return v
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise FormatError(self.source, self._p(key), "a finite number", v)
        if positive and v <= 0:
            raise FormatError(self.source, self._p(key), "a number > 0", v)
        if min_value is not None and v < min_value:
            raise FormatError(self.source, self._p(key), f"a number >= {min_value}", v)
        if max_value is not None and v > max_value:
            raise FormatError(self.source, self._p(key), f"a number <= {max_value:g}", v)
        return float(v)

    def obj(self, key: str, default: Any = dataclasses.MISSING) -> "Reader":
        v = self.raw(key, default)
        if v is default and default is not dataclasses.MISSING:
            return Reader({}, self.source, self._p(key)) if v is None else Reader(v, self.source, self._p(key))
        return Reader(v, self.source, self._p(key))

    def list(self, key: str, default: Any = dataclasses.MISSING, min_len: int = 0) -> list[Any]:
        v = self.raw(key, default)
        if v is default and default is not dataclasses.MISSING:
            return v
        if not isinstance(v, list):
            raise FormatError(self.source, self._p(key), "a list", v)
        if len(v) < min_len:
            raise FormatError(self.source, self._p(key), f"a list of at least {min_len} item(s)", v)
        return v

    def objs(self, key: str, default: Any = dataclasses.MISSING, min_len: int = 0) -> list["Reader"]:
        items = self.list(key, default, min_len)
        return [Reader(x, self.source, f"{self._p(key)}[{i}]") for i, x in enumerate(items)]

    def ints(self, key: str, default: Any = dataclasses.MISSING) -> list[int]:
        items = self.list(key, default)
        for i, x in enumerate(items):
            if isinstance(x, bool) or not isinstance(x, int):
                raise FormatError(self.source, f"{self._p(key)}[{i}]", "an integer", x)
        return list(items)

    def floats(self, key: str, default: Any = dataclasses.MISSING) -> list[float]:
        items = self.list(key, default)
        out = []
        for i, x in enumerate(items):
            if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
                raise FormatError(self.source, f"{self._p(key)}[{i}]", "a finite number", x)
            out.append(float(x))
        return out

    def fail(self, key: str, expected: str, got: Any = dataclasses.MISSING) -> FormatError:
        return FormatError(self.source, self._p(key), expected, got)


def check_format(data: Any, source: str, kind: str, versions: Iterable[int]) -> int:
    """Check ``data["format"] == "torchpp.<kind>/<v>"`` and return v."""
    r = Reader(data, source)
    fmt = r.raw("format", None)
    allowed = [f"torchpp.{kind}/{v}" for v in versions]
    if fmt not in allowed:
        raise FormatError(source, "format", " or ".join(repr(a) for a in allowed), fmt)
    return int(fmt.rsplit("/", 1)[1])


def read_json(path: str | os.PathLike) -> Any:
    p = Path(path)
    if not p.is_file():
        raise FormatError(str(p), "<file>", "an existing file")
    try:
        return json.loads(p.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise FormatError(str(p), "<file>", f"UTF-8 JSON text ({e.reason} at byte {e.start})") from None
    except RecursionError:
        raise FormatError(str(p), "<file>", "JSON nested at most a few hundred levels deep") from None
    except json.JSONDecodeError as e:
        raise FormatError(str(p), "<file>", f"valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None


def write_json(path: str | os.PathLike, data: Any) -> Path:
    """Write atomically (temp file + rename) so a crash never leaves half a file.

    NaN and infinities are refused (``allow_nan=False``): JSON has no spelling for them and
    every loader here refuses ``NaN``/``Infinity``, so torchpp never writes what it cannot read.
    """
    p = V.output_file(path, str(path))
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=False, default=_json_default, allow_nan=False)
            f.write("\n")
        os.replace(tmp, p)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return p


def _json_default(o: Any) -> Any:
    if dataclasses.is_dataclass(o):
        return to_dict(o)
    if hasattr(o, "tolist"):
        return o.tolist()
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def to_dict(obj: Any) -> Any:
    """dataclass -> plain JSON data (keeps field order; drops None-valued optional extras)."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(x) for x in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def file_hash(path: str | os.PathLike) -> str:
    return "sha256:" + hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]


def _load(path: str | os.PathLike, parse: Callable[[Any, str], T]) -> T:
    return parse(read_json(path), str(path))

def V_host(r: Reader, key: str) -> str:
    """A host name field: safe in file names and link keys (``validate.host_name``)."""
    v = r.str(key)
    try:
        return V.host_name(v, key)
    except ValueError as e:
        raise r.fail(key, e.args[0].partition("expected ")[2].rpartition(", got")[0], v) from None
