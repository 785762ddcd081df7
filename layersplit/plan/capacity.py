"""KV capacity per CP rank: redundant CP (every layer on every rank) vs LayerSplit.

Per-rank KV budget = ``hbm_reported * mem_fraction - weights per rank``:

* ``hbm_reported``: the device's total memory as it reports it (``HardwareConfig.hbm_reported_bytes``);
* ``1 - mem_fraction`` of it stays out of the static pool for activations, CUDA graphs and NCCL
  buffers (SGLang's ``--mem-fraction-static``);
* weights by placement (``weight_placement``): ``ep`` (default) is SGLang's prefill CP, where every CP
  rank holds the attention, indexer, dense MLPs, shared experts, routers and embeddings whole and only
  the routed experts are split over the EP group (``weight_shards``, default the CP size); ``even``
  splits all weights evenly (the optimistic assumption this module used before).

* redundant: a token costs ``sum over all layers`` of (KV + indexer key) bytes on every rank;
* layersplit: a token costs only the rank's owned layers; the rank also reserves two scratch slots
  (double buffer), each holding one non-owned layer's rows for ``max_batch_tokens`` tokens (in
  whole pages: ``ceil(T / 64) + max_requests`` pages, as ``layersplit.engine.cp_pool`` allocates them);
* upstream SGLang layer split (for comparison): owned layers + one pool-sized scratch layer;
* our SGLang plug-in (``layersplit.sglang_plugin.pool``, counted with the functions it allocates
  with, :mod:`layersplit.plan.sizing`): owned layers + two batch-sized staging slots of
  latent rows and indexer-key pages (``ceil(max_batch_tokens / 64) + max_requests`` pages each, the
  worst batch; set ``LAYERSPLIT_SGLANG_SCRATCH_TOKENS`` to 64 x that, else the pool grows its slots
  on such a batch) + an 8-byte remap entry per pool page, with its default ``batch`` landing (the
  DSA backend reads non-owned layers from the slots through remapped page tables); with ``pool``
  landing (``LAYERSPLIT_SGLANG_LANDING=pool``) upstream's pool-sized landing layer on top.
  Assumption: SGLang's pool sizing gives the plug-in the memory it saves (the plug-in's hook on
  ``get_glm_dsa_layer_split_effective_num_layers`` drops upstream's +1 scratch layer; the staging
  is subtracted from the budget here);
* SGLang's page-level KV sharding (:mod:`layersplit.plan.kv_sharding`): 1/N of every layer a token,
  scratch as designed (batch-sized) or as 0.5.23 ships it (fp8 KV, 8 full contexts).

Weights: embedding and LM head at bf16 whatever ``weight_dtype`` (as in the fp8 checkpoints), and
the MTP layer counted (``PlanRequest.mtp``). The modes and their bytes per rank are
:mod:`layersplit.plan.modes`'s (re-exported here).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from layersplit.plan import kv_sharding, query_moving
from layersplit.plan.config import HardwareConfig, ModelConfig
from layersplit.plan.ownership import plan_ownership
# the modes and their bytes per rank live in .modes; re-exported, as callers import them from here
from layersplit.plan.modes import (BROADCAST, FIXED_KV_DTYPE, MODEL_OWNERSHIPS, MODES, NVLINK_EFFICIENCY,  # noqa: F401
                                   ROLE, STRIPED_REMAINDER, ModeBytes, mode_bytes, mode_kv_dtype, modes_at,
                                   scratch_pages_for, sglang_plugin_staging_bytes, sglang_plugin_tokens,
                                   striped_remainder, unavailable_reason)

WEIGHT_BYTES = {"fp8": 1.0, "bf16": 2.0, "none": 0.0}
PLACEMENTS = ("ep", "even")


def embedding_params(model: ModelConfig) -> int:
    """Input embedding + LM head (bf16 in the GLM-5 / DeepSeek-V3.2 fp8 checkpoints)."""
    return 2 * model.vocab_size * model.hidden_size


def mtp_params(model: ModelConfig) -> tuple[int, int]:
    """(replicated, routed-expert) params of the MTP layers: an MLA + indexer + MoE layer each, plus the
    ``eh_proj`` that joins the embedding and the hidden state (2h x h). Assumed, as in DeepSeek-V3: the
    MTP layer shares the main model's embedding and LM head, so they are not counted again."""
    n = model.num_mtp_layers
    routed = model.n_routed_experts * 3 * model.hidden_size * model.moe_intermediate_size
    layer = model.attention_params(0) + model.mlp_params(model.first_k_dense) + 2 * model.hidden_size ** 2
    return n * (layer - routed), n * routed


def weights_per_rank(model: ModelConfig, weight_dtype: str, placement: str, shards: int,
                     mtp: bool = True) -> tuple[float, float]:
    """(replicated, split) weight bytes on one rank: ``ep`` replicates everything but the routed
    experts, which ``shards`` ranks split; ``even`` splits everything. Embedding and LM head stay
    bf16 whatever ``weight_dtype`` is; ``mtp`` counts the MTP layers (loaded for speculative decoding)."""
    per_param = WEIGHT_BYTES[weight_dtype]
    embed = embedding_params(model)
    embed_extra = embed * (WEIGHT_BYTES["bf16"] - per_param) if per_param else 0.0  # bf16, not weight_dtype
    mtp_rep, mtp_routed = mtp_params(model) if mtp else (0, 0)
    if placement == "even":
        return 0.0, ((model.param_count() + mtp_rep + mtp_routed) * per_param + embed_extra) / shards
    replicated = (model.replicated_params() + mtp_rep) * per_param + embed_extra
    return replicated, (model.routed_expert_params() + mtp_routed) * per_param / shards


@dataclass(frozen=True)
class PlanRequest:
    cp: int
    kv_dtype: str = "bf16"
    max_batch_tokens: int = 131072
    max_requests: int = 8
    context_len: int = 131072
    mem_fraction: float = 0.9
    weight_dtype: str = "fp8"
    weight_shards: int | None = None  # None: the CP size
    ownership: str = "contiguous"
    weight_placement: str = "ep"
    mtp: bool = True  # count the MTP layers' weights (the prefill worker loads them for speculative decoding)


def _check(req: PlanRequest) -> None:
    if req.kv_dtype not in ("bf16", "fp8"):
        raise ValueError(f"kv_dtype: expected 'bf16' or 'fp8', got {req.kv_dtype!r}")
    if req.weight_placement not in PLACEMENTS:
        raise ValueError(f"weight_placement: expected one of {PLACEMENTS}, got {req.weight_placement!r}")
    if req.weight_dtype not in WEIGHT_BYTES:
        raise ValueError(f"weight_dtype: expected one of {list(WEIGHT_BYTES)}, got {req.weight_dtype!r}")
    if not 0 < req.mem_fraction <= 1:
        raise ValueError(f"mem_fraction: expected 0 < value <= 1, got {req.mem_fraction}")
    for name in ("max_batch_tokens", "context_len", "max_requests"):
        if getattr(req, name) < 1:
            raise ValueError(f"{name}: expected an integer >= 1, got {getattr(req, name)}")
    if req.weight_shards is not None and req.weight_shards < 1:
        raise ValueError(f"weight_shards: expected an integer >= 1, got {req.weight_shards}")


def _plugin_capacity(model: ModelConfig, req: PlanRequest, budget: float, kv_dtype: str) -> dict:
    """The plug-in pool's tokens per rank at ``kv_dtype`` (batch landing, and pool landing), against
    redundant CP at bf16 and at fp8 in the same budget."""
    redundant = {d: int(budget // sum(model.layer_bytes_per_token(layer, d) for layer in range(model.num_layers)))
                 for d in ("bf16", "fp8")}
    per_layer = [model.layer_bytes_per_token(layer, kv_dtype) for layer in range(model.num_layers)]
    if req.cp == 1:
        tokens = tokens_pool = redundant[kv_dtype]
        staging = 0
    else:
        held = plan_ownership(model.num_layers, req.cp, "contiguous")
        owned = max(sum(per_layer[layer] for layer in held.owned_layers(r)) for r in range(req.cp))
        staging = sglang_plugin_staging_bytes(model, kv_dtype, req.max_batch_tokens, req.max_requests)
        tokens = sglang_plugin_tokens(budget, owned, max(per_layer), staging, "batch")
        tokens_pool = sglang_plugin_tokens(budget, owned, max(per_layer), staging, "pool")
    return {"kv_dtype": kv_dtype, "staging_bytes": staging, "tokens_per_rank": tokens,
            "tokens_per_rank_pool_landing": tokens_pool,
            "tokens_per_rank_redundant_bf16": redundant["bf16"], "tokens_per_rank_redundant_fp8": redundant["fp8"],
            "ratio_vs_redundant_bf16": tokens / redundant["bf16"], "ratio_vs_redundant_fp8": tokens / redundant["fp8"]}


def _best_available_peer(hw: HardwareConfig, kv_dtype: str, tokens: dict[str, int]) -> str:
    """The peer (an SGLang 0.5.23 layout) with the most tokens per rank among those that run on ``hw``
    at ``kv_dtype`` (KV sharding as shipped: fp8 only, SM 10 only)."""
    runs = [m for m in modes_at(tuple(tokens), kv_dtype) if ROLE[m] == "peer" and not unavailable_reason(m, hw)]
    return max(runs, key=tokens.__getitem__)


def capacity_plan(model: ModelConfig, hw: HardwareConfig, req: PlanRequest) -> dict:
    """All capacity numbers as one flat dict (what ``layersplit plan --json`` prints)."""
    _check(req)
    own = plan_ownership(model.num_layers, req.cp, req.ownership)
    per_layer = [model.layer_bytes_per_token(layer, req.kv_dtype) for layer in range(model.num_layers)]
    redundant = mode_bytes(model, req.cp, req.kv_dtype, "redundant", req.max_batch_tokens, req.max_requests)
    split = mode_bytes(model, req.cp, req.kv_dtype, "layersplit", req.max_batch_tokens, req.max_requests, req.ownership)
    shards = req.weight_shards or req.cp
    replicated, expert_parallel = weights_per_rank(model, req.weight_dtype, req.weight_placement, shards, req.mtp)
    weight_bytes = replicated + expert_parallel
    hbm = hw.hbm_reported_bytes
    budget = hbm * req.mem_fraction - weight_bytes
    if budget <= 0:
        raise ValueError(
            f"KV budget: expected > 0 bytes per rank, got {budget:.3e} ({hw.name} {hbm:.3e} B x "
            f"{req.mem_fraction} - weights {weight_bytes:.3e} B); use more --weight-shards or another --hardware"
        )
    redundant_per_token, owned_per_token = redundant.bytes_per_token, split.bytes_per_token
    scratch_bytes = split.scratch_bytes
    upstream_per_token = owned_per_token + max(per_layer)
    tokens_redundant = int(budget // redundant_per_token)
    if scratch_bytes >= budget:  # otherwise the ratio would read 0.000x as if it were an answer
        raise ValueError(f"max_batch_tokens: two scratch slots for {req.max_batch_tokens:,} batch tokens need "
                         f"{scratch_bytes / 2**30:,.2f} GiB, more than the {budget / 2**30:,.2f} GiB KV budget per "
                         f"rank; expected a smaller batch")
    tokens_layersplit = max(0, int((budget - scratch_bytes) // owned_per_token))
    if req.context_len > tokens_layersplit:
        raise ValueError(f"context_len: expected <= {tokens_layersplit:,} tokens (what one LayerSplit rank's pool "
                         f"holds), got {req.context_len:,}")
    tokens_upstream = int(budget // upstream_per_token)
    sharding = {m: mode_bytes(model, req.cp, req.kv_dtype, m, req.max_batch_tokens, req.max_requests,
                              context_len=req.context_len) for m in ("kv-sharding", "kv-sharding-shipped")}
    tokens_sharding = {m: max(0, int((budget - mb.scratch_bytes) // mb.bytes_per_token)) for m, mb in sharding.items()}
    plugin = {dtype: _plugin_capacity(model, req, budget, dtype) for dtype in ("bf16", "fp8")}
    moving = mode_bytes(model, req.cp, req.kv_dtype, "query-moving", req.max_batch_tokens, req.max_requests,
                        req.ownership, chunk_tokens=req.max_batch_tokens)
    tokens_moving = max(0, int((budget - moving.scratch_bytes) // moving.bytes_per_token))
    tokens = {"redundant": tokens_redundant, "redundant-shared-host": tokens_redundant,
              "upstream-layersplit": tokens_upstream, **tokens_sharding}
    best = _best_available_peer(hw, req.kv_dtype, tokens)
    mine = plugin[req.kv_dtype]
    plugin_staging, tokens_plugin = mine["staging_bytes"], mine["tokens_per_rank"]
    rows_bytes = req.context_len * max(per_layer)
    return {
        "model": model.name, "hardware": hw.name, "cp": req.cp, "kv_dtype": req.kv_dtype,
        "ownership": req.ownership, "num_layers": model.num_layers, "max_owned_layers": own.max_owned,
        "kv_bytes_per_token_layer": model.kv_bytes_per_token(req.kv_dtype),
        "index_bytes_per_token_layer": model.index_bytes_per_token,
        "indexer_layers": len(model.indexer_layer_ids),
        "bytes_per_token_redundant": redundant_per_token, "bytes_per_token_layersplit": owned_per_token,
        "param_count": model.param_count(), "weight_dtype": req.weight_dtype, "weight_shards": shards,
        "weight_placement": req.weight_placement,
        "hbm_reported_bytes": hbm, "hbm_datasheet_bytes": hw.hbm_bytes,
        "hbm_reserved_bytes": hbm * (1 - req.mem_fraction),  # activations, CUDA graphs, NCCL buffers
        "weight_bytes_replicated": replicated, "weight_bytes_expert_parallel": expert_parallel,
        "weight_bytes_per_rank": weight_bytes, "mem_fraction": req.mem_fraction,
        "kv_budget_bytes_per_rank": budget, "max_batch_tokens": req.max_batch_tokens,
        "scratch_bytes": scratch_bytes,
        "tokens_per_rank_redundant": tokens_redundant, "tokens_per_rank_layersplit": tokens_layersplit,
        "tokens_per_rank_upstream_layersplit": tokens_upstream,
        "capacity_ratio": tokens_layersplit / tokens_redundant if tokens_redundant else 0.0,
        "capacity_ratio_upstream": tokens_upstream / tokens_redundant if tokens_redundant else 0.0,
        "sglang_plugin_staging_bytes": plugin_staging,
        "tokens_per_rank_sglang_plugin": tokens_plugin,
        "capacity_ratio_sglang_plugin": tokens_plugin / tokens_redundant if tokens_redundant else 0.0,
        "sglang_plugin_capacity_ratio": tokens_plugin / tokens_redundant if tokens_redundant else 0.0,
        "sglang_plugin_landing": "batch",
        "tokens_per_rank_sglang_plugin_pool_landing": mine["tokens_per_rank_pool_landing"],
        "sglang_plugin_capacity_ratio_pool_landing": mine["tokens_per_rank_pool_landing"] / tokens_redundant
        if tokens_redundant else 0.0,
        # the plug-in at both KV dtypes, each against redundant CP at bf16 and at fp8 (same budget)
        "sglang_plugin_by_kv_dtype": plugin,
        "tokens_per_rank_sglang_plugin_fp8": plugin["fp8"]["tokens_per_rank"],
        "sglang_plugin_capacity_ratio_fp8_vs_redundant_bf16": plugin["fp8"]["ratio_vs_redundant_bf16"],
        "sglang_plugin_capacity_ratio_fp8_vs_redundant_fp8": plugin["fp8"]["ratio_vs_redundant_fp8"],
        "capacity_ratio_ideal": redundant_per_token / owned_per_token,
        # SGLang's page-level KV sharding: as designed (batch-sized scratch) and as 0.5.23 ships it (fp8
        # KV, scratch for 8 full contexts of context_len); the shipped one's ratio is against redundant at
        # the requested dtype, so with bf16 asked it includes fp8's 1.6x
        "bytes_per_token_kv_sharding": sharding["kv-sharding"].bytes_per_token,
        "scratch_bytes_kv_sharding": sharding["kv-sharding"].scratch_bytes,
        "tokens_per_rank_kv_sharding": tokens_sharding["kv-sharding"],
        "bytes_per_token_kv_sharding_shipped": sharding["kv-sharding-shipped"].bytes_per_token,
        "scratch_bytes_kv_sharding_shipped": sharding["kv-sharding-shipped"].scratch_bytes,
        "tokens_per_rank_kv_sharding_shipped": tokens_sharding["kv-sharding-shipped"],
        "kv_sharding_shipped_kv_dtype": sharding["kv-sharding-shipped"].kv_dtype,
        "kv_sharding_shipped_requires": list(kv_sharding.SHIPPED_REQUIREMENTS),
        "capacity_ratios": {"redundant": 1.0,
                            "upstream-layersplit": tokens_upstream / tokens_redundant if tokens_redundant else 0.0,
                            "kv-sharding": tokens_sharding["kv-sharding"] / tokens_redundant if tokens_redundant else 0.0,
                            "kv-sharding-shipped": tokens_sharding["kv-sharding-shipped"] / tokens_redundant
                            if tokens_redundant else 0.0,
                            "query-moving": tokens_moving / tokens_redundant if tokens_redundant else 0.0,
                            "sglang-plugin": tokens_plugin / tokens_redundant if tokens_redundant else 0.0,
                            "layersplit": tokens_layersplit / tokens_redundant if tokens_redundant else 0.0},
        # which SGLang 0.5.23 layouts run on this GPU (modes.unavailable_reason) and the largest one that does
        "sm_major": hw.sm_major, "roles": dict(ROLE),
        "unavailable": {m: r for m in MODES if (r := unavailable_reason(m, hw))},
        "best_available_peer": best, "tokens_per_rank_best_available_peer": tokens[best],
        "capacity_ratio_vs_best_available_peer": tokens_layersplit / tokens[best] if tokens[best] else 0.0,
        # the query-moving peer: owned layers, the owner's receive slots; what one batch of max_batch_tokens
        # new tokens moves through a layer's owner (queries in, outputs out), per layer (an indexer layer)
        "tokens_per_rank_query_moving": tokens_moving, "scratch_bytes_query_moving": moving.scratch_bytes,
        "query_moving_bytes_per_layer": query_moving.layer_bytes(model, req.cp, req.max_batch_tokens,
                                                                 model.indexer_layer_ids[-1]),
        "context_len": req.context_len,
        "broadcast_bytes_per_layer": rows_bytes,
        "broadcast_bytes_per_layer_upstream": tokens_upstream * max(per_layer),
        "broadcast_seconds_per_layer_model": rows_bytes / (hw.nvlink_bandwidth * NVLINK_EFFICIENCY),
        "nvlink_efficiency": NVLINK_EFFICIENCY, "weight_mtp_counted": req.mtp,
        "request": asdict(req),
    }
