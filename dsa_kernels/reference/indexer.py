"""Lightning indexer over paged fp8 keys (DeepSeek-V3.2 semantics), and top-k selection.

Semantics, restated from DeepSeek-V3.2-Exp ``inference/model.py`` (``Indexer.forward``) and
``inference/kernel.py`` (``act_quant``, ``fp8_index``):

1. every query head vector ``q[t, h]`` (after RoPE + Hadamard rotation, done by the model) and
   every key ``k[s]`` is quantized to e4m3 with one power-of-two (ue8m0) scale per 128 values
   (``index_keys.quantize_e4m3``); keys live in the paged cache as bytes + scale;
2. the query scale is not applied to the query: it is folded into the head weights together with
   ``H^-0.5`` and the softmax scale ``D^-0.5``:
   ``w'[t, h] = (weights[t, h] * H^-0.5) * q_scale[t, h] * D^-0.5``, where ``weights`` is the
   model's ``weights_proj(x)`` output;
3. ``I[t, s] = k_scale[s] * sum_h w'[t, h] * relu(q_e4m3[t, h] . k_e4m3[s])`` (the dot over fp8
   values accumulated in fp32), for ``s <= positions[t]`` (causal), ``-inf`` elsewhere;
4. top-k of ``I[t, :]``; ties go to the lower position here (DeepSeek's ``torch.topk`` leaves them
   unspecified), and positions past the row's context are ``-1``.
"""

from __future__ import annotations

import torch

from dsa_kernels.layout import FP8_DTYPE, PAGE_SIZE
from dsa_kernels.reference.index_keys import quantize_e4m3, read_index_keys


def quantize_index_q(q: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Query heads to e4m3 and the folded head weights (steps 1-2 above).

    q ``[T, H, D]`` (any float dtype); weights ``[T, H]`` (``weights_proj`` output, any float dtype).
    Returns ``(q_fp8 [T, H, D] float8_e4m3fn, w' [T, H] fp32)``. The ``H^-0.5`` product is taken in
    the weights' dtype, as DeepSeek does (bf16 there), the rest in fp32.
    """
    heads, dim = q.shape[1], q.shape[2]
    q_fp8, q_scale = quantize_e4m3(q)  # [T, H, D], [T, H]
    return q_fp8, ((weights * heads**-0.5).float() * q_scale) * dim**-0.5


def _as_quantized(q: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept either raw ``(q, weights)`` or already ``quantize_index_q``'d ``(q_fp8, w')``."""
    if q.dtype == FP8_DTYPE:
        return q, weights.float()
    return quantize_index_q(q, weights)


def indexer_scores(
    q: torch.Tensor,
    weights: torch.Tensor,
    index_cache: torch.Tensor,
    page_table: torch.Tensor,
    req_idx: torch.Tensor,
    positions: torch.Tensor,
    max_context: int,
    s_start: int = 0,
) -> torch.Tensor:
    """``I[t, s]`` for context columns ``s`` in ``[s_start, max_context)``: fp32 ``[T, max_context - s_start]``.

    q ``[T, H, D]`` float with raw ``weights [T, H]``, or ``q`` already e4m3 with folded weights
    (``quantize_index_q``; the chunked top-k quantizes once and calls this per column chunk);
    index_cache ``[P, 64 * (D + 4)]`` uint8; page_table ``[B, max_pages]`` (request ``b``'s token
    ``s`` lives in slot ``page_table[b, s // 64] * 64 + s % 64``); req_idx ``[T]`` (request of each
    query row); positions ``[T]`` (the query's position in its request).

    Host reads: this reference loops over the batch's requests on the host (``unique().tolist()``,
    ``nonzero``, ``int(max)``: three per request), fine for the CPU fallback it is; the Triton
    kernel, the path a GPU takes, reads nothing back.
    """
    q_fp8, w = _as_quantized(q, weights)
    t_count, heads = q_fp8.shape[:2]
    n_cols = max_context - s_start
    out = torch.full((t_count, n_cols), float("-inf"), dtype=torch.float32, device=q.device)
    s = torch.arange(s_start, max_context, device=q.device)
    for b in torch.unique(req_idx).tolist():
        rows = (req_idx == b).nonzero().squeeze(1)
        n_ctx = min(int(positions[rows].max()) + 1 - s_start, n_cols)
        if n_ctx <= 0:
            continue
        slots = page_table[b, s[:n_ctx] // PAGE_SIZE].long() * PAGE_SIZE + s[:n_ctx] % PAGE_SIZE
        k_fp8, k_scale = read_index_keys(index_cache, slots)  # [n_ctx, D], [n_ctx]
        k_t = k_fp8.float().T.contiguous()  # [D, n_ctx]: contiguous operands keep CPU matmuls on the fast path
        q_h = q_fp8[rows].float().transpose(0, 1).contiguous()  # [H, t, D]
        acc = torch.zeros(len(rows), n_ctx, dtype=torch.float32, device=q.device)
        for h in range(heads):  # one head at a time: no [t, H, n_ctx] intermediate
            acc += w[rows, h, None] * torch.relu(q_h[h] @ k_t)
        causal = s[None, :n_ctx] <= positions[rows, None]
        out[rows, :n_ctx] = torch.where(causal, acc * k_scale[None], float("-inf"))
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


def topk_merge(
    best_scores: torch.Tensor, best_idx: torch.Tensor, chunk_scores: torch.Tensor, s_start: int, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One step of the running top-k: the best ``k`` of the kept ``(best_scores, best_idx) [T, <=k]``
    and the new columns ``chunk_scores [T, n]`` (context positions ``s_start + j``).

    Chunks arrive in increasing position order and the kept entries are sorted by (score desc,
    index asc), so a stable descending sort of ``kept ++ chunk`` keeps that order: ties go to the
    lower position, exactly as ``topk_indices`` over the whole row. Returns ``[T, min(k, kept + n)]``.
    """
    t_count, n = chunk_scores.shape
    cols = torch.arange(s_start, s_start + n, dtype=torch.int32, device=chunk_scores.device)
    scores = torch.cat([best_scores, chunk_scores], dim=1)
    idx = torch.cat([best_idx, cols.expand(t_count, n)], dim=1)
    order = torch.sort(scores, dim=1, descending=True, stable=True)
    keep = order.indices[:, :k]
    return order.values[:, :k], idx.gather(1, keep)


def positions_to_slots(top: torch.Tensor, page_table: torch.Tensor, req_idx: torch.Tensor) -> torch.Tensor:
    """Map per-request positions ``[T, K]`` (-1 kept) to cache slots via ``page_table [B, max_pages]``."""
    valid = top >= 0
    pos = top.clamp_min(0).long()
    pages = page_table[req_idx.long()[:, None], pos // PAGE_SIZE].long()
    slots = pages * PAGE_SIZE + pos % PAGE_SIZE
    return torch.where(valid, slots, torch.full_like(slots, -1)).to(torch.int32)


def topk_slots(
    scores: torch.Tensor, page_table: torch.Tensor, req_idx: torch.Tensor, positions: torch.Tensor, k: int
) -> torch.Tensor:
    """Top-``k`` of each row's first ``positions[t] + 1`` columns, as cache slots ``[T, k]`` int32
    (-1 padded): ``positions_to_slots(topk_indices(scores), ...)`` in one op, the shape of
    FlashInfer's fused ``top_k_page_table_transform``."""
    cols = torch.arange(scores.shape[1], device=scores.device)
    visible = scores.masked_fill(cols[None, :] > positions.long()[:, None], float("-inf"))
    return positions_to_slots(topk_indices(visible, k), page_table, req_idx)
