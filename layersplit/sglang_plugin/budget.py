"""The plug-in's bytes inside the KV budget SGLang sizes at start-up.

SGLang's ``DefaultPoolConfigurator`` (DSA models) computes a per-token ``_cell_size`` and a
``_fixed_overhead_bytes`` that :meth:`calculate_pool_sizes` takes off the available memory before
dividing (upstream uses it for its KV-sharding scratch). Two hooks:

* AROUND ``get_glm_dsa_layer_split_effective_num_layers`` (the layers ``_compute_cell_size`` charges
  per token under layer split): upstream's ``ceil(L / N) + 1`` counts its pool-sized landing layer;
  ``batch`` landing allocates none, so one layer less;
* AFTER ``DefaultPoolConfigurator.__init__``: the start-up :class:`~.startup.Plan` is made and
  published, both staging slots go into ``_fixed_overhead_bytes`` and the remap table (8 B per
  64-token page) into the cell as 1 B a token (rounded up).

So the pool SGLang builds, plus everything the plug-in allocates beside it, fits the memory SGLang
measured; nothing is allocated later (``--max-total-tokens`` sizes the pool by hand: the staging is
still allocated at start-up and shown by ``layersplit sglang-plan``).
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

REMAP_CELL_BYTES = 1  # 8 B per 64-token page = 1/8 B a token, charged as 1 B


def _layer_split_on(kvc) -> bool:
    from sglang.srt.layers.cp.utils import is_glm_dsa_cache_layer_split_enabled

    try:
        return bool(is_glm_dsa_cache_layer_split_enabled(kvc))
    except Exception:  # a configurator of a model without the attributes layer split reads
        return False


def plan_for(kvc):
    """The start-up plan for SGLang's ``KVCacheConfigurator`` (or model runner) ``kvc``."""
    import torch
    from sglang.srt.configs.model_config import get_dsa_index_head_dim, get_dsa_index_kpool
    from sglang.srt.mem_cache.kv_cache_configurator import calculate_mla_kv_cache_dim

    from lsconfig import envs
    from layersplit.sglang_plugin import startup
    from sglang.srt.runtime_context import get_exec

    args, model = kvc.server_args, kvc.model_config
    kpool = get_dsa_index_kpool(model.hf_config)
    landing, reasons = startup.decide(
        prefill_impl=str(get_exec().kernel.dsa_prefill_backend), hisparse=bool(getattr(args, "enable_hisparse", False)),
        graphs=startup.graphs_enabled(getattr(args, "cuda_graph_config", None)), index_kpool=kpool,
        configured=envs.sglang_landing())
    head = get_dsa_index_head_dim(model.hf_config)
    page = kvc.page_size
    return startup.Plan(
        landing=landing, reasons=reasons, page_size=page,
        slot_pages=startup.slot_pages(envs.sglang_scratch_tokens(), int(model.context_len), page),
        kv_row_bytes=calculate_mla_kv_cache_dim(model_config=model, kv_cache_dtype=kvc.kv_cache_dtype)
        * torch._utils._element_size(kvc.kv_cache_dtype),
        index_page_bytes=page // kpool * (head + head // 128 * 4))


def around_effective_num_layers(original, model_runner, num_layers: int) -> int:
    """AROUND hook on SGLang's ``get_glm_dsa_layer_split_effective_num_layers``."""
    layers = original(model_runner, num_layers)
    if layers == num_layers or not _layer_split_on(model_runner):
        return layers
    plan = plan_for(model_runner)
    return max(1, layers - 1) if plan.landing == "batch" else layers


def after_configurator_init(result, configurator, kvc, *args, **kwargs):
    """AFTER hook on ``DefaultPoolConfigurator.__init__(self, kvc)``: charge the plug-in's bytes."""
    from layersplit.sglang_plugin import startup

    if kvc.is_draft_worker or not _layer_split_on(kvc):
        return None
    plan = plan_for(kvc)
    startup.publish(plan)
    configurator._fixed_overhead_bytes += plan.staging_bytes
    if plan.landing == "batch":
        configurator._cell_size += REMAP_CELL_BYTES
    log.info("layersplit: %s landing; staging 2 x %d pages (%.3f GB) charged to the KV budget%s", plan.landing,
             plan.slot_pages, plan.staging_bytes / 1e9, "".join(f"; {r}" for r in plan.reasons))
    return None


EFFECTIVE_LAYERS_TARGET = "sglang.srt.layers.cp.utils.get_glm_dsa_layer_split_effective_num_layers"
EFFECTIVE_LAYERS_SIGNATURE = "(model_runner: 'ModelRunner', num_layers: int) -> int"
CONFIGURATOR_TARGET = "sglang.srt.model_executor.pool_configurator.DefaultPoolConfigurator.__init__"
CONFIGURATOR_SIGNATURE = "(self, kvc: 'KVCacheConfigurator')"
