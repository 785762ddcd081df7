"""A sweep never overwrites earlier results without being told to, and its flags are checked before any
work: the results folder, the gain map's axis values, an fp8 KV config for the measured engine."""

from __future__ import annotations

import time

import pytest
import yaml

from layersplit.api import check_out, sweep
from layersplit.cli.app import main
from layersplit.plan.config import configs_root
from layersplit.serving.sweep_config import load_sweep


def test_a_folder_with_results_is_refused_unless_forced(tmp_path):
    assert check_out(tmp_path / "new") == tmp_path / "new"
    (tmp_path / "points.jsonl").write_text('{"kept": true}\n')
    with pytest.raises(ValueError, match="already holds a sweep's results .points.jsonl.; pass --force"):
        check_out(tmp_path)
    with pytest.raises(ValueError, match="^out: "):
        sweep("glm5-h200", engine="model", out=tmp_path)
    assert (tmp_path / "points.jsonl").read_text() == '{"kept": true}\n'  # untouched
    assert check_out(tmp_path, force=True) == tmp_path
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="expected a folder, got the file"):
        check_out(tmp_path / "file")


def test_cli_refuses_before_any_work(tmp_path, capsys):
    (tmp_path / "table.md").write_text("earlier\n")
    start = time.perf_counter()
    assert main(["sweep", "--engine", "model", "--out", str(tmp_path)]) == 2
    assert "--out: " in capsys.readouterr().err and (tmp_path / "table.md").read_text() == "earlier\n"
    for bad in ("sessions=nan", "sessions=0.5", "host_gb=1e309", "sessions=0", "host_gb=-1"):
        assert main(["sweep", "--engine", "model", "--out", str(tmp_path / "x"), "--map", bad]) == 2
        err = capsys.readouterr().err
        assert "--map: expected" in err and err.count("\n") == 1, err
    assert time.perf_counter() - start < 20  # refused before the sweep ran
    assert not (tmp_path / "x").exists()


def test_the_measured_engine_takes_fp8_and_refuses_other_dtypes(tmp_path):
    cpu = yaml.safe_load((configs_root() / "sweeps" / "cpu.yaml").read_text())
    path = tmp_path / "fp8.yaml"
    path.write_text(yaml.safe_dump(cpu | {"kv_dtype": "fp8"}))
    assert load_sweep(str(path)).kv_dtype == "fp8"  # the CP engine reads the 656-byte fp8 rows
    path.write_text(yaml.safe_dump(cpu | {"kv_dtype": "fp16"}))
    with pytest.raises(ValueError, match="field 'kv_dtype': expected one of .'bf16', 'fp8'. for the measured engine"):
        load_sweep(str(path))


def test_api_arguments_checked_before_work():
    from layersplit import plan_capacity

    with pytest.raises(ValueError, match="cp: expected an integer >= 1, got True"):
        plan_capacity("glm-5", "h200", cp=True)
    with pytest.raises(ValueError, match="progress: expected a callable or None, got 5"):
        sweep("glm5-h200", engine="model", progress=5)
