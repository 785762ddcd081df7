"""Lightning indexer over paged fp8 keys, and top-k selection."""

from __future__ import annotations

import torch

from dsa_kernels.layout import PAGE_SIZE
from dsa_kernels.reference.index_keys import dequantize_index_keys


def indexer_scores(
    q: torch.Tensor,
    weights: torch.Tensor,
    index_cache: torch.Tensor,
    page_table: torch.Tensor,
    req_idx: torch.Tensor,
    positions: torch.Tensor,
    max_context: int,
) -> torch.Tensor:
    """``I[t, s] = sum_h w[t, h] * relu(q[t, h] . k[s])`` for ``s <= positions[t]``, else ``-inf``.

    q ``[T, H, D]``; weights ``[T, H]``; index_cache ``[P, 64 * (D + 4)]`` uint8; page_table
    ``[B, max_pages]`` int32 (request ``b``'s token ``s`` lives in slot
    ``page_table[b, s // 64] * 64 + s % 64``); req_idx ``[T]`` (request of each query row);
    positions ``[T]`` (the query's position in its request). Returns fp32 ``[T, max_context]``.
    """
    t_count = q.shape[0]
    out = torch.full((t_count, max_context), float("-inf"), dtype=torch.float32, device=q.device)
    s = torch.arange(max_context, device=q.device)
    for b in torch.unique(req_idx).tolist():
        rows = (req_idx == b).nonzero().squeeze(1)
        n_ctx = min(int(positions[rows].max()) + 1, max_context)
        slots = page_table[b, s[:n_ctx] // PAGE_SIZE].long() * PAGE_SIZE + s[:n_ctx] % PAGE_SIZE
        k = dequantize_index_keys(index_cache, slots)  # [n_ctx, D]
        logits = torch.relu(torch.einsum("thd,sd->ths", q[rows].float(), k))  # [t, H, n_ctx]
        scores = torch.einsum("th,ths->ts", weights[rows].float(), logits)
        causal = s[None, :n_ctx] <= positions[rows, None]
        out[rows, :n_ctx] = torch.where(causal, scores, float("-inf"))
    return out


def topk_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` largest finite scores per row, ``[T, k]`` int32, padded with -1.

    Ties break toward the lower index; the order is by score, then index. Columns beyond the
    row's finite entries (masked ``-inf`` or ``k > context``) are -1.
    """
    t_count, n = scores.shape
    order = torch.sort(scores, dim=1, descending=True, stable=True)
    idx = order.indices[:, :k].to(torch.int32)
    valid = torch.isfinite(order.values[:, :k])
    idx = torch.where(valid, idx, torch.full_like(idx, -1))
    if k > n:
        idx = torch.cat([idx, idx.new_full((t_count, k - n), -1)], dim=1)
    return idx
