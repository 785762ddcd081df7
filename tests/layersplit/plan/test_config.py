"""Config loading: shipped configs, derived values, and errors that name file, field, expected, got."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from layersplit.plan.config import ConfigError, available, configs_root, load_hardware, load_model


def test_shipped_configs_load():
    assert available("model") == ["deepseek-v3.2", "glm-5", "glm-5.2", "tiny"]
    assert available("hardware") == ["b200", "cpu", "h200", "h800"]
    for name in available("model"):
        assert load_model(name).name == name
    for name in available("hardware"):
        assert load_hardware(name).name == name


def test_glm52_indexer_layers():
    ids = load_model("glm-5.2").indexer_layer_ids
    assert len(ids) == 21 and ids[:5] == (0, 1, 2, 6, 10) and ids[-1] == 74
    assert load_model("glm-5").indexer_layer_ids == tuple(range(78))


@pytest.mark.parametrize("name,published", [("glm-5", 744e9), ("deepseek-v3.2", 671e9)])
def test_param_count_matches_published_size(name, published):
    assert abs(load_model(name).param_count() / published - 1) < 0.01


def test_cache_bytes():
    m = load_model("glm-5")
    assert (m.kv_bytes_per_token("bf16"), m.kv_bytes_per_token("fp8"), m.index_bytes_per_token) == (1152, 656, 132)
    m52 = load_model("glm-5.2")
    assert m52.layer_bytes_per_token(6, "bf16") == 1284 and m52.layer_bytes_per_token(7, "bf16") == 1152


def write(folder: Path, stem: str, **changes) -> Path:
    data = yaml.safe_load((configs_root() / "models" / "glm-5.yaml").read_text())
    for key, value in changes.items():
        if value is ...:
            del data[key]
        else:
            data[key] = value
    path = folder / f"{stem}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


BAD_MODELS = {
    "unknown-key": ({"num_layer": 3}, r"unknown field 'num_layer' \(known fields: name, num_layers"),
    "wrong-type": ({"num_layers": "many"}, r"field 'num_layers': expected int, got 'many' \(str\)"),
    "float-for-int": ({"hidden_size": 61.5}, r"field 'hidden_size': expected int, got 61.5 \(float\)"),
    "missing": ({"vocab_size": ...}, r"field 'vocab_size': expected a value, got nothing"),
    "zero-layers": ({"num_layers": 0}, r"field 'num_layers': expected int >= 1, got 0"),
    "dense-too-many": ({"first_k_dense": 78}, r"field 'first_k_dense': expected < num_layers \(78\), got 78"),
    "topk-experts": ({"num_experts_per_tok": 300}, r"field 'num_experts_per_tok': expected <= n_routed_experts"),
    "odd-rope": ({"qk_rope_head_dim": 63}, r"field 'qk_rope_head_dim': expected an even number"),
    "latent-not-pow2": ({"kv_lora_rank": 500}, r"field 'kv_lora_rank': expected a power of 2, got 500"),
    "indexer-rule": ({"indexer_layers": {"leading": 0, "start": 4, "every": 4}}, r"field 'indexer_layers': expected a rule that includes layer 0"),
    "indexer-keys": ({"indexer_layers": {"every": 4}}, r"field 'indexer_layers': expected 'all' or a mapping"),
    "negative": ({"index_topk": -5}, r"field 'index_topk': expected a value >= 0, got -5"),
}


@pytest.mark.parametrize("case", list(BAD_MODELS))
def test_bad_model_config_errors(tmp_path, case):
    changes, pattern = BAD_MODELS[case]
    path = write(tmp_path, case, **changes)
    with pytest.raises(ConfigError, match=pattern) as info:
        load_model(path)
    assert str(info.value).startswith(str(path)), "the error must name the file"


def test_bad_yaml_and_not_a_mapping(tmp_path):
    broken = tmp_path / "broken.yaml"
    broken.write_text("name: [unclosed\n")
    with pytest.raises(ConfigError, match="expected valid YAML"):
        load_model(broken)
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("42\n")
    with pytest.raises(ConfigError, match="expected a mapping of fields, got int"):
        load_model(scalar)


def test_unknown_name_lists_known():
    with pytest.raises(ConfigError, match=r"model 'glm-6': expected one of \['deepseek-v3.2', 'glm-5', 'glm-5.2', 'tiny'\]"):
        load_model("glm-6")
    with pytest.raises(ConfigError, match="no such file"):
        load_model("/nonexistent/glm.yaml")


def test_bad_hardware(tmp_path):
    data = yaml.safe_load((configs_root() / "hardware" / "h200.yaml").read_text())
    data["hbm_bytes"] = 0
    path = tmp_path / "hw.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match=r"hw.yaml: field 'hbm_bytes': expected a value > 0, got 0"):
        load_hardware(path)


def test_b200_datasheet_figures():
    """B200 (HGX/DGX, 1000 W): the dense figures (half the sparse ones), per-direction NVLink, SM 10."""
    hw = load_hardware("b200")
    assert (hw.hbm_bytes, hw.hbm_bandwidth, hw.nvlink_bandwidth) == (180e9, 8e12, 9e11)
    assert (hw.dense_flops_bf16, hw.dense_flops_fp8) == (2.25e15, 4.5e15)
    assert hw.hbm_reported_bytes == round(178.35 * 2**30) and hw.sm_major == 10
    assert [load_hardware(n).sm_major for n in ("h200", "h800", "cpu")] == [9, 9, 0]


def _hardware(tmp_path, **changes) -> Path:
    data = yaml.safe_load((configs_root() / "hardware" / "h200.yaml").read_text())
    for key, value in changes.items():
        if value is ...:
            del data[key]
        else:
            data[key] = value
    path = tmp_path / "hw.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize("change,message", [
    ({"sm_major": ...}, r"hw.yaml: field 'sm_major': expected a value, got nothing \(field missing\)$"),
    ({"sm_major": "hopper"}, r"hw.yaml: field 'sm_major': expected int, got 'hopper' \(str\)$"),
    ({"sm_major": 9.0}, r"hw.yaml: field 'sm_major': expected int, got 9.0 \(float\)$"),
    ({"sm_major": True}, r"hw.yaml: field 'sm_major': expected int, got True \(bool\)$"),
    ({"sm_major": -1}, r"hw.yaml: field 'sm_major': expected a value >= 0, got -1$"),
    ({"sm_major": 3}, r"hw.yaml: field 'sm_major': expected 0 \(no CUDA device\) or a CUDA compute capability "
                      r"major in 7\.\.12 \(9: Hopper.*\), got 3$"),
    ({"sm_major": 90}, r"field 'sm_major': expected 0 \(no CUDA device\) or .*, got 90$"),
], ids=["missing", "a-name", "float", "bool", "negative", "too-old", "sm-90-not-major"])
def test_bad_sm_major(tmp_path, change, message):
    with pytest.raises(ConfigError, match=message):
        load_hardware(_hardware(tmp_path, **change))


def test_sm_major_zero_and_edges_load(tmp_path):
    for value in (0, 7, 12):
        assert load_hardware(_hardware(tmp_path, sm_major=value)).sm_major == value


def test_config_dir_env(tmp_path, monkeypatch):
    (tmp_path / "models").mkdir()
    write(tmp_path / "models", "custom", name="custom", num_layers=10, first_k_dense=1)
    monkeypatch.setenv("LAYERSPLIT_CONFIG_DIR", str(tmp_path))
    assert load_model("custom").num_layers == 10
