"""SGLang plug-in: our LayerSplit pool, HiCache load order and monitor in a real SGLang prefill worker.

Install ``layersplit`` next to SGLang; SGLang runs the entry point :func:`register` (group
``sglang.srt.plugins``) in every process. Enabled by ``LAYERSPLIT_SGLANG_PLUGIN=1`` or the server
flag ``--layersplit`` (which the plug-in adds to SGLang's parser; SGLang loads plug-ins before it
parses its arguments), it registers through SGLang's ``HookRegistry``:

* class REPLACE of ``LayerSplitDSATokenToKVPool`` (the pool SGLang builds for DSA models on PD prefill
  workers under prefill-CP with ``--enable-dsa-cache-layer-split``) by :mod:`.pool`'s subclass;
* an AFTER hook on the DSA backend's ``init_forward_metadata`` that gives the pool the batch's pages
  once upstream chose the batch's kernel (:mod:`.batch`), with each prefix page shared by requests of
  the batch once (:mod:`.sharing`: an AFTER hook on ``ScheduleBatch.prepare_for_extend`` and an AROUND
  hook on ``PrefillAdder.add_one_req`` that keeps a batch's pages within a staging slot);
* the start-up plan and budget (:mod:`.startup`, :mod:`.budget`): hooks on SGLang's pool sizing charge
  every byte the plug-in allocates to the KV budget, and refuse configurations it cannot serve;
* class REPLACE of ``LayerDoneCounter`` and ``L2TransferEngine`` by :mod:`.hicache`'s subclasses
  (indexer keys loaded first, with their own ready event), and an AROUND hook on
  ``IndexKeyCache.get_local_buffer`` so the indexer waits only for its keys;
* with ``LAYERSPLIT_SGLANG_SPEC_MONITOR=1`` or ``--layersplit-spec-monitor`` (also without the rest), the
  speculative-decoding monitor: an AFTER hook on the scheduler's per-verify-step method of ``Req``
  (:mod:`.spec.step`), or, on releases without one, on the tokenizer manager's completion-time speculative
  metrics (:mod:`.spec.completion`).

Disabled, it changes nothing. :func:`unregister` removes every hook and restores the upstream code.
"""

from __future__ import annotations

import importlib
import logging
import sys

log = logging.getLogger(__name__)

_state: dict = {}
FLAG = "--layersplit"


def enabled(argv: list[str] | None = None) -> bool:
    """On by ``LAYERSPLIT_SGLANG_PLUGIN=1`` or ``--layersplit`` on the command line; the flag also
    sets the variable, so the worker processes SGLang starts inherit the choice."""
    import os

    from lsconfig import envs

    if FLAG in (sys.argv if argv is None else argv):
        os.environ["LAYERSPLIT_SGLANG_PLUGIN"] = "1"
    return envs.sglang_plugin_enabled()


def register() -> bool:
    """Entry point (zero arguments). Returns whether hooks were registered."""
    _add_server_flag()
    from layersplit.sglang_plugin.spec import step as spec_step

    plugin_on, monitor_on = enabled(), spec_step.enabled()  # the monitor also runs alone (decode workers)
    if not (plugin_on or monitor_on):
        return False
    from layersplit.sglang_plugin import batch, compat, hicache
    from layersplit.sglang_plugin.pool import make_pool_class

    registry, hook_type = compat.resolve("hook_registry"), compat.resolve("hook_type")
    hooks = []  # (target, hook, type, original or None)

    def replace_class(concept: str, make) -> None:
        original = compat.resolve(concept)
        hooks.append((compat.resolve_path(concept), make(original), hook_type.REPLACE, original))

    if plugin_on:
        replace_class("layer_split_pool", make_pool_class)
        replace_class("layer_done_counter", hicache.make_counter_class)
        replace_class("l2_transfer_engine", hicache.make_engine_class)
        hooks.append((f"{compat.resolve_path('dsa_backend')}.{batch.TARGET_METHOD}",
                      batch.after_init_forward_metadata, hook_type.AFTER, None))
        hooks.append((f"{compat.resolve_path('index_key_cache')}.{hicache.INDEX_READ_TARGET}",
                      hicache.around_get_local_buffer, hook_type.AROUND, None))
        hooks += _landing_hooks(compat, hook_type)
    if monitor_on:  # per verify step where the release allows it, else at completion (spec_step.monitor_hooks)
        monitor_hooks, _state["monitor"] = spec_step.monitor_hooks(hook_type)
        hooks += monitor_hooks
    for target, hook, kind, _ in hooks:
        registry.register(target, hook, kind)
        log.info("layersplit: %s hook on %s", kind.value, target)
    _state["hooks"] = hooks
    return True


def _landing_hooks(compat, hook_type) -> list:
    """CUDA-graph path and batch-sized landing (:mod:`.batch`, :mod:`.landing`), the budget
    (:mod:`.budget`) and shared-prefix pages (:mod:`.sharing`): hooks on the DSA backend's graph
    metadata and per-layer reads, SGLang's pool sizing, batch preparation and admission."""
    from layersplit.sglang_plugin import batch, budget, landing, sharing

    backend = compat.resolve_path("dsa_backend")
    hooks = [(f"{backend}.{batch.GRAPH_TARGET_METHOD}", batch.before_out_graph_metadata, hook_type.BEFORE, None),
             (f"{backend}.{landing.INDEXER_TARGET}", landing.around_get_indexer_metadata, hook_type.AROUND, None),
             (budget.EFFECTIVE_LAYERS_TARGET, budget.around_effective_num_layers, hook_type.AROUND, None),
             (budget.CONFIGURATOR_TARGET, budget.after_configurator_init, hook_type.AFTER, None),
             (sharing.PREPARE_TARGET, sharing.after_prepare_for_extend, hook_type.AFTER, None),
             (sharing.ADMISSION_TARGET, sharing.around_add_one_req, hook_type.AROUND, None)]
    return hooks + [(f"{backend}.{name}", landing.around_forward, hook_type.AROUND, None)
                    for name in landing.FORWARD_TARGETS]


def _add_server_flag() -> None:
    """Add ``--layersplit`` to SGLang's server arguments (a no-op flag for SGLang: the plug-in reads
    it from the command line, because SGLang runs plug-ins before it parses its arguments)."""
    try:
        server_args = importlib.import_module("sglang.srt.server_args")
    except ImportError:
        return
    from layersplit.sglang_plugin.spec import step as spec_step

    cls = getattr(server_args, "ServerArgs", None)
    add = getattr(cls, "add_cli_args", None)
    if add is None or getattr(add, "_layersplit", False):
        return
    original = add

    def add_cli_args(parser):
        original(parser)
        if FLAG not in parser._option_string_actions:
            parser.add_argument(FLAG, action="store_true", dest="layersplit_plugin",
                                help="layersplit plug-in: row-only layer-split broadcasts with double-buffered "
                                     "batch-sized staging, and indexer-first HiCache loads (same as "
                                     "LAYERSPLIT_SGLANG_PLUGIN=1)")
        spec_step.add_server_flag(parser)

    add_cli_args._layersplit = True
    add_cli_args.__wrapped__ = original
    cls.add_cli_args = staticmethod(add_cli_args)
    _state["server_args"] = (cls, original)


def unregister() -> None:
    """Remove our hooks and put the upstream classes and methods back where the registry patched them."""
    from layersplit.sglang_plugin import compat

    if "server_args" in _state:
        cls, original = _state.pop("server_args")
        cls.add_cli_args = staticmethod(original)
    if "hooks" not in _state:
        _state.clear()
        return
    registry = compat.resolve("hook_registry")
    for target, hook, _, original in _state["hooks"]:
        kept = [h for h in registry._hooks.get(target, []) if h[1] is not hook and h[1] != hook]  # bound: ==
        if kept:
            registry._hooks[target] = kept
        else:
            registry._hooks.pop(target, None)
        was_patched = target in registry._patched
        registry._patched.discard(target)
        if original is not None:  # class REPLACE: every module holding the replacement gets the original
            for mod in list(sys.modules.values()):
                for name, value in list(getattr(mod, "__dict__", {}).items()):
                    if value is hook:
                        setattr(mod, name, original)
        elif was_patched:  # method hook: the registry wrapped it in place
            module, cls_name, attr = target.rsplit(".", 2)
            cls = getattr(importlib.import_module(module), cls_name)
            wrapped = cls.__dict__[attr]
            setattr(cls, attr, getattr(wrapped, "__wrapped__", wrapped))
    _state.clear()


def spec_monitor():
    """The registered spec monitor (:class:`.spec.step.SpecStepMonitor`, or the completion-time
    :class:`.spec.completion.MetaInfoMonitor`) with its counters, or None."""
    return _state.get("monitor")
