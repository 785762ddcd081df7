"""LayerSplit context-parallel prefill for DeepSeek-Sparse-Attention models (GLM-5, GLM-5.2,
DeepSeek-V3.2), and the SGLang plug-in.

The public API, in a few lines::

    import layersplit

    plan = layersplit.plan_capacity("glm-5", "h200", cp=8)      # KV capacity of every layout (a dict)
    report = layersplit.prefill("tiny", cp=2, context_len=512)  # CP engine vs single-process reference
    points = layersplit.sweep("cpu")                            # the 40k-120k sweep (measured, scaled)

Also: :func:`load_model`, :func:`load_hardware`, :func:`load_sweep` (YAML configs into dataclasses),
:func:`synthetic_requests` (requests from plain arguments) and :class:`PrefillReport`.

Packages (each ``__init__`` says what it holds): :mod:`layersplit.engine` (the CP prefill engine),
:mod:`layersplit.plan` (configs, capacity), :mod:`layersplit.serving` (workload, serving loop, cost
model, sweep), :mod:`layersplit.sglang_plugin`, :mod:`layersplit.gpu_check`, :mod:`layersplit.cli`.
Names are imported on first use, so ``import layersplit`` stays light (no torch until needed).
"""

from __future__ import annotations

from importlib import import_module
from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("layersplit")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"

_EXPORTS = {
    "plan_capacity": "layersplit.api",
    "prefill": "layersplit.api",
    "sweep": "layersplit.api",
    "load_model": "layersplit.plan.config",
    "load_hardware": "layersplit.plan.config",
    "load_sweep": "layersplit.serving.sweep_config",
    "synthetic_requests": "layersplit.engine.requests",
    "PrefillReport": "layersplit.engine.prefill",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'layersplit' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
