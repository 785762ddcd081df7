"""Version seam: where each upstream name lives in the sglang releases we know.

Older releases say "nsa" (native sparse attention) where newer ones say "dsa". Each concept maps to
candidate ``module:attribute`` paths, newest first; :func:`resolve` returns the first that imports.
Tested against sglang 0.5.23 (the release CI pins, with torch 2.14.1); the "nsa" spellings are the
names of the 0.5.x releases before the rename and are unverified here.
"""

from __future__ import annotations

import importlib

TESTED_RELEASES = ("0.5.23",)

NAMES: dict[str, tuple[str, ...]] = {
    "dsa_pool": ("sglang.srt.mem_cache.memory_pool:DSATokenToKVPool",
                 "sglang.srt.mem_cache.memory_pool:NSATokenToKVPool"),
    "layer_split_pool": ("sglang.srt.mem_cache.dsa_cache_layer_split:LayerSplitDSATokenToKVPool",
                         "sglang.srt.mem_cache.nsa_cache_layer_split:LayerSplitNSATokenToKVPool"),
    "layer_split_index_cache": ("sglang.srt.mem_cache.dsa_cache_layer_split:LayerSplitIndexKeyCache",
                                "sglang.srt.mem_cache.nsa_cache_layer_split:LayerSplitIndexKeyCache"),
    "index_key_cache": ("sglang.srt.mem_cache.index_key_cache:IndexKeyCache",),
    "dsa_backend": ("sglang.srt.layers.attention.dsa_backend:DeepseekSparseAttnBackend",
                    "sglang.srt.layers.attention.nsa_backend:NativeSparseAttnBackend"),
    "dsa_indexer_host_pool": ("sglang.srt.mem_cache.pool_host.dsa:DSAIndexerPoolHost",
                              "sglang.srt.mem_cache.pool_host.nsa:NSAIndexerPoolHost"),
    "l2_transfer_engine": ("sglang.srt.mem_cache.l2_transfer:L2TransferEngine",),
    "layer_loading_event": ("sglang.srt.managers.cache_controller:LayerLoadingEvent",),
    "hook_registry": ("sglang.srt.plugins.hook_registry:HookRegistry",),
    "hook_type": ("sglang.srt.plugins.hook_registry:HookType",),
    "layer_done_counter": ("sglang.srt.managers.cache_controller:LayerDoneCounter",),
    "get_parallel": ("sglang.srt.runtime_context:get_parallel",),
    "get_spec": ("sglang.srt.runtime_context:get_spec",),
    "finish_abort": ("sglang.srt.managers.schedule_batch:FINISH_ABORT",),
}


# The Req method SGLang calls once per request per verify step with that step's accepted drafts, after adding
# the step to the request's counters (0.5.23: ``_resolve_spec_v2_tokens``), newest first. The older spelling is
# unverified here. A release with none gets the completion-time monitor (``monitor.py``) instead.
SPEC_STEP_METHODS = ("sglang.srt.managers.schedule_batch:Req.update_spec_correct_drafts_histogram",
                     "sglang.srt.managers.schedule_batch:Req.update_spec_acceptance_histogram")


def spec_step_target() -> str | None:
    """The HookRegistry path of the per-step speculative method in the installed release, or None."""
    for candidate in SPEC_STEP_METHODS:
        module, attr = candidate.split(":")
        cls_name, method = attr.split(".")
        try:
            if callable(getattr(getattr(importlib.import_module(module), cls_name, None), method, None)):
                return f"{module}.{attr}"
        except ImportError:
            continue
    return None


def resolve_path(concept: str) -> str:
    """The ``module.attr`` path of ``concept`` in the installed release (for HookRegistry targets)."""
    for candidate in NAMES[concept]:
        module, attr = candidate.split(":")
        try:
            if hasattr(importlib.import_module(module), attr):
                return f"{module}.{attr}"
        except ImportError:
            continue
    raise ImportError(f"sglang: expected one of {NAMES[concept]} for {concept!r}, found none "
                      f"(tested releases: {TESTED_RELEASES})")


def resolve(concept: str):
    module, _, attr = resolve_path(concept).rpartition(".")
    return getattr(importlib.import_module(module), attr)


def sglang_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("sglang")
    except Exception:  # not installed
        return None
