"""Sweep configs (``configs/sweeps/*.yaml``) as a frozen dataclass, validated like the model configs.

``kv_dtype`` is one dtype, or (model engine) a list of them, ``[fp8, bf16]``: the modelled sweep then
runs every layout at each, and its tables compare fp8 rows with fp8 rows and bf16 with bf16. The list
is kept as ``kv_dtypes``; ``kv_dtype`` is its first entry (the measured engine's and the plot's).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from lsconfig.config_io import ConfigError, read_yaml
from layersplit.plan.choices import ENGINE_KV_DTYPES, STRATEGIES
from layersplit.plan.capacity import MODEL_OWNERSHIPS
from layersplit.plan.config import _build, check_name_or_path, configs_root, load_hardware, load_model

ENGINES = ("real", "model")


@dataclass(frozen=True)
class SweepConfig:
    name: str
    engine: str
    model: str
    hardware: str
    cp: int
    kv_dtype: str
    lengths: tuple[int, ...]
    new_fraction: float
    sessions: int
    requests: int
    seed: int
    scale: float
    max_batch_tokens: int
    max_batch_context: int
    max_batch_requests: int
    device_kv_bytes_per_rank: float  # 0: derive from the capacity plan
    host_bytes_per_rank: float
    repeats: int  # measured engine: runs per point (median and spread reported); the model is deterministic
    ownership: str  # which rank owns which layers in `layersplit` mode (contiguous | round-robin)
    context_len: int  # the served --context-length (sizes KV sharding's scratch as shipped: 8 contexts)
    kv_dtypes: tuple[str, ...]  # every KV dtype the model sweep runs (from the YAML's kv_dtype); [0] == kv_dtype

    def __post_init__(self) -> None:
        assert self.kv_dtypes and self.kv_dtypes[0] == self.kv_dtype, (
            f"kv_dtypes {self.kv_dtypes} must start with kv_dtype {self.kv_dtype!r}: replace both together")

    def scaled(self, tokens: int) -> int:
        return max(1, round(tokens * self.scale))


def _lengths(path: Path, value) -> tuple[int, ...]:
    if not isinstance(value, list) or not value or not all(isinstance(v, int) and v > 1 for v in value):
        raise ConfigError(f"{path}: field 'lengths': expected a non-empty list of integers > 1, got {value!r}")
    twice = sorted({v for v in value if value.count(v) > 1})
    if twice:  # each length is one point per mode: a repeat would be a second row of the same point
        raise ConfigError(f"{path}: field 'lengths': expected distinct lengths, got {value!r} ({twice[0]} more "
                          "than once)")
    return tuple(value)


def _kv_dtypes(path: Path, data):
    """The YAML with ``kv_dtype`` split into the first dtype and ``kv_dtypes`` (all of them)."""
    if not isinstance(data, dict) or "kv_dtype" not in data:
        return data  # the build reports what is missing
    if "kv_dtypes" in data:
        raise ConfigError(f"{path}: unknown field 'kv_dtypes' (give every dtype as a list in 'kv_dtype')")
    value = data["kv_dtype"]
    dtypes = value if isinstance(value, list) else [value]
    if not dtypes or not all(isinstance(d, str) for d in dtypes) or len(set(dtypes)) != len(dtypes):
        raise ConfigError(f"{path}: field 'kv_dtype': expected a dtype or a list of distinct dtypes, got {value!r}")
    return {**data, "kv_dtype": dtypes[0], "kv_dtypes": tuple(dtypes)}


def _as_tuple(path: Path, value) -> tuple:
    return tuple(value)


def load_sweep(name_or_path: str | Path) -> SweepConfig:
    """``configs/sweeps/<name>.yaml`` or a path."""
    check_name_or_path("sweep", name_or_path)
    path = Path(name_or_path)
    if not path.suffix:
        path = configs_root() / "sweeps" / f"{name_or_path}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in (configs_root() / "sweeps").glob("*.yaml"))
        raise ConfigError(f"sweep '{name_or_path}': expected one of {known} or a YAML path, got no such file")
    cfg = _build(SweepConfig, path, _kv_dtypes(path, read_yaml(path)), {"lengths": _lengths, "kv_dtypes": _as_tuple})
    if cfg.engine == "real" and len(cfg.kv_dtypes) > 1:
        raise ConfigError(f"{path}: field 'kv_dtype': expected one dtype for the measured engine, got "
                          f"{list(cfg.kv_dtypes)}")
    bad = [d for d in cfg.kv_dtypes if d not in (("bf16", "fp8") if cfg.engine == "model" else ENGINE_KV_DTYPES)]
    checks = [("engine", cfg.engine in ENGINES, f"one of {ENGINES}"), ("cp", cfg.cp >= 1, "an integer >= 1"),
              ("new_fraction", 0 < cfg.new_fraction <= 1, "a number in (0, 1]"),
              ("scale", 0 < cfg.scale <= 1, "a number in (0, 1]"), ("sessions", cfg.sessions >= 1, ">= 1"),
              ("requests", cfg.requests >= 1, ">= 1"), ("repeats", cfg.repeats >= 1, ">= 1"),
              ("kv_dtype", not bad, "bf16 or fp8, or a list of them" if cfg.engine == "model" else
               f"one of {ENGINE_KV_DTYPES} for the measured engine"),
              ("max_batch_tokens", cfg.max_batch_tokens >= 1, "an integer >= 1"),
              ("max_batch_context", cfg.max_batch_context >= 1, "an integer >= 1"),
              ("max_batch_requests", cfg.max_batch_requests >= 1, "an integer >= 1 (requests per batch)"),
              ("device_kv_bytes_per_rank", cfg.device_kv_bytes_per_rank >= 0, ">= 0 (0: from the capacity plan)"),
              ("host_bytes_per_rank", cfg.host_bytes_per_rank >= 0, ">= 0"), ("seed", 0 <= cfg.seed < 2**63, "in [0, 2**63)"),
              ("ownership", cfg.ownership in (MODEL_OWNERSHIPS if cfg.engine == "model" else STRATEGIES),
               f"one of {MODEL_OWNERSHIPS if cfg.engine == 'model' else STRATEGIES} (the CP engine: {STRATEGIES})"),
              ("context_len", cfg.context_len >= max(cfg.lengths), f">= the longest length ({max(cfg.lengths)})")]
    for field_name, ok, expected in checks:
        if not ok:
            got = list(cfg.kv_dtypes) if field_name == "kv_dtype" and len(cfg.kv_dtypes) > 1 else getattr(cfg, field_name)
            raise ConfigError(f"{path}: field '{field_name}': expected {expected}, got {got!r}")
    # the configs it names exist, and the CP group fits the model, before any rank process starts
    model = _field(path, "model", lambda: load_model(cfg.model))
    _field(path, "hardware", lambda: load_hardware(cfg.hardware))
    if cfg.cp > model.num_layers:
        raise ConfigError(f"{path}: field 'cp': expected <= {model.num_layers} (the layers of {model.name}, so every "
                          f"rank owns one), got {cfg.cp}")
    if cfg.scaled(min(cfg.lengths)) < 2:
        raise ConfigError(f"{path}: field 'scale': {cfg.scale:g} leaves fewer than 2 tokens of the shortest length "
                          f"{min(cfg.lengths)}; expected a larger scale")
    return cfg


def _field(path: Path, name: str, load):
    try:
        return load()
    except ConfigError as exc:
        raise ConfigError(f"{path}: field '{name}': {exc}") from None
