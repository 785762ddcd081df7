"""An operator pasting SGLang's flags into ``plan`` gets the same plan as with this project's names."""

from __future__ import annotations

import json

from layersplit.cli.app import main


def _plan(argv: list[str], capsys) -> dict:
    assert main(["plan", "--cp", "8", "--hardware", "h200", "--json", *argv]) == 0
    return json.loads(capsys.readouterr().out)


def test_sglang_flag_names_are_aliases(capsys):
    ours = _plan(["--model", "glm-5", "--kv-dtype", "fp8", "--mem-fraction", "0.85"], capsys)
    sglang = _plan(["--model-path", "glm-5", "--kv-cache-dtype", "fp8_e4m3", "--mem-fraction-static", "0.85"], capsys)
    assert ours == sglang and ours["kv_dtype"] == "fp8"
    assert _plan(["--model", "glm-5", "--kv-cache-dtype", "auto"], capsys)["kv_dtype"] == "bf16"


def test_an_sglang_dtype_we_do_not_model_is_named(capsys):
    assert main(["plan", "--model", "glm-5", "--cp", "8", "--hardware", "h200", "--kv-cache-dtype", "fp8_e5m2"]) == 2
    err = capsys.readouterr().err
    assert "--kv-dtype/--kv-cache-dtype: expected one of" in err and "'fp8_e5m2'" in err
