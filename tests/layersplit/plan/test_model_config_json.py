"""``--model`` takes a model's own ``config.json`` (a file, a model folder, a model id in the local Hugging
Face cache), checked key by key, and gives exactly the YAML model's capacity -- issue 29, item 2.
Fixtures: ``tests/layersplit/plan/model_configs/`` (its README says where the key names and values come from)."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest

from layersplit.cli.app import main
from layersplit.plan.config import IndexerLayers, load_model
from layersplit.plan.model_json import ARCHITECTURES, FIELDS
from lsconfig.config_io import ConfigError

FIXTURES = Path(__file__).resolve().parent / "model_configs"
PAIRS = {"GLM-5": "glm-5", "GLM-5.2": "glm-5.2", "DeepSeek-V3.2": "deepseek-v3.2"}


def _fixture(name: str) -> dict:
    return json.loads((FIXTURES / name / "config.json").read_text())


def _write(folder: Path, data: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(data))
    return folder / "config.json"


def _same_model(got, yaml_name: str) -> None:
    want = load_model(yaml_name)
    assert dataclasses.replace(got, name=want.name) == want


@pytest.mark.parametrize("folder", list(PAIRS))
def test_fixture_is_the_yaml_model(folder):
    by_folder = load_model(FIXTURES / folder)
    assert by_folder.name == folder
    _same_model(by_folder, PAIRS[folder])
    _same_model(load_model(FIXTURES / folder / "config.json"), PAIRS[folder])


def test_glm52_indexer_layers_from_freq_and_offset():
    m = load_model(FIXTURES / "GLM-5.2")
    assert m.indexer_layers == IndexerLayers(leading=3, start=6, every=4)
    assert m.indexer_layer_ids[:6] == (0, 1, 2, 6, 10, 14) and len(m.indexer_layer_ids) == 21


@pytest.mark.parametrize("folder", list(PAIRS))
def test_plan_from_config_json_equals_plan_from_yaml(folder, capsys):
    def plan(model: str) -> dict:
        assert main(["plan", "--model", model, "--cp", "8", "--hardware", "h200", "--json"]) == 0
        return json.loads(capsys.readouterr().out)

    from_json, from_yaml = plan(str(FIXTURES / folder)), plan(PAIRS[folder])
    assert from_json.pop("model") == folder and from_yaml.pop("model") == PAIRS[folder]
    assert from_json == from_yaml


def test_hf_cache_model_id(tmp_path, monkeypatch):
    repo = tmp_path / "hub" / "models--zai-org--GLM-5"
    _write(repo / "snapshots" / "0123abc", _fixture("GLM-5"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    only = load_model("zai-org/GLM-5")  # no refs/main: the one snapshot
    assert only.name == "zai-org/GLM-5"
    _same_model(only, "glm-5")
    _write(repo / "snapshots" / "4567def", _fixture("GLM-5.2"))
    with pytest.raises(ConfigError, match=r"^model 'zai-org/GLM-5': expected one snapshot .* got 2; pass the snapshot"):
        load_model("zai-org/GLM-5")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("4567def\n")
    _same_model(load_model("zai-org/GLM-5"), "glm-5.2")  # refs/main decides
    with pytest.raises(ConfigError, match=r"model 'zai-org/GLM-9': expected one of \[.*local Hugging Face cache "
                                          rf"\({tmp_path / 'hub'}\); got no such config$"):
        load_model("zai-org/GLM-9")


def test_hf_home_locates_the_cache(tmp_path, monkeypatch):
    _write(tmp_path / "home" / "hub" / "models--deepseek-ai--DeepSeek-V3.2" / "snapshots" / "x",
           _fixture("DeepSeek-V3.2"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    _same_model(load_model("deepseek-ai/DeepSeek-V3.2"), "deepseek-v3.2")


@pytest.mark.parametrize("key", sorted(FIELDS.values()))
def test_missing_key_is_one_line_naming_it_and_the_file(tmp_path, key):
    data = _fixture("GLM-5")
    del data[key]
    path = _write(tmp_path / "m", data)
    with pytest.raises(ConfigError) as info:
        load_model(tmp_path / "m")
    assert str(info.value) == f"{path}: field '{key}': expected an int, got nothing (field missing)"


@pytest.mark.parametrize("change, message", [
    ({"architectures": ["LlamaForCausalLM"]},
     f"field 'architectures': expected one of {list(ARCHITECTURES)}, got 'LlamaForCausalLM' (unsupported architecture)"),
    ({"architectures": None}, "field 'architectures': expected a list naming one of"),
    ({"hidden_size": "6144"}, "field 'hidden_size': expected int, got '6144' (str)"),
    ({"index_topk": True}, "field 'index_topk': expected int, got True (bool)"),
    ({"first_k_dense_replace": 78}, "field 'first_k_dense_replace': expected < num_layers (78), got 78"),
    ({"kv_lora_rank": 500}, "field 'kv_lora_rank': expected a power of 2, got 500"),
    ({"q_lora_rank": None}, "field 'q_lora_rank': expected int, got None"),
    ({"index_topk_freq": 0}, "field 'index_topk_freq': expected an int >= 1, got 0"),
    ({"index_topk_freq": 4, "index_skip_topk_offset": 0}, "field 'index_skip_topk_offset': expected an int >= 1"),
    ({"indexer_types": ["full"] * 3}, "field 'indexer_types': expected 78 entries of 'full' or 'shared'"),
    ({"index_topk_pattern": "F" * 77 + "X"}, "field 'index_topk_pattern': expected 78 letters F or S"),
    ({"index_topk_pattern": "S" + "F" * 77}, "field 'indexer_types/index_topk_pattern/index_topk_freq': expected a "
                                             "rule that includes layer 0"),
    ({"index_topk_pattern": "FFSFSSFFF" + "S" * 69}, "indexer layers [0, 1, 3, 6, 7, 8]: expected leading layers then "
                                                    "every k-th layer"),
], ids=["arch", "no-arch", "str", "bool", "dense", "pow2", "null", "freq0", "offset0", "types-len", "pattern",
        "no-layer-0", "irregular"])
def test_bad_config_json_is_one_line(tmp_path, change, message):
    path = _write(tmp_path / "m", {**_fixture("GLM-5"), **change})
    with pytest.raises(ConfigError) as info:
        load_model(path)
    text = str(info.value)
    assert text.startswith(f"{path}: ") and message in text and "\n" not in text, text


def test_not_json_and_not_an_object(tmp_path, capsys):
    path = tmp_path / "broken" / "config.json"
    path.parent.mkdir()
    path.write_text('{"architectures": ["GlmMoeDsaForCausalLM"],\n "hidden_size": }\n')
    with pytest.raises(ConfigError, match=rf"^{path}:2:17: expected valid JSON, got Expecting value$"):
        load_model(path.parent)
    assert main(["plan", "--model", str(path.parent), "--cp", "8", "--hardware", "h200"]) == 2
    assert capsys.readouterr().err.count("\n") == 1
    path.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="expected a JSON object of fields, got list"):
        load_model(path)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match=rf"^{empty}: expected a model config file, got a folder without config.json$"):
        load_model(empty)


@pytest.mark.parametrize("folder, arch_cls", [("GLM-5.2", "GlmMoeDsaConfig"), ("DeepSeek-V3.2", "DeepseekV32Config")])
def test_transformers_saved_config_reads_the_same(tmp_path, folder, arch_cls):
    """The fixture through Hugging Face's own config class and back (``to_dict``, as ``save_pretrained``
    writes it; GLM-5.2's schedule then arrives as ``indexer_types``): still the YAML model."""
    transformers = pytest.importorskip("transformers")
    cls = getattr(transformers, arch_cls, None)
    if cls is None:  # CI pins a transformers that has both classes: there a missing one is a failure
        reason = f"transformers {transformers.__version__} has no {arch_cls}"
        pytest.fail(reason) if os.environ.get("CI") else pytest.skip(reason)
    saved = cls(**_fixture(folder)).to_dict()
    _same_model(load_model(_write(tmp_path / folder, saved)), PAIRS[folder])
