"""The project's environment variables, typed, in one place (prefix ``LAYERSPLIT_``).

Each variable has one strict parser here: a value it does not know is a ``ValueError`` naming the
variable, never a silent default. :func:`check_all` runs every parser once (the command line calls it in
the parent process, before anything is spawned or computed), and refuses a ``LAYERSPLIT_*`` name that
is not one of :data:`VARIABLES` (a typo would otherwise be ignored).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")


def _flag(name: str) -> bool:
    """A boolean variable: 1/true/yes/on, or 0/false/no/off/empty/unset (any case); anything else is refused."""
    raw = os.environ.get(name, "")
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{name}: expected 1/true/yes/on or 0/false/no/off, got {raw!r}")

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


# Triton's own spellings of "on" (triton 3.x: ``knobs.env_bool`` -> libtriton ``getenv_bool``, which lowercases
# the value and takes exactly these; every other value, spaces included, reads as off)
TRITON_TRUE = ("1", "true", "on", "yes", "y")


def triton_interpret() -> bool:
    """``TRITON_INTERPRET`` (Triton's own variable) on: Triton runs its kernels on the CPU. Read as Triton
    reads it, so this project and Triton never disagree on whether the interpreter is on."""
    return os.environ.get("TRITON_INTERPRET", "").lower() in TRITON_TRUE


def sglang_plugin_enabled() -> bool:
    """``LAYERSPLIT_SGLANG_PLUGIN=1`` turns the SGLang plug-in on (off by default: it then changes nothing)."""
    return _flag("LAYERSPLIT_SGLANG_PLUGIN")


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
    return _flag("LAYERSPLIT_SGLANG_SPEC_MONITOR")


def sglang_spec_trace_path() -> Path | None:
    """``LAYERSPLIT_SGLANG_SPEC_TRACE``: a JSONL file the per-step spec monitor appends one line per verify
    step to (``layersplit monitor replay`` reads it); unset (default): no export."""
    value = os.environ.get("LAYERSPLIT_SGLANG_SPEC_TRACE", "").strip()
    return Path(value) if value else None


def sanitize() -> bool:
    """``LAYERSPLIT_SANITIZE=1`` runs the commands and rank processes under the stream-ordering
    sanitizer (:mod:`hicache.sanitizer`); their JSON then carries ``sanitizer_hazards``."""
    return _flag("LAYERSPLIT_SANITIZE")


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


VARIABLES: dict[str, Callable[[], object]] = {
    "LAYERSPLIT_KERNEL_BACKEND": kernel_backend, "LAYERSPLIT_CP_BACKEND": cp_backend,
    "LAYERSPLIT_CONFIG_DIR": config_dir, "LAYERSPLIT_SANITIZE": sanitize,
    "LAYERSPLIT_SGLANG_PLUGIN": sglang_plugin_enabled, "LAYERSPLIT_SGLANG_SCRATCH_TOKENS": sglang_scratch_tokens,
    "LAYERSPLIT_SGLANG_LANDING": sglang_landing, "LAYERSPLIT_SGLANG_UNSAFE_SKIP": sglang_unsafe_skip,
    "LAYERSPLIT_SGLANG_SPEC_MONITOR": sglang_spec_monitor_enabled,
    "LAYERSPLIT_SGLANG_SPEC_TRACE": sglang_spec_trace_path,
}


def check_all() -> None:
    """Parse every ``LAYERSPLIT_*`` variable once; the first bad one (or unknown name) is a ``ValueError``
    naming it. Cheap (no imports): the command line runs it before any work."""
    unknown = sorted(k for k in os.environ if k.startswith("LAYERSPLIT_") and k not in VARIABLES)
    if unknown:
        raise ValueError(f"{unknown[0]}: expected one of the known variables ({', '.join(VARIABLES)}), "
                         f"got an unknown name (a typo?)")
    for parse in VARIABLES.values():
        parse()


def check_machine(has_cuda: bool) -> None:
    """The variables that a machine may not honour, for a command that runs kernels or CP ranks here:
    NCCL needs CUDA, and Triton on a CPU needs its interpreter (``TRITON_INTERPRET=1`` at launch)."""
    if cp_backend() == "nccl" and not has_cuda:
        raise ValueError("LAYERSPLIT_CP_BACKEND: expected auto or gloo on a machine without CUDA, got 'nccl' "
                         "(NCCL needs a GPU per rank); unset it")
    if kernel_backend() == "triton" and not has_cuda and not triton_interpret():
        raise ValueError("LAYERSPLIT_KERNEL_BACKEND: 'triton' on a machine without CUDA needs Triton's interpreter; "
                         "set TRITON_INTERPRET=1 too, or choose torch")
