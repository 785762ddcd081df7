"""Monitor config: ``configs/monitor.yaml`` loaded into frozen dataclasses.

Every loading error names the file, the field, what was expected and what was found::

    ConfigError: configs/monitor.yaml: field 'garbled.accept_length_below': expected a number > 1, got 0.9

Thresholds are kept as the YAML floats for display and as exact fractions (``Fraction("1.4") == 7/5``) for
the rules, so a metric of exactly 1.4 or 0.96 never fires through binary rounding.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path

from lsconfig.config_io import ConfigError, build, read_yaml, require
from lsconfig.paths import configs_root

SIGNALS = ("cumulative", "window", "any")


def default_config_path() -> Path:
    """The shipped ``monitor.yaml`` (the checkout's ``configs/``, the wheel's package data, or
    ``LAYERSPLIT_CONFIG_DIR``: see ``lsconfig.paths``)."""
    return configs_root() / "monitor.yaml"


def exact(value: float) -> Fraction:
    """The decimal a float was written as, exactly: ``exact(1.4) == Fraction(7, 5)``."""
    return Fraction(repr(float(value)))


@dataclass(frozen=True)
class _Rule:
    """A rule whose YAML limit (the field named by ``LIMIT``) is also kept as an exact ``threshold``."""

    LIMIT = ""
    threshold: Fraction = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "threshold", exact(getattr(self, self.LIMIT)))


@dataclass(frozen=True)
class GarbledRule(_Rule):
    """Corrupted KV: accept length < ``accept_length_below`` once generated > ``after_generated_tokens``."""

    LIMIT = "accept_length_below"
    accept_length_below: float = 1.4
    after_generated_tokens: int = 128
    signal: str = "any"


@dataclass(frozen=True)
class RepetitionRule(_Rule):
    """Degenerate loop: accept rate > ``accept_rate_above`` once verify steps >= ``min_verify_steps``."""

    LIMIT = "accept_rate_above"
    accept_rate_above: float = 0.96
    min_verify_steps: int = 32
    signal: str = "any"


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


def _validate(path: Path, cfg: MonitorConfig) -> MonitorConfig:
    g, r, p = cfg.garbled, cfg.repetition, cfg.retry
    require(path, cfg.window_steps >= 1, "window_steps", "int >= 1", cfg.window_steps)
    require(path, g.accept_length_below > 1, "garbled.accept_length_below",
             "a number > 1 (every verify step yields at least one token)", g.accept_length_below)
    require(path, g.after_generated_tokens >= 0, "garbled.after_generated_tokens", "int >= 0",
             g.after_generated_tokens)
    require(path, 0 < r.accept_rate_above < 1, "repetition.accept_rate_above", "a number in (0, 1)",
             r.accept_rate_above)
    require(path, r.min_verify_steps >= 1, "repetition.min_verify_steps", "int >= 1", r.min_verify_steps)
    for name, rule in (("garbled", g), ("repetition", r)):
        require(path, rule.signal in SIGNALS, f"{name}.signal", f"one of {list(SIGNALS)}", rule.signal)
    require(path, p.max_retries >= 0, "retry.max_retries", "int >= 0", p.max_retries)
    require(path, p.backoff_initial_s >= 0, "retry.backoff_initial_s", "a number >= 0", p.backoff_initial_s)
    require(path, p.backoff_multiplier >= 1, "retry.backoff_multiplier", "a number >= 1", p.backoff_multiplier)
    require(path, p.backoff_max_s >= p.backoff_initial_s, "retry.backoff_max_s",
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
    nested = {"garbled": GarbledRule, "repetition": RepetitionRule, "retry": RetryPolicy}
    special = {key: (lambda p, raw, cls=cls, key=key: build(cls, p, raw, prefix=f"{key}."))
               for key, cls in nested.items()}
    return _validate(path, build(MonitorConfig, path, read_yaml(path), special=special))
