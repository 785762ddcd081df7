"""Lightning-indexer scores over paged fp8 index keys, for one range of context columns.

Semantics as ``dsa_kernels.reference.indexer`` (DeepSeek-V3.2's ``fp8_index``): the query heads are
e4m3 with their scale folded into the head weights, the keys e4m3 with one ue8m0 scale each. The
fp8 values are exact in bf16, so on a GPU ``tl.dot`` runs on bf16 operands (exact products, fp32
accumulation); the interpreter (CPU) has no correct bf16 arithmetic and dots in fp32 instead. e4m3 keys
and queries: sm89+ on CUDA (``fp8_gate``, checked before launch).
Top-k is a separate op (``dsa_kernels.indexer_topk`` merges column chunks).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsa_kernels import contract
from dsa_kernels.layout import FP8_DTYPE, PAGE_SIZE
from dsa_kernels.reference.indexer import _as_quantized
from dsa_kernels.triton_ops.fp8_gate import require_e4m3
from dsa_kernels.triton_ops.offsets import as_offset, wide
from lsconfig import envs


@triton.jit
def _indexer_scores_kernel(
    q_ptr, w_ptr, cache_f8_ptr, cache_f32_ptr, page_table_ptr, req_ptr, pos_ptr, out_ptr,
    stride_qt, stride_qh, stride_wt, stride_pt, stride_ot, page_bytes, s_start, s_end,
    H: tl.constexpr, BLOCK_H: tl.constexpr, D: tl.constexpr, BLOCK_S: tl.constexpr, PAGE: tl.constexpr,
    DOT_BF16: tl.constexpr, WIDE: tl.constexpr,
):
    t = as_offset(tl.program_id(0), WIDE)
    j = as_offset(tl.program_id(1), WIDE) * BLOCK_S + tl.arange(0, BLOCK_S)  # [BLOCK_S] output column
    s = s_start + j  # context position
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, D)
    b = tl.load(req_ptr + t).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    valid = (s <= pos) & (s < s_end)  # causal mask
    # 1. token s of request b -> page and byte offsets of its key and scale
    page = tl.load(page_table_ptr + b * stride_pt + s // PAGE, mask=valid, other=0).to(tl.int64)
    base = page * page_bytes
    k = tl.load(cache_f8_ptr + base[:, None] + (s % PAGE)[:, None] * D + d[None, :],
                mask=valid[:, None], other=0.0)  # [BLOCK_S, D] e4m3
    k_scale = tl.load(cache_f32_ptr + (base + PAGE * D) // 4 + s % PAGE, mask=valid, other=0.0)  # [BLOCK_S]
    # 2. per-head fp8 logits (q's scale lives in w), fp32 accumulation
    q = tl.load(q_ptr + t * stride_qt + h[:, None] * stride_qh + d[None, :], mask=h[:, None] < H, other=0.0)
    if DOT_BF16:
        logits = tl.dot(q.to(tl.bfloat16), tl.trans(k.to(tl.bfloat16)))  # [BLOCK_H, BLOCK_S]
    else:
        logits = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)))
    w = tl.load(w_ptr + t * stride_wt + h, mask=h < H, other=0.0)  # [BLOCK_H] fp32
    # 3. weighted head sum, then the key scale; masked positions -> -inf
    score = tl.sum(tl.maximum(logits, 0.0) * w[:, None], axis=0) * k_scale  # [BLOCK_S]
    score = tl.where(valid, score, float("-inf"))
    tl.store(out_ptr + t * stride_ot + j, score, mask=s < s_end)


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
    """fp32 ``[T, max_context - s_start]`` scores of columns ``[s_start, max_context)``, ``-inf`` where
    ``s > positions[t]``; arguments as the reference (raw or already quantized ``q``)."""
    d = contract.indexer_scores(q, weights, index_cache, page_table, req_idx, positions, max_context, s_start)
    require_e4m3("indexer_scores", index_cache)
    q_fp8, w = _as_quantized(q, weights)
    w = w.contiguous()
    t_count, heads = q_fp8.shape[:2]
    n_cols = max_context - s_start
    out = torch.empty(t_count, n_cols, dtype=torch.float32, device=index_cache.device)
    if t_count == 0 or n_cols == 0:
        return out
    block_s = 64
    _indexer_scores_kernel[(t_count, triton.cdiv(n_cols, block_s))](
        q_fp8, w, index_cache.view(FP8_DTYPE), index_cache.view(torch.float32), page_table, req_idx, positions,
        out, q_fp8.stride(0), q_fp8.stride(1), w.stride(0), page_table.stride(0), out.stride(0),
        index_cache.shape[1], s_start, max_context,
        H=heads, BLOCK_H=max(16, triton.next_power_of_2(heads)), D=d, BLOCK_S=block_s, PAGE=PAGE_SIZE,
        DOT_BF16=not envs.triton_interpret(), WIDE=wide(),
    )
    return out
