"""Monitor YAML: the shipped file, and errors that name file, field, expected and got."""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import pytest
import yaml

from layersplit.pd.spec.monitor_config import ConfigError, MonitorConfig, default_config_path, load_monitor_config
from tests.paths import ROOT


def test_shipped_config_has_the_blog_thresholds():
    cfg = load_monitor_config()
    assert default_config_path() == ROOT / "configs" / "monitor.yaml"
    assert cfg.garbled.threshold == Fraction(7, 5) and cfg.garbled.after_generated_tokens == 128
    assert cfg.repetition.threshold == Fraction(24, 25)
    assert cfg.retry.max_retries >= 1 and cfg.retry.prefer_other_instance
    assert cfg == MonitorConfig()  # the dataclass defaults mirror the shipped file


def write(folder: Path, changes: dict) -> Path:
    data = yaml.safe_load(default_config_path().read_text())
    for dotted, value in changes.items():
        *parents, key = dotted.split(".")
        node = data
        for p in parents:
            node = node[p]
        if value is ...:
            del node[key]
        else:
            node[key] = value
    path = folder / "monitor.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


BAD = {
    "unknown-top": ({"windows": 3}, r"unknown field 'windows' \(known fields: window_steps, garbled"),
    "unknown-nested": ({"garbled.threshold": 1.4}, r"unknown field 'garbled.threshold' \(known fields: accept_length_below"),
    "wrong-type": ({"window_steps": "many"}, r"field 'window_steps': expected int, got 'many' \(str\)"),
    "bool-for-int": ({"retry.max_retries": True}, r"field 'retry.max_retries': expected int, got True \(bool\)"),
    "missing": ({"repetition.min_verify_steps": ...}, r"field 'repetition.min_verify_steps': expected a value, got nothing"),
    "not-a-mapping": ({"garbled": 1.4}, r"field 'garbled': expected a mapping of fields, got float"),
    "length-not-above-1": ({"garbled.accept_length_below": 0.9}, r"field 'garbled.accept_length_below': expected a number > 1"),
    "rate-1": ({"repetition.accept_rate_above": 1}, r"field 'repetition.accept_rate_above': expected a number in \(0, 1\), got 1.0"),
    "signal": ({"repetition.signal": "both"}, r"field 'repetition.signal': expected one of \['cumulative', 'window', 'any'\], got 'both'"),
    "window-0": ({"window_steps": 0}, r"field 'window_steps': expected int >= 1, got 0"),
    "negative-retries": ({"retry.max_retries": -1}, r"field 'retry.max_retries': expected int >= 0, got -1"),
    "backoff-cap": ({"retry.backoff_max_s": 0.1}, r"field 'retry.backoff_max_s': expected >= retry.backoff_initial_s \(0.5\), got 0.1"),
    "prefer-not-bool": ({"retry.prefer_other_instance": "yes"}, r"field 'retry.prefer_other_instance': expected bool"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_config_errors(tmp_path, case):
    changes, pattern = BAD[case]
    path = write(tmp_path, changes)
    with pytest.raises(ConfigError, match=pattern) as info:
        load_monitor_config(path)
    assert str(info.value).startswith(str(path)), "the error must name the file"


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="expected a monitor config file, got no such file"):
        load_monitor_config(tmp_path / "nope.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("garbled: [unclosed\n")
    with pytest.raises(ConfigError, match="expected valid YAML"):
        load_monitor_config(broken)


def test_int_threshold_is_accepted_as_number(tmp_path):
    cfg = load_monitor_config(write(tmp_path, {"garbled.accept_length_below": 2}))
    assert cfg.garbled.accept_length_below == 2.0 and cfg.garbled.threshold == 2
