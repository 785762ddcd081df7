"""YAML config files into frozen dataclasses, with errors that name the file, the field, what was
expected and what was found. Shared by every package's loaders (model/hardware/sweep configs in
``layersplit``, the monitor config in ``pd``), so it lives at the bottom of the layering."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any, Callable

import yaml


class ConfigError(ValueError):
    """A config file is missing, malformed, or inconsistent."""


_TYPES = {"int": int, "float": float, "str": str, "bool": bool}
_TYPE_NAMES = {int: "int", float: "number", str: "str", bool: "bool"}


def read_config_text(path: Path) -> str:
    """The UTF-8 text of a config file; an unreadable or non-UTF-8 file is one :class:`ConfigError` line
    naming it (never a bare ``PermissionError`` traceback or a codec message without the file)."""
    try:
        raw = Path(path).read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"{path}: expected a config file, got no such file") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: expected a config file, got a folder") from None
    except PermissionError:
        raise ConfigError(f"{path}: expected a readable config file, got permission denied") from None
    except OSError as exc:
        raise ConfigError(f"{path}: expected a readable config file, got {exc.strerror or exc}") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: expected UTF-8 text, got byte 0x{raw[exc.start]:02x} at offset {exc.start} "
                          "(not UTF-8)") from None


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (PyYAML keeps the last one silently)."""

    def construct_mapping(self, node, deep=False):
        first: dict[Any, yaml.Mark] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, (str, int, float, bool)) and key in first:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (first at line {first[key].line + 1}); expected each field "
                    "once", key_node.start_mark)
            first.setdefault(key, key_node.start_mark)
        return super().construct_mapping(node, deep)


def read_yaml(path: Path) -> Any:
    """Parse a YAML config; a syntax error or a key given twice is one line ``FILE:LINE:COL: expected valid
    YAML, got ...``."""
    text = read_config_text(path)
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        what = "; ".join(_one_line(p) for p in (exc.context, exc.problem) if p)
        raise ConfigError(f"{where}: expected valid YAML, got a parse error: {what}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: expected valid YAML, got a parse error: {_one_line(exc)}") from None


def read_json(path: Path) -> Any:
    """Parse a JSON config (a model's ``config.json``); a syntax error is one line ``FILE:LINE:COL: ...``."""
    text = read_config_text(path)
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}:{exc.lineno}:{exc.colno}: expected valid JSON, got {exc.msg}") from None


def require(path: Path, cond: bool, key: str, expected: str, got: Any) -> None:
    if not cond:
        raise ConfigError(f"{path}: field '{key}': expected {expected}, got {got!r}")


def check_field(path: Path, key: str, value: Any, ftype: type, nonnegative: bool = False) -> Any:
    """``value`` as ``ftype`` (an int is accepted for a float; a bool is never a number)."""
    if ftype is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not (isinstance(value, ftype) and (ftype is bool or not isinstance(value, bool))):
        raise ConfigError(f"{path}: field '{key}': expected {_TYPE_NAMES.get(ftype, ftype.__name__)}, "
                          f"got {value!r} ({type(value).__name__})")
    if ftype is float and not math.isfinite(value):  # YAML's .inf and .nan are floats too
        raise ConfigError(f"{path}: field '{key}': expected a finite number, got {value!r}")
    if nonnegative and ftype in (int, float) and value < 0:
        raise ConfigError(f"{path}: field '{key}': expected a value >= 0, got {value!r}")
    return value


Parser = Callable[[Path, Any], Any]


def build(cls: type, path: Path, data: Any, *, prefix: str = "", special: dict[str, Parser] | None = None,
          nonnegative: bool = False) -> Any:
    """``cls(**data)`` after checking that every init field is present, none is unknown, and each has
    its annotated type (``special[key](path, raw)`` parses a field itself). ``prefix`` names a nested
    section in errors (``"garbled."``); ``nonnegative`` also rejects negative numbers."""
    special = special or {}
    where = f"field '{prefix.rstrip('.')}': " if prefix else ""
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: {where}expected a mapping of fields, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(f"{path}: unknown field '{prefix}{unknown[0]}' (known fields: {', '.join(fields)})")
    missing = [k for k in fields if k not in data]
    if missing:
        raise ConfigError(f"{path}: field '{prefix}{missing[0]}': expected a value, got nothing (field missing)")
    values = {}
    for key, raw in data.items():
        parse = special.get(key)
        values[key] = (parse(path, raw) if parse
                       else check_field(path, prefix + key, raw, _TYPES[fields[key].type], nonnegative))
    return cls(**values)
