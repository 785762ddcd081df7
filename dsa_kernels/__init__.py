"""DSA compute ops: indexer-key fp8 paging, MLA latent packing, lightning indexer + top-k,
sparse MLA prefill, paged gather/scatter. Each op dispatches (``dsa_kernels.dispatch``) to a
vendor kernel, a Triton kernel or the fp32 torch reference in ``dsa_kernels.reference``.

Byte layouts: ``dsa_kernels.layout``. Example::

    cache = torch.zeros(num_pages, 64 * 132, dtype=torch.uint8)
    quantize_index_keys(keys, cache, slots)          # keys [n, 128]
    scores = indexer_scores(q, w, cache, page_table, req_idx, positions, max_context)
    top = topk_indices(scores, 2048)                 # [T, 2048] int32, -1 padded
"""

from __future__ import annotations

import torch

from dsa_kernels.dispatch import resolve
from dsa_kernels.layout import PAGE_SIZE
from dsa_kernels.reference.indexer import topk_indices


def quantize_index_keys(keys: torch.Tensor, index_cache: torch.Tensor, slots: torch.Tensor) -> None:
    """Write ``keys [n, D]`` into the paged fp8 indexer cache ``[P, 64 * (D + 4)]`` uint8 at ``slots [n]``."""
    resolve("quantize_index_keys", index_cache.device)[1](keys, index_cache, slots)


def dequantize_index_keys(index_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Read indexer keys at ``slots [n]`` as fp32 ``[n, D]``."""
    return resolve("dequantize_index_keys", index_cache.device)[1](index_cache, slots)


def pack_mla_kv(kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor) -> None:
    """Write latent ``kv_c [n, L]`` + rope ``k_pe [n, R]`` into a bf16 or fp8-layout MLA cache at ``slots``."""
    resolve("pack_mla_kv", kv_cache.device)[1](kv_c, k_pe, kv_cache, slots)


def unpack_mla_kv(kv_cache: torch.Tensor, slots: torch.Tensor, kv_lora_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Read MLA rows at ``slots`` as fp32 ``(kv_c [n, L], k_pe [n, R])``."""
    return resolve("unpack_mla_kv", kv_cache.device)[1](kv_cache, slots, kv_lora_rank)


def indexer_scores(q, weights, index_cache, page_table, req_idx, positions, max_context: int) -> torch.Tensor:
    """Lightning-indexer scores ``[T, max_context]`` fp32 (see ``reference.indexer.indexer_scores``)."""
    fn = resolve("indexer_scores", index_cache.device)[1]
    return fn(q, weights, index_cache, page_table, req_idx, positions, max_context)


def indexer_topk(q, weights, index_cache, page_table, req_idx, positions, max_context: int, topk: int = 2048):
    """Top-``topk`` context positions per query ``[T, topk]`` int32, -1 padded (k >= context handled)."""
    scores = indexer_scores(q, weights, index_cache, page_table, req_idx, positions, max_context)
    return topk_indices(scores, topk)


def positions_to_slots(top: torch.Tensor, page_table: torch.Tensor, req_idx: torch.Tensor) -> torch.Tensor:
    """Map per-request positions ``[T, K]`` (-1 kept) to cache slots via ``page_table [B, max_pages]``."""
    valid = top >= 0
    pos = top.clamp_min(0).long()
    pages = page_table[req_idx.long()[:, None], pos // PAGE_SIZE].long()
    slots = pages * PAGE_SIZE + pos % PAGE_SIZE
    return torch.where(valid, slots, torch.full_like(slots, -1)).to(torch.int32)


def sparse_mla_prefill(q, kv_cache, indices, sm_scale: float, kv_lora_rank: int):
    """Absorbed sparse MLA prefill: ``(out [T, H, L], lse [T, H])`` over the rows ``indices [T, K]``."""
    return resolve("sparse_mla_prefill", kv_cache.device)[1](q, kv_cache, indices, sm_scale, kv_lora_rank)


def gather_pages(pages: torch.Tensor, page_ids: torch.Tensor) -> torch.Tensor:
    """Pack ``pages[page_ids]`` of a ``[P, page_bytes]`` uint8 view into a contiguous buffer."""
    return resolve("gather_pages", pages.device)[1](pages, page_ids)


def scatter_pages(packed: torch.Tensor, pages: torch.Tensor, page_ids: torch.Tensor) -> None:
    """Unpack ``packed [n, page_bytes]`` into ``pages[page_ids]``."""
    resolve("scatter_pages", pages.device)[1](packed, pages, page_ids)


__all__ = [
    "quantize_index_keys", "dequantize_index_keys", "pack_mla_kv", "unpack_mla_kv", "indexer_scores",
    "indexer_topk", "topk_indices", "positions_to_slots", "sparse_mla_prefill", "gather_pages", "scatter_pages",
]
