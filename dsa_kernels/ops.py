"""The public DSA ops (re-exported by :mod:`dsa_kernels`, which imports this module on first use so
that ``dsa_kernels.layout`` and the other torch-free modules load without torch)."""


from __future__ import annotations

from typing import Sequence

import torch

from dsa_kernels.dispatch import resolve
from dsa_kernels.reference import indexer as _reference_indexer
from dsa_kernels.reference.indexer import positions_to_slots
from dsa_kernels.rotation import hadamard_rotate

DEFAULT_CHUNK = 16384  # context columns scored per step of indexer_topk
DEFAULT_QUERY_BLOCK = 2048  # query rows per block of indexer_topk


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


def quantize_index_q(q: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Indexer query heads to e4m3 (ue8m0 scale per head) and the folded head weights
    ``(weights * H^-0.5) * q_scale * D^-0.5`` (see ``reference.indexer``)."""
    return _reference_indexer.quantize_index_q(q, weights)


def indexer_scores(q, weights, index_cache, page_table, req_idx, positions, max_context: int) -> torch.Tensor:
    """Lightning-indexer scores ``[T, max_context]`` fp32, the whole row at once (memory ``T x ctx``;
    prefer ``indexer_topk``). ``q [T, H, D]`` after RoPE + Hadamard, ``weights [T, H]`` the raw
    ``weights_proj`` output; see ``reference.indexer`` for the formula."""
    fn = resolve("indexer_scores", index_cache.device)[1]
    return fn(q, weights, index_cache, page_table, req_idx, positions, max_context)


def query_block_extents(positions: torch.Tensor | Sequence[int], max_context: int,
                        query_block: int = DEFAULT_QUERY_BLOCK) -> list[int]:
    """Per block of ``query_block`` query rows, ``min(max position in the block + 1, max_context)``:
    the ``block_extents`` of ``indexer_topk``, computed on the host from host positions (a CPU tensor
    or a list, e.g. the batch plan's), so the per-layer call needs no device read.

    Example: ``query_block_extents([5, 9, 2, 70], 64, query_block=2) == [10, 64]``.
    """
    if isinstance(positions, torch.Tensor):
        if positions.device.type != "cpu":
            raise ValueError(f"positions: expected a host (CPU) tensor or a list, got device {positions.device} "
                             "(reading it here would be a host sync)")
        positions = positions.reshape(-1).tolist()  # host memory: no device sync
    if query_block < 1:
        raise ValueError(f"query_block: expected >= 1, got {query_block}")
    rows = list(positions)
    return [min(max(rows[i:i + query_block]) + 1, max_context) for i in range(0, len(rows), query_block)]


def _check_extents(block_extents: Sequence[int], t_count: int, query_block: int, max_context: int) -> list[int]:
    """Host-only checks of given extents (count and range; their values cannot be checked against
    the device positions without the sync they exist to avoid)."""
    want = -(-t_count // query_block)
    extents = list(block_extents)
    if len(extents) != want:
        raise ValueError(f"block_extents: expected {want} entries (ceil({t_count} query rows / query_block "
                         f"{query_block})), got {len(extents)}")
    bad = [e for e in extents if not 0 <= e <= max_context]
    if bad:
        raise ValueError(f"block_extents: expected values in [0, max_context={max_context}], got {bad[:4]}")
    return extents


def indexer_topk(q, weights, index_cache, page_table, req_idx, positions, max_context: int, topk: int = 2048,
                 *, chunk: int = DEFAULT_CHUNK, query_block: int = DEFAULT_QUERY_BLOCK,
                 block_extents: Sequence[int] | None = None) -> torch.Tensor:
    """Top-``topk`` context positions per query ``[T, topk]`` int32, -1 padded, ties to the lower position.

    Chunked: per block of ``query_block`` queries, scores for ``chunk`` context columns at a time,
    merged into a running top-k (``topk_merge``), so the peak is ``query_block x (topk + chunk)``
    scores, not ``T x max_context``. A block stops at its last visible column (causal). Same index
    sets as ``topk_indices(indexer_scores(...))``.

    ``block_extents``: each block's last visible column + 1 (``query_block_extents`` computes them
    on the host from the batch plan's positions). Given, the call reads nothing back from the
    device; None: they are computed from ``positions`` on the device and read back, **one host
    sync per call** (a blocking device-to-host copy on a GPU).
    """
    if chunk < 1 or query_block < 1:
        raise ValueError(f"chunk, query_block: expected >= 1, got {chunk}, {query_block}")
    dev = index_cache.device
    scores_fn = resolve("indexer_scores", dev)[1]
    merge_fn = resolve("topk_merge", dev)[1]
    t_count = q.shape[0]
    if block_extents is not None:
        extents = _check_extents(block_extents, t_count, query_block, max_context)
    out = torch.full((t_count, topk), -1, dtype=torch.int32, device=dev)
    if t_count == 0 or topk == 0:
        return out
    if block_extents is None:  # the host sync the docstring names
        blocks = positions.long().split(query_block)
        extents = torch.stack([p.max() for p in blocks]).add(1).clamp(max=max_context).tolist()
    for i, extent in enumerate(extents):
        rows = slice(i * query_block, min((i + 1) * query_block, t_count))
        n_rows = rows.stop - rows.start
        q_fp8, w = quantize_index_q(q[rows], weights[rows])  # once per block: every chunk reuses it
        best = torch.empty(n_rows, 0, dtype=torch.float32, device=dev)
        best_idx = torch.empty(n_rows, 0, dtype=torch.int32, device=dev)
        for s0 in range(0, extent, chunk):
            scores = scores_fn(q_fp8, w, index_cache, page_table, req_idx[rows], positions[rows],
                               min(s0 + chunk, extent), s0)
            best, best_idx = merge_fn(best, best_idx, scores, s0, topk)
        out[rows, : best_idx.shape[1]] = torch.where(torch.isfinite(best), best_idx, -1)
    return out


def topk_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` largest finite scores per row ``[T, k]`` int32, -1 padded (vendor tier:
    FlashInfer on CUDA, same sets up to ties)."""
    return resolve("topk_indices", scores.device)[1](scores, k)


def topk_slots(scores, page_table, req_idx, positions, k: int) -> torch.Tensor:
    """Top-``k`` of each row's visible columns mapped to cache slots ``[T, k]`` int32 (-1 padded) in one
    op (vendor tier: FlashInfer's fused ``top_k_page_table_transform``)."""
    return resolve("topk_slots", scores.device)[1](scores, page_table, req_idx, positions, k)


def sparse_mla_prefill(q, kv_cache, indices, sm_scale: float, kv_lora_rank: int):
    """Absorbed sparse MLA prefill: ``(out [T, H, L], lse [T, H])`` over the rows ``indices [T, K]`` of a
    bf16 ``[S, L + R]`` cache or an fp8-layout uint8 ``[S, L + 4L/128 + 2R]`` one (its rows dequantized
    as they are gathered; ``dsa_kernels.layout``). Masking and lse as ``reference.sparse_mla``."""
    return resolve("sparse_mla_prefill", kv_cache.device)[1](q, kv_cache, indices, sm_scale, kv_lora_rank)


def gather_pages(pages: torch.Tensor, page_ids: torch.Tensor) -> torch.Tensor:
    """Pack ``pages[page_ids]`` of a ``[P, page_bytes]`` uint8 view into a contiguous buffer."""
    return resolve("gather_pages", pages.device)[1](pages, page_ids)


def scatter_pages(packed: torch.Tensor, pages: torch.Tensor, page_ids: torch.Tensor) -> None:
    """Unpack ``packed [n, page_bytes]`` into ``pages[page_ids]``."""
    resolve("scatter_pages", pages.device)[1](packed, pages, page_ids)


__all__ = [
    "quantize_index_keys", "dequantize_index_keys", "pack_mla_kv", "unpack_mla_kv", "hadamard_rotate",
    "quantize_index_q", "indexer_scores", "indexer_topk", "query_block_extents", "topk_indices", "topk_slots", "positions_to_slots",
    "sparse_mla_prefill", "gather_pages", "scatter_pages",
]
