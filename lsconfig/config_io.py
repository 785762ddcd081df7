"""YAML config files into frozen dataclasses, with errors that name the file, the field, what was
expected and what was found. Shared by every package's loaders (model/hardware/sweep configs in
``layersplit``, the monitor config in ``pd``), so it lives at the bottom of the layering."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable

import yaml


class ConfigError(ValueError):
    """A config file is missing, malformed, or inconsistent."""


_TYPES = {"int": int, "float": float, "str": str, "bool": bool}
_TYPE_NAMES = {int: "int", float: "number", str: "str", bool: "bool"}


def read_yaml(path: Path) -> Any:
    try:
        return yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: expected valid YAML, got a parse error: {exc}") from None


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
