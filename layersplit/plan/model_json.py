"""A model's own Hugging Face ``config.json`` as a :class:`~layersplit.plan.config.ModelConfig`.

``layersplit plan --model`` takes, besides this project's YAML names, a ``config.json`` path, a model
folder holding one, or a model id already in the local Hugging Face cache (``ORG/NAME``; read from
``models--ORG--NAME/snapshots/<refs/main>/config.json``, nothing is downloaded).

Field names are the checkpoints' own (GLM-5 / GLM-5.1 / GLM-5.2: ``GlmMoeDsaForCausalLM``,
DeepSeek-V3.2: ``DeepseekV32ForCausalLM``), each checked: a missing or ill-typed one is one error line
naming the key and the file. Which layers run the indexer follows SGLang 0.5.23's rule
(``configs/model_config.py``: ``dsa_layer_skips_topk``) and Hugging Face's ``GlmMoeDsaConfig``, in
this order: ``indexer_types`` (``"full"`` / ``"shared"`` per layer), ``index_topk_pattern`` (``F`` /
``S`` per layer), else ``index_topk_freq`` with ``index_skip_topk_offset`` (default 2): layer ``i``
computes its top-k when ``max(i - offset + 1, 0) % freq == 0`` (GLM-5.2: freq 4, offset 3 gives
0, 1, 2, 6, 10, ..., 74).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lsconfig import envs
from lsconfig.config_io import ConfigError, check_field, read_json

ARCHITECTURES = ("DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM")

# ModelConfig field -> config.json key
FIELDS = {
    "num_layers": "num_hidden_layers",
    "num_mtp_layers": "num_nextn_predict_layers",
    "hidden_size": "hidden_size",
    "num_heads": "num_attention_heads",
    "q_lora_rank": "q_lora_rank",
    "kv_lora_rank": "kv_lora_rank",
    "qk_rope_head_dim": "qk_rope_head_dim",
    "qk_nope_head_dim": "qk_nope_head_dim",
    "v_head_dim": "v_head_dim",
    "index_n_heads": "index_n_heads",
    "index_head_dim": "index_head_dim",
    "index_topk": "index_topk",
    "first_k_dense": "first_k_dense_replace",
    "n_routed_experts": "n_routed_experts",
    "num_experts_per_tok": "num_experts_per_tok",
    "n_shared_experts": "n_shared_experts",
    "moe_intermediate_size": "moe_intermediate_size",
    "intermediate_size": "intermediate_size",
    "vocab_size": "vocab_size",
}


def is_model_json(path: Path) -> bool:
    """A ``*.json`` file, or a folder that holds a ``config.json``."""
    return path.suffix == ".json" or (path.is_dir() and (path / "config.json").is_file())


def hf_cache_config(model_id: str) -> Path | None:
    """``config.json`` of ``ORG/NAME`` in the local hub cache (the ``refs/main`` snapshot, else the only
    one), or None when the model is not there. Several snapshots and no ``refs/main``: an error."""
    repo = envs.hf_hub_cache() / ("models--" + model_id.replace("/", "--"))
    if not repo.is_dir():
        return None
    ref = repo / "refs" / "main"
    if ref.is_file():
        path = repo / "snapshots" / ref.read_text().strip() / "config.json"
        return path if path.is_file() else None
    found = sorted((repo / "snapshots").glob("*/config.json"))
    if len(found) > 1:
        raise ConfigError(f"model '{model_id}': expected one snapshot in {repo} (or refs/main), got {len(found)}; "
                          "pass the snapshot folder")
    return found[0] if found else None


def _int(path: Path, data: dict, key: str) -> int:
    if key not in data:
        raise ConfigError(f"{path}: field '{key}': expected an int, got nothing (field missing)")
    return check_field(path, key, data[key], int, nonnegative=True)


def indexer_layer_ids(path: Path, data: dict, num_layers: int) -> tuple[int, ...]:
    """The layers that compute their own top-k (the others reuse the last one and keep no indexer keys)."""
    types = data.get("indexer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != num_layers or set(types) - {"full", "shared"}:
            raise ConfigError(f"{path}: field 'indexer_types': expected {num_layers} entries of 'full' or 'shared', "
                              f"got {types!r}")
        return tuple(i for i, t in enumerate(types) if t == "full")
    pattern = data.get("index_topk_pattern")
    if pattern is not None:
        if not isinstance(pattern, (str, list)) or len(pattern) != num_layers or set(pattern) - {"F", "S"}:
            raise ConfigError(f"{path}: field 'index_topk_pattern': expected {num_layers} letters F or S, "
                              f"got {pattern!r}")
        return tuple(i for i, c in enumerate(pattern) if c == "F")
    freq = data.get("index_topk_freq")
    freq = 1 if freq is None else check_field(path, "index_topk_freq", freq, int)
    offset = data.get("index_skip_topk_offset")
    offset = 2 if offset is None else check_field(path, "index_skip_topk_offset", offset, int)
    if freq < 1:
        raise ConfigError(f"{path}: field 'index_topk_freq': expected an int >= 1, got {freq}")
    if offset < 1:
        raise ConfigError(f"{path}: field 'index_skip_topk_offset': expected an int >= 1 (layer 0 must compute "
                          f"a top-k), got {offset}")
    return tuple(i for i in range(num_layers) if max(i - offset + 1, 0) % freq == 0)


def model_fields(path: Path) -> dict[str, Any]:
    """The :class:`ModelConfig` fields (except ``name`` and ``indexer_layers``, given as
    ``indexer_layer_ids``) read from ``path``, each checked."""
    data = read_json(path)
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object of fields, got {type(data).__name__}")
    archs = data.get("architectures")
    if not isinstance(archs, list) or not archs:
        raise ConfigError(f"{path}: field 'architectures': expected a list naming one of {list(ARCHITECTURES)}, "
                          f"got {archs!r}")
    if archs[0] not in ARCHITECTURES:
        raise ConfigError(f"{path}: field 'architectures': expected one of {list(ARCHITECTURES)}, got "
                          f"{archs[0]!r} (unsupported architecture)")
    values = {field: _int(path, data, key) for field, key in FIELDS.items()}
    values["indexer_layer_ids"] = indexer_layer_ids(path, data, values["num_layers"])
    return values
