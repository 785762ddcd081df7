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
    if envs.sglang_spec_monitor_enabled():
        from layersplit.sglang_plugin.monitor import TARGET, MetaInfoMonitor

        monitor = MetaInfoMonitor()
        registry.register(TARGET, monitor.after_spec_metrics, hook_type.AFTER)
        _state.update(monitor=monitor, monitor_hook=monitor.after_spec_metrics)
    return True


def unregister() -> None:
    """Remove our hook and put the upstream class back where the registry patched it."""
    if not _state:
        return
    import importlib

    from layersplit.sglang_plugin import compat

    registry = compat.resolve("hook_registry")
    if "monitor_hook" in _state:
        _unhook_method(registry, _state["monitor_hook"])
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


def _unhook_method(registry, hook) -> None:
    """Drop our AFTER hook and put the method the registry wrapped back."""
    import importlib

    from layersplit.sglang_plugin.monitor import TARGET

    registry._hooks[TARGET] = [h for h in registry._hooks.get(TARGET, []) if h[1] != hook]  # bound methods: ==, not is
    if not registry._hooks[TARGET]:
        registry._hooks.pop(TARGET)
    if TARGET in registry._patched:
        registry._patched.discard(TARGET)
        module, cls_name, attr = TARGET.rsplit(".", 2)
        cls = getattr(importlib.import_module(module), cls_name)
        wrapped = cls.__dict__[attr]
        setattr(cls, attr, getattr(wrapped, "__wrapped__", wrapped))


def spec_monitor():
    """The registered :class:`layersplit.sglang_plugin.monitor.MetaInfoMonitor` (its Prometheus counters), or None."""
    return _state.get("monitor")
