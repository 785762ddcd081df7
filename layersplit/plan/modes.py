"""The serving modes every table compares, and the cache bytes a rank stores in each
(:func:`mode_bytes`): per token, per layer held, scratch. Capacity per rank from these is
:mod:`layersplit.plan.capacity`'s."""

from __future__ import annotations

from dataclasses import dataclass

from dsa_kernels.layout import PAGE_SIZE
from layersplit.plan.ownership import plan_ownership
from layersplit.plan import kv_sharding, query_moving
from layersplit.plan.config import HardwareConfig, ModelConfig
from layersplit.plan import sizing


def scratch_pages_for(max_batch_tokens: int, max_requests: int) -> int:
    """Pages of one scratch slot: any batch of ``max_batch_tokens`` context tokens in at most
    ``max_requests`` requests (each request may end in a partial page)."""
    return -(-max_batch_tokens // PAGE_SIZE) + max_requests


# The serving modes the sweep compares, each a row of every table:
# redundant              SGLang CP: every layer on every rank, a per-rank host tier (SGLang's HiCache);
# redundant-shared-host  the same device layout, one host copy per node that every rank reloads from;
# upstream-layersplit    SGLang 0.5.23 --enable-dsa-cache-layer-split: owned layers + one pool-sized
#                        landing layer; whole-buffer broadcast on every read (indexer synchronous);
# kv-sharding            SGLang's page-level KV sharding as designed (:mod:`layersplit.plan.kv_sharding`):
#                        1/N of every layer per rank, the batch's prefix pages all-gathered one layer
#                        ahead into batch-sized double-buffered scratch, each rank reloading its stripe;
# kv-sharding-shipped    the same as SGLang 0.5.23 ships it: fp8 KV required, scratch for 8 full contexts;
#                        it runs on SM 10 only (:mod:`layersplit.plan.kv_sharding`);
# query-moving           "move the query, not the cache" (arXiv 2606.01502; :mod:`layersplit.plan.query_moving`):
#                        owned layers; each layer's owner gets every rank's queries, attends, returns outputs;
# sglang-plugin          owned layers + batch-sized staging slots read through remapped page tables
#                        (batch landing), row-only broadcasts;
# layersplit             this project's engine: owned layers + two batch-sized scratch slots.
MODES = ("redundant", "redundant-shared-host", "upstream-layersplit", "kv-sharding", "kv-sharding-shipped",
         "query-moving", "sglang-plugin", "layersplit")
BROADCAST = {"redundant": None, "redundant-shared-host": None, "upstream-layersplit": "pool",
             "kv-sharding": "gather", "kv-sharding-shipped": "gather", "query-moving": "queries",
             "sglang-plugin": "rows", "layersplit": "rows"}
# What each mode is in a table: a "peer" is a layout SGLang 0.5.23 runs (the peer to beat wherever it
# runs; redundant-shared-host: the same CP with one HiCache storage copy per node, an assumption), a
# "design" is modelled from a description and stays a bar, never the peer to beat; "ours" is this project's.
ROLE = {"redundant": "peer", "redundant-shared-host": "peer", "upstream-layersplit": "peer", "kv-sharding": "design",
        "kv-sharding-shipped": "peer", "query-moving": "design", "sglang-plugin": "ours", "layersplit": "ours"}
# SGLang 0.5.23 layouts that run only on some GPU generations (CUDA compute capability majors) and the
# source that says so; every other mode has no SM gate
SM_MAJORS = {"kv-sharding-shipped": (kv_sharding.SHIPPED_SM_MAJORS,
                                     "its gate requires the trtllm DSA backends (kv_shard_hook.py:45-54), which "
                                     "SGLang picks on SM >= 10 only (overrides.py:715-716) and whose FlashInfer "
                                     "trtllm-gen kernels run on SM 10.x only (fmhaRunner.cuh:37-38)")}
# modes that run one KV dtype whatever is asked: they have no row at another dtype (like with like)
FIXED_KV_DTYPE = {"kv-sharding-shipped": kv_sharding.SHIPPED_KV_DTYPE}


def unavailable_reason(mode: str, hw: HardwareConfig) -> str | None:
    """Why ``mode`` cannot run on ``hw`` in SGLang 0.5.23, or None when it can (or is not SGLang's)."""
    if mode not in SM_MAJORS:
        return None
    majors, why = SM_MAJORS[mode]
    if hw.sm_major in majors:
        return None
    gpu = f"SM {hw.sm_major}" if hw.sm_major else "no CUDA device"
    return f"not available on {hw.name} ({gpu}; needs SM {'/'.join(map(str, majors))}): {why}"


def modes_at(modes: tuple[str, ...], kv_dtype: str) -> tuple[str, ...]:
    """The modes that have a row at ``kv_dtype``: every mode but those fixed to another dtype."""
    return tuple(m for m in modes if FIXED_KV_DTYPE.get(m, kv_dtype) == kv_dtype)
# NVLink bandwidth a collective reaches: ~380 GB/s measured of 450 per direction (DESIGN.md section 2);
# the plan and the cost model both price broadcasts with it
NVLINK_EFFICIENCY = 380 / 450


# Model-only ownership (the CP engine does not implement page striping): the L mod N first layers are
# page-striped over all ranks like KV sharding (each rank 1/N of them, all-gathered one layer ahead),
# the other layers owned round-robin. Every rank then holds the same bytes (78 layers on 8 ranks: 9
# owned + 6/8 striped = 9.75 layers, not 10) and layer 0's reload is spread over every PCIe link.
STRIPED_REMAINDER = "round-robin-striped"
MODEL_OWNERSHIPS = ("contiguous", "round-robin", STRIPED_REMAINDER)


def striped_remainder(num_layers: int, cp: int) -> tuple[tuple[tuple[int, ...], ...], tuple[int, ...]]:
    """(held layers per rank, striped layers) of :data:`STRIPED_REMAINDER` ownership."""
    striped = tuple(range(num_layers % cp))
    held = tuple(striped + tuple(layer for layer in range(len(striped), num_layers) if (layer - len(striped)) % cp == r)
                 for r in range(cp))
    return held, striped


def mode_kv_dtype(mode: str, kv_dtype: str) -> str:
    """The KV dtype ``mode`` runs: SGLang 0.5.23's KV sharding refuses anything but fp8 for DSA models."""
    return FIXED_KV_DTYPE.get(mode, kv_dtype)


@dataclass(frozen=True)
class ModeBytes:
    """Per-rank cache bytes per token of one mode, and the layers each rank keeps."""

    mode: str
    bytes_per_token: int  # device, worst rank (upstream's layouts: + the pool-sized landing layer)
    held_layers: tuple[tuple[int, ...], ...]  # per rank
    scratch_bytes: int  # batch-sized scratch (layersplit: two slots; plug-in: its staging)
    host_bytes_per_token: int = 0  # host tier: the held layers (0: as ``bytes_per_token``)
    host_pooled_ranks: int = 1  # ranks whose host budgets hold one shared copy (shared host: the CP size)
    stripe: int = 1  # each rank holds 1/stripe of every held layer's rows (KV sharding: the CP size)
    striped: tuple[int, ...] = ()  # layers page-striped over the CP ranks inside an owned layout (see below)
    kv_dtype: str = "bf16"  # what this mode runs (KV sharding as shipped: fp8 whatever was asked)

    @property
    def broadcast(self) -> str | None:
        """None, 'rows' (the batch's prefix rows), 'pool' (upstream: the whole landing layer),
        'gather' (KV sharding: every rank's stripe of the batch's prefix pages, all-gathered) or
        'queries' (query-moving: queries to the layer's owner, outputs back)."""
        return BROADCAST[self.mode]


def mode_bytes(model: ModelConfig, cp: int, kv_dtype: str, mode: str, max_batch_tokens: int,
               max_requests: int, ownership: str = "contiguous", context_len: int = 131072,
               chunk_tokens: int | None = None) -> ModeBytes:
    """Bytes per token a rank stores in ``mode`` (one of :data:`MODES`). ``max_batch_tokens`` is the
    context one batch reads (it sizes batch-sized scratch); ``context_len`` and ``chunk_tokens`` (new
    tokens a batch computes; default ``max_batch_tokens``) size KV sharding's scratch as shipped, and
    ``chunk_tokens`` the query-moving owner's receive slots."""
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
    kv_dtype = mode_kv_dtype(mode, kv_dtype)
    per_layer = [model.layer_bytes_per_token(layer, kv_dtype) for layer in range(model.num_layers)]
    if mode.startswith("kv-sharding"):
        return _kv_sharding_bytes(model, cp, kv_dtype, mode, per_layer, max_batch_tokens, max_requests,
                                  context_len, chunk_tokens or max_batch_tokens)
    if mode.startswith("redundant"):
        pooled = cp if mode == "redundant-shared-host" else 1
        return ModeBytes(mode, sum(per_layer), (tuple(range(model.num_layers)),) * cp, 0, sum(per_layer), pooled,
                         kv_dtype=kv_dtype)
    if mode == "query-moving":  # owned layers, no page striping (the owner attends for every rank)
        strategy = "round-robin" if ownership == STRIPED_REMAINDER else ownership
        held = tuple(plan_ownership(model.num_layers, cp, strategy).owned_layers(r) for r in range(cp))
        owned = max(sum(per_layer[layer] for layer in h) for h in held)
        scratch = query_moving.scratch_bytes(model, cp, chunk_tokens or max_batch_tokens)
        return ModeBytes(mode, owned, held, scratch, owned, kv_dtype=kv_dtype)
    if mode == "layersplit" and ownership == STRIPED_REMAINDER:
        held, striped = striped_remainder(model.num_layers, cp)
    else:
        held = tuple(plan_ownership(model.num_layers, cp, "contiguous" if mode != "layersplit" else ownership)
                     .owned_layers(r) for r in range(cp))
        striped = ()
    owned = max(sum(per_layer[layer] for layer in h if layer not in striped) for h in held)
    owned += kv_sharding.stripe_bytes_per_token(sum(per_layer[layer] for layer in striped), cp) if striped else 0
    if mode == "layersplit":
        scratch = 2 * scratch_pages_for(max_batch_tokens, max_requests) * PAGE_SIZE * max(per_layer) if cp > 1 else 0
        return ModeBytes(mode, owned, held, scratch, owned, kv_dtype=kv_dtype, striped=striped)
    if mode == "sglang-plugin":  # batch landing: the remap table (1/8 B a token) is left out of this int
        staging = sglang_plugin_staging_bytes(model, kv_dtype, max_batch_tokens, max_requests) if cp > 1 else 0
        return ModeBytes(mode, owned, held, staging, owned, kv_dtype=kv_dtype)
    landing = max(per_layer) if cp > 1 else 0  # one pool-sized layer: a layer's bytes for every pool token
    return ModeBytes(mode, owned + landing, held, 0, owned, kv_dtype=kv_dtype)


def _kv_sharding_bytes(model: ModelConfig, cp: int, kv_dtype: str, mode: str, per_layer: list[int],
                       max_batch_context: int, max_requests: int, context_len: int, chunk_tokens: int) -> ModeBytes:
    """1/N of every layer a token (device and host); scratch as designed (batch-sized) or as shipped."""
    stripe = kv_sharding.stripe_bytes_per_token(sum(per_layer), cp)
    if mode == "kv-sharding":
        scratch = kv_sharding.designed_scratch_bytes(cp, max_batch_context, max_requests, max(per_layer))
    else:
        scratch = kv_sharding.shipped_scratch_bytes(cp, context_len, chunk_tokens, model.kv_bytes_per_token(kv_dtype),
                                                    model.index_head_dim)
    every = (tuple(range(model.num_layers)),) * cp
    return ModeBytes(mode, stripe, every, scratch, stripe, stripe=cp, kv_dtype=kv_dtype)


def sglang_plugin_staging_bytes(model: ModelConfig, kv_dtype: str, max_batch_tokens: int,
                                max_requests: int = 0) -> int:
    """Both staging slots the SGLang plug-in pool allocates (latent rows and indexer-key pages) for
    a batch of ``max_batch_tokens`` context tokens in ``max_requests`` requests."""
    pages = -(-max_batch_tokens // PAGE_SIZE) + max_requests
    return sizing.staging_bytes(pages, PAGE_SIZE, model.kv_bytes_per_token(kv_dtype),
                                PAGE_SIZE * model.index_bytes_per_token)


def sglang_plugin_tokens(budget: float, owned_per_token: int, landing_per_token: int, staging: int,
                         landing: str) -> int:
    """Pool tokens the plug-in fits in ``budget``: owned layers (+ the pool-sized landing layer) per
    token, the staging once, and (batch landing) the remap table, ``8 B`` per 64-token page (its
    one spare entry and the pool's padding page counted as two more pages)."""
    if landing == "pool":
        return max(0, int((budget - staging) // (owned_per_token + landing_per_token)))
    remap = sizing.REMAP_BYTES_PER_PAGE
    return max(0, int((budget - staging - 2 * remap) * PAGE_SIZE // (owned_per_token * PAGE_SIZE + remap)))
