"""Lightning-indexer scores over paged fp8 index keys (top-k is a separate op in dispatch)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsa_kernels.layout import FP8_DTYPE, PAGE_SIZE, index_head_dim_of
from dsa_kernels.triton_ops.checks import FLOAT_DTYPES, INDEX_DTYPES, check_len, check_tensor


@triton.jit
def _indexer_scores_kernel(
    q_ptr, w_ptr, cache_f8_ptr, cache_f32_ptr, page_table_ptr, req_ptr, pos_ptr, out_ptr,
    stride_qt, stride_qh, stride_wt, stride_pt, page_bytes, max_context,
    H: tl.constexpr, BLOCK_H: tl.constexpr, D: tl.constexpr, BLOCK_S: tl.constexpr, PAGE: tl.constexpr,
):
    t = tl.program_id(0)
    s = tl.program_id(1) * BLOCK_S + tl.arange(0, BLOCK_S)  # [BLOCK_S]
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, D)
    b = tl.load(req_ptr + t).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    valid = (s <= pos) & (s < max_context)  # causal mask
    # 1. token s of request b -> page and byte offsets of its key and scale
    page = tl.load(page_table_ptr + b * stride_pt + s // PAGE, mask=valid, other=0).to(tl.int64)
    base = page * page_bytes
    k = tl.load(cache_f8_ptr + base[:, None] + (s % PAGE)[:, None] * D + d[None, :],
                mask=valid[:, None], other=0.0).to(tl.float32)  # [BLOCK_S, D]
    k_scale = tl.load(cache_f32_ptr + (base + PAGE * D) // 4 + s % PAGE, mask=valid, other=0.0)  # [BLOCK_S]
    # 2. per-head logits; the positive key scale commutes with relu
    q = tl.load(q_ptr + t * stride_qt + h[:, None] * stride_qh + d[None, :], mask=h[:, None] < H, other=0.0)
    logits = tl.dot(q.to(tl.float32), tl.trans(k))  # [BLOCK_H, BLOCK_S]
    w = tl.load(w_ptr + t * stride_wt + h, mask=h < H, other=0.0).to(tl.float32)  # [BLOCK_H]
    # 3. weighted head sum, masked positions -> -inf
    score = tl.sum(tl.maximum(logits, 0.0) * w[:, None], axis=0) * k_scale  # [BLOCK_S]
    score = tl.where(valid, score, float("-inf"))
    tl.store(out_ptr + t * max_context + s, score, mask=s < max_context)


def indexer_scores(
    q: torch.Tensor,
    weights: torch.Tensor,
    index_cache: torch.Tensor,
    page_table: torch.Tensor,
    req_idx: torch.Tensor,
    positions: torch.Tensor,
    max_context: int,
) -> torch.Tensor:
    """fp32 ``[T, max_context]`` scores, ``-inf`` where ``s > positions[t]``; shapes as the reference."""
    dev = index_cache.device
    d = index_head_dim_of(index_cache)
    check_tensor("q", q, dim=3, dtypes=FLOAT_DTYPES, device=dev)
    t_count, heads, qd = q.shape
    if qd != d or d & (d - 1) or d < 16:
        raise ValueError(f"q: expected head dim {d} (from index_cache), a power of 2 >= 16; got {qd}")
    check_tensor("weights", weights, dim=2, dtypes=FLOAT_DTYPES, device=dev)
    if tuple(weights.shape) != (t_count, heads):
        raise ValueError(f"weights: expected shape {[t_count, heads]}, got {list(weights.shape)}")
    check_tensor("page_table", page_table, dim=2, dtypes=INDEX_DTYPES, device=dev)
    for name, t in (("req_idx", req_idx), ("positions", positions)):
        check_tensor(name, t, dim=1, dtypes=INDEX_DTYPES, device=dev)
        check_len(name, t, t_count, "one per query row")
    if max_context > page_table.shape[1] * PAGE_SIZE:
        raise ValueError(f"max_context: expected <= {page_table.shape[1] * PAGE_SIZE} (page_table width), got {max_context}")
    out = torch.empty(t_count, max_context, dtype=torch.float32, device=dev)
    if t_count == 0 or max_context == 0:
        return out
    block_s = 64
    grid = (t_count, triton.cdiv(max_context, block_s))
    _indexer_scores_kernel[grid](
        q, weights, index_cache.view(FP8_DTYPE), index_cache.view(torch.float32), page_table, req_idx, positions,
        out, q.stride(0), q.stride(1), weights.stride(0), page_table.stride(0), index_cache.shape[1], max_context,
        H=heads, BLOCK_H=max(16, triton.next_power_of_2(heads)), D=d, BLOCK_S=block_s, PAGE=PAGE_SIZE,
    )
    return out
