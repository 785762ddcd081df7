"""Monitor config: ``configs/monitor.yaml`` loaded into frozen dataclasses.

Every loading error names the file, the field, what was expected and what was found::

    ConfigError: configs/monitor.yaml: field 'garbled.accept_length_below': expected a number > 1, got 0.9

Thresholds are kept as the YAML floats for display and as exact fractions (``Fraction("1.4") == 7/5``) for
the rules, so a metric of exactly 1.4 or 0.96 never fires through binary rounding.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any

import yaml

SIGNALS = ("cumulative", "window", "any")


class ConfigError(ValueError):
    """The monitor config file is missing, malformed, or inconsistent."""


def default_config_path() -> Path:
    """The repository's ``configs/monitor.yaml``."""
    return Path(__file__).resolve().parents[1] / "configs" / "monitor.yaml"


def exact(value: float) -> Fraction:
    """The decimal a float was written as, exactly: ``exact(1.4) == Fraction(7, 5)``."""
    return Fraction(repr(float(value)))


@dataclass(frozen=True)
class GarbledRule:
    """Corrupted KV: accept length < ``accept_length_below`` once generated > ``after_generated_tokens``."""

    accept_length_below: float = 1.4
    after_generated_tokens: int = 128
    signal: str = "any"
    threshold: Fraction = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "threshold", exact(self.accept_length_below))


@dataclass(frozen=True)
class RepetitionRule:
    """Degenerate loop: accept rate > ``accept_rate_above`` once verify steps >= ``min_verify_steps``."""

    accept_rate_above: float = 0.96
    min_verify_steps: int = 32
    signal: str = "any"
    threshold: Fraction = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "threshold", exact(self.accept_rate_above))


@dataclass(frozen=True)
class RetryPolicy:
    """Abort-and-retry bounds: at most ``max_retries`` retries per request, exponential backoff."""

    max_retries: int = 2
    prefer_other_instance: bool = True
    backoff_initial_s: float = 0.5
    backoff_multiplier: float = 2.0
    backoff_max_s: float = 8.0


@dataclass(frozen=True)
class MonitorConfig:
    window_steps: int = 32
    garbled: GarbledRule = GarbledRule()
    repetition: RepetitionRule = RepetitionRule()
    retry: RetryPolicy = RetryPolicy()


_TYPE_NAMES = {int: "int", float: "number", str: "str", bool: "bool"}


def _check_type(path: Path, key: str, value: Any, ftype: type) -> Any:
    if ftype is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    ok = isinstance(value, ftype) and (ftype is bool or not isinstance(value, bool))
    if not ok:
        got = f"{value!r} ({type(value).__name__})"
        raise ConfigError(f"{path}: field '{key}': expected {_TYPE_NAMES[ftype]}, got {got}")
    return value


def _require(path: Path, cond: bool, key: str, expected: str, got: Any) -> None:
    if not cond:
        raise ConfigError(f"{path}: field '{key}': expected {expected}, got {got!r}")


def _build(cls: type, path: Path, data: Any, prefix: str, nested: dict[str, type]) -> Any:
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
    types = {"int": int, "float": float, "str": str, "bool": bool}
    values = {}
    for key, raw in data.items():
        if key in nested:
            values[key] = _build(nested[key], path, raw, f"{prefix}{key}.", {})
        else:
            values[key] = _check_type(path, prefix + key, raw, types[fields[key].type])
    return cls(**values)


def _validate(path: Path, cfg: MonitorConfig) -> MonitorConfig:
    g, r, p = cfg.garbled, cfg.repetition, cfg.retry
    _require(path, cfg.window_steps >= 1, "window_steps", "int >= 1", cfg.window_steps)
    _require(path, g.accept_length_below > 1, "garbled.accept_length_below",
             "a number > 1 (every verify step yields at least one token)", g.accept_length_below)
    _require(path, g.after_generated_tokens >= 0, "garbled.after_generated_tokens", "int >= 0",
             g.after_generated_tokens)
    _require(path, 0 < r.accept_rate_above < 1, "repetition.accept_rate_above", "a number in (0, 1)",
             r.accept_rate_above)
    _require(path, r.min_verify_steps >= 1, "repetition.min_verify_steps", "int >= 1", r.min_verify_steps)
    for name, rule in (("garbled", g), ("repetition", r)):
        _require(path, rule.signal in SIGNALS, f"{name}.signal", f"one of {list(SIGNALS)}", rule.signal)
    _require(path, p.max_retries >= 0, "retry.max_retries", "int >= 0", p.max_retries)
    _require(path, p.backoff_initial_s >= 0, "retry.backoff_initial_s", "a number >= 0", p.backoff_initial_s)
    _require(path, p.backoff_multiplier >= 1, "retry.backoff_multiplier", "a number >= 1", p.backoff_multiplier)
    _require(path, p.backoff_max_s >= p.backoff_initial_s, "retry.backoff_max_s",
             f">= retry.backoff_initial_s ({p.backoff_initial_s})", p.backoff_max_s)
    return cfg


def load_monitor_config(path: str | Path | None = None) -> MonitorConfig:
    """Load ``path`` (default ``configs/monitor.yaml``) into a validated :class:`MonitorConfig`.

    Example::

        cfg = load_monitor_config()
        cfg.garbled.threshold  # Fraction(7, 5)
    """
    path = Path(path) if path is not None else default_config_path()
    if not path.is_file():
        raise ConfigError(f"{path}: expected a monitor config file, got no such file")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: expected valid YAML, got a parse error: {exc}") from None
    nested = {"garbled": GarbledRule, "repetition": RepetitionRule, "retry": RetryPolicy}
    return _validate(path, _build(MonitorConfig, path, data, "", nested))
