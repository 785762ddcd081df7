"""The project's environment variables, typed, in one place (prefix ``LAYERSPLIT_``)."""

from __future__ import annotations

import os
from pathlib import Path

KERNEL_BACKENDS = ("auto", "vendor", "triton", "torch")


def kernel_backend() -> str:
    """``LAYERSPLIT_KERNEL_BACKEND``: auto (default) | vendor | triton | torch."""
    value = os.environ.get("LAYERSPLIT_KERNEL_BACKEND", "auto").strip().lower()
    if value not in KERNEL_BACKENDS:
        raise ValueError(f"LAYERSPLIT_KERNEL_BACKEND: expected one of {KERNEL_BACKENDS}, got {value!r}")
    return value


def config_dir() -> Path | None:
    """``LAYERSPLIT_CONFIG_DIR``: a folder with ``models/``, ``hardware/`` and ``sweeps/`` YAML (default:
    the shipped configs, :func:`lsconfig.paths.shipped_configs`). Set, it must name an existing folder."""
    value = os.environ.get("LAYERSPLIT_CONFIG_DIR")
    if not value:
        return None
    path = Path(value)
    if not path.is_dir():
        got = "a file" if path.exists() else "no such folder"
        raise ValueError(f"LAYERSPLIT_CONFIG_DIR: expected an existing folder of configs, got {value!r} ({got})")
    return path


def hf_hub_cache() -> Path:
    """The local Hugging Face hub cache (Hugging Face's own variables, read here so they are in one
    place): ``HF_HUB_CACHE``, else ``HF_HOME/hub``, else ``XDG_CACHE_HOME/huggingface/hub``, else
    ``~/.cache/huggingface/hub``. Only read from; nothing is downloaded."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser()
    return cache / "huggingface" / "hub"


def triton_interpret() -> bool:
    """``TRITON_INTERPRET=1`` runs Triton kernels on the CPU (Triton's own variable)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def sglang_plugin_enabled() -> bool:
    """``LAYERSPLIT_SGLANG_PLUGIN=1`` turns the SGLang plug-in on (off by default: it then changes nothing)."""
    return os.environ.get("LAYERSPLIT_SGLANG_PLUGIN", "0").strip().lower() in ("1", "true", "yes", "on")


def sglang_scratch_tokens() -> int:
    """``LAYERSPLIT_SGLANG_SCRATCH_TOKENS``: the minimum rows of each of the plug-in's two KV staging
    slots (default 131072, a 128k-token batch). Each slot also holds at least one whole context, and is
    allocated once at start-up inside SGLang's KV budget; a batch whose pages do not fit waits for the
    next one (admission), it never grows the slots."""
    raw = os.environ.get("LAYERSPLIT_SGLANG_SCRATCH_TOKENS", "131072").strip()
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value <= 0:
        raise ValueError(f"LAYERSPLIT_SGLANG_SCRATCH_TOKENS: expected a positive integer, got {raw!r}")
    return value


SGLANG_LANDINGS = ("batch", "pool")


def sglang_landing() -> str:
    """``LAYERSPLIT_SGLANG_LANDING``: where the plug-in pool's non-owned layers are read: ``batch``
    (default; the batch-sized staging slots, through page tables remapped per forward) or ``pool``
    (upstream's pool-sized landing buffer, which costs one layer of KV capacity)."""
    value = os.environ.get("LAYERSPLIT_SGLANG_LANDING", "batch").strip().lower()
    if value not in SGLANG_LANDINGS:
        raise ValueError(f"LAYERSPLIT_SGLANG_LANDING: expected one of {SGLANG_LANDINGS}, got {value!r}")
    return value


SGLANG_UNSAFE_SKIPS = ("index_wait", "slot_wait", "load_wait", "index_fallback")


def sglang_unsafe_skip() -> frozenset[str]:
    """``LAYERSPLIT_SGLANG_UNSAFE_SKIP``: comma list of waits the plug-in leaves out, **for stress tests
    only** (``index_wait``: the indexer reads HiCache-loaded index keys without waiting for them;
    ``slot_wait``: the plug-in pool uses a staging slot without waiting for its broadcast;
    ``load_wait``: the plug-in pool broadcasts a layer without waiting for its HiCache load;
    ``index_fallback``: when upstream's load loop runs, the indexer-ready event is left unrecorded)."""
    raw = os.environ.get("LAYERSPLIT_SGLANG_UNSAFE_SKIP", "")
    values = frozenset(v.strip().lower() for v in raw.split(",") if v.strip())
    bad = sorted(values - set(SGLANG_UNSAFE_SKIPS))
    if bad:
        raise ValueError(f"LAYERSPLIT_SGLANG_UNSAFE_SKIP: expected a subset of {SGLANG_UNSAFE_SKIPS}, got {bad}")
    return values


def sglang_spec_monitor_enabled() -> bool:
    """``LAYERSPLIT_SGLANG_SPEC_MONITOR=1`` adds the speculative-decoding monitor hook to the plug-in."""
    return os.environ.get("LAYERSPLIT_SGLANG_SPEC_MONITOR", "0").strip().lower() in ("1", "true", "yes", "on")


def sglang_spec_trace_path() -> Path | None:
    """``LAYERSPLIT_SGLANG_SPEC_TRACE``: a JSONL file the per-step spec monitor appends one line per verify
    step to (``layersplit monitor replay`` reads it); unset (default): no export."""
    value = os.environ.get("LAYERSPLIT_SGLANG_SPEC_TRACE", "").strip()
    return Path(value) if value else None


def sanitize() -> bool:
    """``LAYERSPLIT_SANITIZE=1`` runs the commands and rank processes under the stream-ordering
    sanitizer (:mod:`hicache.sanitizer`); their JSON then carries ``sanitizer_hazards``."""
    return os.environ.get("LAYERSPLIT_SANITIZE", "0").strip().lower() in ("1", "true", "yes", "on")


CP_BACKENDS = ("auto", "nccl", "gloo")


def cp_backend() -> str:
    """``LAYERSPLIT_CP_BACKEND``: auto (default: NCCL where CUDA has a GPU per rank, else gloo) | nccl |
    gloo. ``gloo`` on a CUDA machine runs several CP ranks on one GPU (NCCL refuses two ranks per
    device), with CUDA tensors; its collectives block the issuing host thread, so timings there are
    host-serialized (``layersplit.engine.launcher.cp_backend`` resolves ``auto``)."""
    value = os.environ.get("LAYERSPLIT_CP_BACKEND", "auto").strip().lower()
    if value not in CP_BACKENDS:
        raise ValueError(f"LAYERSPLIT_CP_BACKEND: expected one of {CP_BACKENDS}, got {value!r}")
    return value
