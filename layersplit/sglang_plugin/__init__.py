"""SGLang plug-in: our LayerSplit pool inside a real SGLang prefill worker, without a fork.

Install ``layersplit`` next to SGLang; SGLang runs the entry point :func:`register` (group
``sglang.srt.plugins``) in every process. With ``LAYERSPLIT_SGLANG_PLUGIN=1`` it registers a class
REPLACE hook on SGLang's ``LayerSplitDSATokenToKVPool``, which SGLang builds for DSA models on PD
prefill workers under prefill-CP with ``--enable-dsa-cache-layer-split``. Without the variable it
changes nothing. :func:`unregister` removes the hook and restores the upstream class.
"""

from __future__ import annotations

import logging
import sys

log = logging.getLogger(__name__)

_state: dict = {}


def register() -> bool:
    """Entry point (zero arguments). Returns whether a hook was registered."""
    from dsa_kernels import envs

    if not envs.sglang_plugin_enabled():
        return False
    from layersplit.sglang_plugin import compat
    from layersplit.sglang_plugin.pool import make_pool_class

    registry, hook_type = compat.resolve("hook_registry"), compat.resolve("hook_type")
    target = compat.resolve_path("layer_split_pool")
    original = compat.resolve("layer_split_pool")
    replacement = make_pool_class(original)
    registry.register(target, replacement, hook_type.REPLACE)
    _state.update(target=target, original=original, replacement=replacement)
    log.info("layersplit: %s -> %s", target, replacement.__qualname__)
    return True


def unregister() -> None:
    """Remove our hook and put the upstream class back where the registry patched it."""
    if not _state:
        return
    import importlib

    from layersplit.sglang_plugin import compat

    registry = compat.resolve("hook_registry")
    target, original, replacement = _state["target"], _state["original"], _state["replacement"]
    hooks = [h for h in registry._hooks.get(target, []) if h[1] is not replacement]
    if hooks:
        registry._hooks[target] = hooks
    else:
        registry._hooks.pop(target, None)
    registry._patched.discard(target)
    module, _, attr = target.rpartition(".")
    importlib.import_module(module)
    for mod in list(sys.modules.values()):  # the registry also patched modules that imported the name
        for name, value in list(getattr(mod, "__dict__", {}).items()):
            if value is replacement:
                setattr(mod, name, original)
    _state.clear()
