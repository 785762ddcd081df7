"""Bad config inputs: each is one error line naming the file (or the variable) before any work, from the
library (``ConfigError``) and from the command line (exit 2, one stderr line) -- issue 29, item 4."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from layersplit.cli.app import main
from layersplit.plan.config import configs_root, load_hardware, load_model
from lsconfig.config_io import ConfigError
from layersplit.pd.spec.monitor_config import load_monitor_config

PLAN = ["plan", "--cp", "8", "--hardware", "h200"]


def _copy_model(tmp_path: Path, text: str | bytes, name: str = "m.yaml") -> Path:
    path = tmp_path / name
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    return path


def _cli_error(capsys, argv: list[str]) -> str:
    """Run the CLI; it must exit 2 with exactly one stderr line and print nothing on stdout."""
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 2 and out == "", (code, out)
    assert err.count("\n") == 1, err
    return err


def test_unreadable_file_is_one_line(tmp_path, monkeypatch, capsys):
    """Run as root, a chmod-000 file is still readable, so the read is made to raise ``PermissionError``
    (what a non-root user gets); where the test runs unprivileged, a real chmod-000 file is tried too."""
    path = _copy_model(tmp_path, (configs_root() / "models" / "glm-5.yaml").read_text())
    real_read = Path.read_bytes

    def denied(self):
        if self == path:
            raise PermissionError(13, "Permission denied", str(self))
        return real_read(self)

    with monkeypatch.context() as m:
        m.setattr(Path, "read_bytes", denied)
        with pytest.raises(ConfigError, match=rf"^{path}: expected a readable config file, got permission denied$"):
            load_model(path)
        err = _cli_error(capsys, ["plan", "--model", str(path), "--cp", "8", "--hardware", "h200"])
        assert str(path) in err and "permission denied" in err
    if os.geteuid() != 0:
        path.chmod(0)
        try:
            with pytest.raises(ConfigError, match="permission denied"):
                load_model(path)
        finally:
            path.chmod(0o644)


def test_folder_in_place_of_a_file(tmp_path, capsys):
    folder = tmp_path / "hw.yaml"
    folder.mkdir()
    with pytest.raises(ConfigError, match=rf"^{folder}: expected a hardware config file, got a folder$"):
        load_hardware(folder)
    err = _cli_error(capsys, ["plan", "--model", "glm-5", "--cp", "8", "--hardware", str(folder)])
    assert str(folder) in err


def test_not_utf8_names_the_file(tmp_path, capsys):
    path = _copy_model(tmp_path, b"name: glm-5\nnum_layers: \xff\n")
    with pytest.raises(ConfigError, match=rf"^{path}: expected UTF-8 text, got byte 0xff at offset 24 \(not UTF-8\)$"):
        load_model(path)
    err = _cli_error(capsys, ["plan", "--model", str(path), *PLAN[1:]])
    assert path.name in err and "UTF-8" in err
    monitor = _copy_model(tmp_path, b"\xfe\xff", "monitor.yaml")
    with pytest.raises(ConfigError, match=rf"^{monitor}: expected UTF-8 text"):
        load_monitor_config(monitor)


@pytest.mark.parametrize("text, line, col", [
    ("name: [unclosed\nnum_layers: 3\n", 2, 11),         # a flow sequence never closed: the ":" is wrong
    ("name: glm\n  num_layers: 3\n", 2, 13),              # a mapping value where none may start
    ("name: glm\nnum_layers: @x\n", 2, 13),               # a token that cannot start any value
], ids=["unclosed", "bad-indent", "reserved-char"])
def test_yaml_syntax_error_is_file_line_column(tmp_path, capsys, text, line, col):
    path = _copy_model(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_model(path)
    message = str(info.value)
    assert "\n" not in message and "^" not in message, message
    assert message.startswith(f"{path}:{line}:{col}: expected valid YAML, got a parse error: "), message
    err = _cli_error(capsys, ["plan", "--model", str(path), *PLAN[1:]])
    assert f"{path}:{line}:{col}:" in err


def test_config_dir_pointing_nowhere(tmp_path, monkeypatch, capsys):
    missing = tmp_path / "no-such-dir"
    monkeypatch.setenv("LAYERSPLIT_CONFIG_DIR", str(missing))
    want = rf"^LAYERSPLIT_CONFIG_DIR: expected an existing folder of configs, got '{missing}' \(no such folder\)$"
    with pytest.raises(ValueError, match=want):
        load_model("glm-5")
    err = _cli_error(capsys, ["plan", "--model", "glm-5", *PLAN[1:]])
    assert "LAYERSPLIT_CONFIG_DIR" in err and "no such folder" in err and "expected one of []" not in err
    a_file = _copy_model(tmp_path, "x: 1\n", "file")
    monkeypatch.setenv("LAYERSPLIT_CONFIG_DIR", str(a_file))
    with pytest.raises(ValueError, match=r"\(a file\)$"):
        load_hardware("h200")


def test_config_dir_without_models_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("LAYERSPLIT_CONFIG_DIR", str(tmp_path))
    with pytest.raises(ConfigError, match=rf"^model 'glm-5': expected a folder {tmp_path / 'models'} of model "
                                          r"configs, got no such folder$"):
        load_model("glm-5")


@pytest.mark.parametrize("edit,message", [
    (lambda t: t.replace("hbm_bandwidth: ", "hbm_bandwidth: .inf #"),
     "field 'hbm_bandwidth': expected a finite number, got inf"),
    (lambda t: t.replace("hbm_bandwidth: ", "hbm_bandwidth: -.inf #"), "field 'hbm_bandwidth': expected a finite number"),
    (lambda t: t.replace("dense_flops_fp8: ", "dense_flops_fp8: .NaN #"),
     "field 'dense_flops_fp8': expected a finite number"),
    (lambda t: t + "gpus_per_node: 4\n", "duplicate key 'gpus_per_node' (first at line"),
], ids=["inf", "minus-inf", "nan", "key-twice"])
def test_hardware_values_yaml_accepts_but_a_config_cannot_use(tmp_path, capsys, edit, message):
    """YAML reads ``.inf``/``.nan`` as floats and keeps the last of two equal keys: both refused, naming the field."""
    path = _copy_model(tmp_path, edit((configs_root() / "hardware" / "h200.yaml").read_text()), "hw.yaml")
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        load_hardware(path)
    assert message in _cli_error(capsys, ["plan", "--model", "glm-5", "--cp", "8", "--hardware", str(path)])


def test_a_config_is_named_by_a_string_or_a_path():
    with pytest.raises(TypeError, match=r"name_or_path: expected a model config name or path \(str or Path\), got 42"):
        load_model(42)
    with pytest.raises(ConfigError, match="model '': expected a config name or a path, got an empty name"):
        load_model("")
    with pytest.raises(ConfigError, match="hardware ' ': expected a config name or a path"):
        load_hardware(" ")
