"""Model and hardware configs: YAML files under ``configs/`` loaded into frozen dataclasses; a model
may also be given as its own Hugging Face ``config.json`` (a file, a model folder or a cached model id;
:mod:`.model_json`).

Every loading error names the file, the field, what was expected and what was found::

    ConfigError: configs/models/glm-5.yaml: field 'num_layers': expected int >= 1, got 'many' (str)
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lsconfig import config_io, envs, paths
from lsconfig.config_io import ConfigError, build, check_field, read_yaml, require
from dsa_kernels.layout import index_row_bytes, mla_row_bytes
from layersplit.plan import model_json


def configs_root() -> Path:
    """``LAYERSPLIT_CONFIG_DIR`` if set (an existing folder), else the shipped configs (the checkout's
    ``configs/`` or the wheel's copy, :func:`lsconfig.paths.shipped_configs`)."""
    return paths.configs_root()


@dataclass(frozen=True)
class IndexerLayers:
    """Which layers run the lightning indexer: all, or ``leading`` first layers then every
    ``every``-th layer from ``start`` (GLM-5.2: 0, 1, 2, then 6, 10, ..., 74)."""

    leading: int
    start: int
    every: int

    def layer_ids(self, num_layers: int) -> tuple[int, ...]:
        rest = range(self.start, num_layers, self.every) if self.every else ()
        return tuple(sorted(set(range(min(self.leading, num_layers))) | set(rest)))

    @classmethod
    def from_ids(cls, ids: tuple[int, ...], num_layers: int) -> IndexerLayers | None:
        """The rule whose ``layer_ids(num_layers)`` is exactly ``ids`` (``ALL_LAYERS`` for every
        layer), or None when ``ids`` is not leading layers then a fixed stride."""
        if tuple(ids) == tuple(range(num_layers)):
            return ALL_LAYERS
        leading = next((i for i, layer in enumerate(ids) if layer != i), len(ids))
        rest = ids[leading:]
        every = (rest[1] - rest[0]) if len(rest) > 1 else (num_layers if rest else 0)
        rule = cls(leading=leading, start=rest[0] if rest else 0, every=every)
        return rule if rule.layer_ids(num_layers) == tuple(ids) else None


ALL_LAYERS = IndexerLayers(leading=1 << 30, start=0, every=0)


@dataclass(frozen=True)
class ModelConfig:
    name: str
    num_layers: int
    num_mtp_layers: int
    hidden_size: int
    num_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    indexer_layers: IndexerLayers
    first_k_dense: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    moe_intermediate_size: int
    intermediate_size: int
    vocab_size: int

    @property
    def indexer_layer_ids(self) -> tuple[int, ...]:
        return self.indexer_layers.layer_ids(self.num_layers)

    def has_indexer(self, layer: int) -> bool:
        return layer in set(self.indexer_layer_ids)

    def kv_bytes_per_token(self, kv_dtype: str) -> int:
        """MLA latent cache bytes per token per layer (1152 bf16 / 656 fp8 at 512 + 64)."""
        return mla_row_bytes(self.kv_lora_rank, self.qk_rope_head_dim, kv_dtype)

    @property
    def index_bytes_per_token(self) -> int:
        """Indexer-key cache bytes per token on a layer that runs the indexer (132 at D = 128)."""
        return index_row_bytes(self.index_head_dim)

    def layer_bytes_per_token(self, layer: int, kv_dtype: str) -> int:
        return self.kv_bytes_per_token(kv_dtype) + (self.index_bytes_per_token if self.has_indexer(layer) else 0)

    def attention_params(self, layer: int) -> int:
        """MLA (q_a, q_b, kv_a latent + rope, kv_b, o) plus, on indexer layers, the indexer (wq_b, wk, head weights)."""
        h, heads = self.hidden_size, self.num_heads
        qk = self.qk_nope_head_dim + self.qk_rope_head_dim
        attn = (h * self.q_lora_rank + self.q_lora_rank * heads * qk
                + h * (self.kv_lora_rank + self.qk_rope_head_dim)
                + self.kv_lora_rank * heads * (self.qk_nope_head_dim + self.v_head_dim)
                + heads * self.v_head_dim * h)
        if self.has_indexer(layer):
            attn += self.q_lora_rank * self.index_n_heads * self.index_head_dim + h * (self.index_head_dim + self.index_n_heads)
        return attn

    def mlp_params(self, layer: int, active: bool = False) -> int:
        """Dense SwiGLU (3 x hidden x intermediate) on the first layers; MoE (routed + shared experts + router)
        after. ``active``: only the experts one token uses (top-k routed + shared)."""
        h = self.hidden_size
        if layer < self.first_k_dense:
            return 3 * h * self.intermediate_size
        experts = self.num_experts_per_tok if active else self.n_routed_experts
        router = 0 if active else h * self.n_routed_experts
        return (experts + self.n_shared_experts) * 3 * h * self.moe_intermediate_size + router

    def param_count(self) -> int:
        """Weights of the main layers + embeddings + head (MTP layers excluded), from the dims."""
        layers = sum(self.attention_params(layer) + self.mlp_params(layer) for layer in range(self.num_layers))
        return layers + 2 * self.vocab_size * self.hidden_size

    def routed_expert_params(self) -> int:
        """Routed experts of every MoE layer: what expert parallelism splits over the EP group."""
        moe_layers = self.num_layers - self.first_k_dense
        return moe_layers * self.n_routed_experts * 3 * self.hidden_size * self.moe_intermediate_size

    def replicated_params(self) -> int:
        """What every rank of SGLang's prefill CP holds whole: attention and indexer, dense MLPs,
        shared experts, routers, embeddings, head (norms are negligible and not counted)."""
        return self.param_count() - self.routed_expert_params()


MIN_SM_MAJOR, MAX_SM_MAJOR = 7, 12  # Volta .. consumer Blackwell: the CUDA generations a config may name


@dataclass(frozen=True)
class HardwareConfig:
    name: str
    hbm_bytes: int
    hbm_bandwidth: float  # bytes/s
    nvlink_bandwidth: float  # bytes/s, one direction, per GPU
    pcie_h2d_bandwidth: float  # bytes/s, pinned host -> device
    dense_flops_bf16: float  # FLOP/s, dense (no sparsity)
    dense_flops_fp8: float
    hbm_reported_bytes: int  # what the device reports as its total memory (the KV budget starts here)
    gpus_per_node: int
    host_dram_bandwidth: float  # bytes/s, one node's host DRAM, shared by every GPU's reloads
    gpus_per_pcie_switch: int  # GPUs behind one PCIe switch uplink
    pcie_switch_bandwidth: float  # bytes/s, one switch uplink to the host, shared by its GPUs
    # CUDA compute capability major (9 Hopper, 10 datacenter Blackwell; 0: no CUDA device). Which SGLang
    # 0.5.23 layouts run on it is :func:`layersplit.plan.modes.unavailable_reason`'s rule, not a per-file list
    sm_major: int

    def reload_bandwidth(self, concurrent: int) -> float:
        """Host -> device bytes/s one GPU gets while ``concurrent`` GPUs of its node reload at once:
        its own PCIe link, its share of its switch uplink, and its share of host DRAM (MODEL)."""
        behind_switch = min(concurrent, self.gpus_per_pcie_switch)
        return min(self.pcie_h2d_bandwidth, self.pcie_switch_bandwidth / behind_switch,
                   self.host_dram_bandwidth / max(1, concurrent))


def _parse_indexer_layers(path: Path, value: Any) -> IndexerLayers:
    if value == "all":
        return ALL_LAYERS
    if not isinstance(value, dict) or set(value) != {"leading", "start", "every"}:
        raise ConfigError(
            f"{path}: field 'indexer_layers': expected 'all' or a mapping with keys leading, start, every; "
            f"got {value!r}"
        )
    parsed = {k: check_field(path, f"indexer_layers.{k}", v, int, nonnegative=True) for k, v in value.items()}
    return IndexerLayers(**parsed)


def _build(cls: type, path: Path, data: Any, special: dict[str, Any]) -> Any:
    return build(cls, path, data, special=special, nonnegative=True)


def _validate_model(path: Path, m: ModelConfig, key_of: dict[str, str] | None = None) -> ModelConfig:
    """Range checks; ``key_of`` renames fields in errors (a ``config.json``'s own keys)."""
    key_of = key_of or {}

    def require(path, cond, key, expected, got):  # the module's require, with the field renamed
        config_io.require(path, cond, key_of.get(key, key), expected, got)

    positive = ["num_layers", "hidden_size", "num_heads", "q_lora_rank", "kv_lora_rank", "qk_rope_head_dim",
                "qk_nope_head_dim", "v_head_dim", "index_n_heads", "index_head_dim", "index_topk",
                "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "intermediate_size", "vocab_size"]
    for key in positive:
        require(path, getattr(m, key) >= 1, key, "int >= 1", getattr(m, key))
    require(path, m.first_k_dense < m.num_layers, "first_k_dense", f"< num_layers ({m.num_layers})", m.first_k_dense)
    require(path, m.num_experts_per_tok <= m.n_routed_experts, "num_experts_per_tok",
             f"<= n_routed_experts ({m.n_routed_experts})", m.num_experts_per_tok)
    require(path, m.qk_rope_head_dim % 2 == 0, "qk_rope_head_dim", "an even number (rope pairs)", m.qk_rope_head_dim)
    require(path, m.index_head_dim % 16 == 0, "index_head_dim", "a multiple of 16", m.index_head_dim)
    require(path, math.log2(m.kv_lora_rank).is_integer(), "kv_lora_rank", "a power of 2", m.kv_lora_rank)
    ids = m.indexer_layer_ids
    require(path, bool(ids) and ids[0] == 0, "indexer_layers", "a rule that includes layer 0 (later layers reuse "
             "the last top-k, so the first layer must compute one)", m.indexer_layers)
    return m


_FOLDERS = {"model": "models", "hardware": "hardware"}


def check_name_or_path(kind: str, name_or_path, arg: str = "name_or_path") -> None:
    """A config is named by a ``str`` or a ``Path``, not empty: a ``TypeError`` naming the argument ``arg``, or a
    :class:`ConfigError`, before any file is looked for (``Path("")`` would be the current folder)."""
    if not isinstance(name_or_path, (str, Path)):
        raise TypeError(f"{arg}: expected a {kind} config name or path (str or Path), got {name_or_path!r} "
                        f"({type(name_or_path).__name__})")
    if not str(name_or_path).strip():
        raise ConfigError(f"{kind} {str(name_or_path)!r}: expected a config name or a path, got an empty name")


def _resolve(kind: str, name_or_path: str | Path) -> Path:
    """The file behind a config name or path; for a model also a ``config.json``, a folder holding one,
    or a model id (``ORG/NAME``) in the local Hugging Face cache."""
    check_name_or_path(kind, name_or_path)
    path = Path(name_or_path)
    if kind == "model" and model_json.is_model_json(path):
        path = path / "config.json" if path.is_dir() else path
    if path.suffix in (".yaml", ".yml", ".json") or path.exists():
        if not path.is_file():
            folder = "a folder without config.json" if kind == "model" else "a folder"
            got = folder if path.is_dir() else "no such file"
            raise ConfigError(f"{path}: expected a {kind} config file, got {got}")
        return path
    cached = model_json.hf_cache_config(str(name_or_path)) if kind == "model" and "/" in str(name_or_path) else None
    if cached:
        return cached
    folder = configs_root() / _FOLDERS[kind]
    if not folder.is_dir():
        raise ConfigError(f"{kind} '{name_or_path}': expected a folder {folder} of {kind} configs, got no such folder")
    path = folder / f"{name_or_path}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in folder.glob("*.yaml"))
        also = (", a config.json or model folder, or a model id in the local Hugging Face cache "
                f"({envs.hf_hub_cache()})") if kind == "model" else ""
        raise ConfigError(f"{kind} '{name_or_path}': expected one of {known}, a path to a .yaml file{also}; "
                          "got no such config")
    return path


_JSON_KEYS = {**model_json.FIELDS, "indexer_layers": "indexer_types/index_topk_pattern/index_topk_freq"}


def _model_from_json(path: Path, name: str) -> ModelConfig:
    values = model_json.model_fields(path)
    ids = values.pop("indexer_layer_ids")
    rule = IndexerLayers.from_ids(ids, values["num_layers"])
    if rule is None:
        raise ConfigError(f"{path}: indexer layers {list(ids)}: expected leading layers then every k-th layer "
                          "(the pattern the planner models), got another pattern")
    return _validate_model(path, ModelConfig(name=name, indexer_layers=rule, **values), _JSON_KEYS)


def load_model(name_or_path: str | Path) -> ModelConfig:
    """Load ``configs/models/<name>.yaml``, a YAML path, or a model's own ``config.json`` (a file, a
    folder holding one, or a cached model id; :mod:`.model_json`) into a validated :class:`ModelConfig`."""
    path = _resolve("model", name_or_path)
    if path.suffix == ".json":  # named by its folder (a model directory) or, from the cache, by its id
        given = Path(name_or_path)
        name = (path.parent.name if path.name == "config.json" else path.stem) if given.exists() else str(name_or_path)
        return _model_from_json(path, name)
    model = _build(ModelConfig, path, read_yaml(path), {"indexer_layers": _parse_indexer_layers})
    return _validate_model(path, model)


def load_hardware(name_or_path: str | Path) -> HardwareConfig:
    """Load ``configs/hardware/<name>.yaml`` (or a path) into a validated :class:`HardwareConfig`."""
    path = _resolve("hardware", name_or_path)
    hw = _build(HardwareConfig, path, read_yaml(path), {})
    for f in dataclasses.fields(HardwareConfig):
        if f.name not in ("name", "sm_major"):
            require(path, getattr(hw, f.name) > 0, f.name, "a value > 0", getattr(hw, f.name))
    require(path, hw.sm_major == 0 or MIN_SM_MAJOR <= hw.sm_major <= MAX_SM_MAJOR, "sm_major",
            f"0 (no CUDA device) or a CUDA compute capability major in {MIN_SM_MAJOR}..{MAX_SM_MAJOR} "
            "(9: Hopper H100/H200/H800/H20, 10: Blackwell B200/B300)", hw.sm_major)
    return hw


def available(kind: str) -> list[str]:
    """Names of the shipped configs of ``kind`` ('model' or 'hardware')."""
    return sorted(p.stem for p in (configs_root() / _FOLDERS[kind]).glob("*.yaml"))
