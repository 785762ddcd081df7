"""``layersplit sweep``: both engines end to end on small configs, outputs and labels, config errors."""

from __future__ import annotations

import json

import pytest
import yaml

from layersplit.cli import main
from layersplit.config import ConfigError, configs_root
from layersplit.sweep_config import load_sweep


def small(tmp_path, name: str, **changes):
    data = yaml.safe_load((configs_root() / "sweeps" / f"{name}.yaml").read_text())
    data.update(changes)
    path = tmp_path / f"{name}-small.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def run(tmp_path, capsys, config, *extra) -> list[dict]:
    out = tmp_path / "out"
    assert main(["sweep", "--config", str(config), "--out", str(out), *extra]) == 0
    text = capsys.readouterr().out
    assert "| length | mode |" in text
    assert (out / "throughput.png").stat().st_size > 10_000 and (out / "table.md").is_file()
    return [json.loads(line) for line in (out / "points.jsonl").read_text().splitlines()]


def test_model_engine_gain_grows_with_length(tmp_path, capsys):
    points = run(tmp_path, capsys, small(tmp_path, "glm5-h200", lengths=[40000, 120000], requests=128, sessions=32))
    assert {p["kind"] for p in points} == {"modelled"}
    gain = {p["length"]: p["gain_pct"] for p in points if p["mode"] == "layersplit"}
    assert gain[120000] > gain[40000]
    red = {p["length"]: p for p in points if p["mode"] == "redundant"}
    assert red[120000]["hit_L1"] < red[40000]["hit_L1"]  # fewer long sessions stay resident
    assert "modelled" in (tmp_path / "out" / "table.md").read_text()


@pytest.mark.timeout(300)
def test_real_engine_default_config_shape(tmp_path, capsys):
    points = run(tmp_path, capsys, small(tmp_path, "cpu", lengths=[120000], requests=6, sessions=3))
    assert {p["kind"] for p in points} == {"measured"} and len(points) == 2
    ls = [p for p in points if p["mode"] == "layersplit"][0]
    assert ls["bcast_bytes"] > 0 and ls["request_tokens_per_s"] > 0
    assert sum(ls["batch_sizes"]) == 6


def test_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="field 'engine': expected one of"):
        load_sweep(small(tmp_path, "cpu", engine="simulated"))
    with pytest.raises(ConfigError, match="field 'lengths': expected a non-empty list"):
        load_sweep(small(tmp_path, "cpu", lengths=[]))
    with pytest.raises(ConfigError, match="sweep 'nope': expected one of"):
        load_sweep("nope")
