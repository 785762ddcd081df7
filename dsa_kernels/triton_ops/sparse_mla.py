"""Sparse MLA prefill attention, absorbed form, over cache rows chosen by top-k indices.

On a GPU the dots take bf16 operands (the bf16 cache as stored, q and the probabilities rounded to
bf16, as FlashMLA does) with fp32 accumulation; under the interpreter everything stays fp32.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from dsa_kernels import contract
from dsa_kernels.triton_ops.offsets import as_offset, wide
from dsa_kernels.triton_ops.rounding import to_bf16
from lsconfig import envs


@triton.jit
def _sparse_mla_prefill_kernel(
    q_ptr, kv_ptr, idx_ptr, out_ptr, lse_ptr,
    stride_qt, stride_qh, stride_kv, stride_it, stride_ot, stride_oh, topk, n_rows, sm_scale,
    H: tl.constexpr, BLOCK_H: tl.constexpr, L: tl.constexpr, R: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr, DOT_BF16: tl.constexpr, OUT_BF16: tl.constexpr, WIDE: tl.constexpr,
):
    t = as_offset(tl.program_id(0), WIDE)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = h < H
    c = tl.arange(0, L)
    r = tl.arange(0, BLOCK_R)
    # operands of tl.dot: bf16 on a GPU (tensor cores, fp32 accumulation), fp32 in the interpreter,
    # whose bf16 arithmetic is wrong
    op_ty = tl.bfloat16 if DOT_BF16 else tl.float32
    q_row = q_ptr + t * stride_qt + h[:, None] * stride_qh
    q_lat = tl.load(q_row + c[None, :], mask=hmask[:, None], other=0.0).to(op_ty)  # [BLOCK_H, L]
    q_pe = tl.load(q_row + L + r[None, :], mask=hmask[:, None] & (r[None, :] < R), other=0.0).to(op_ty)
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, L], tl.float32)
    for k0 in range(0, topk, BLOCK_K):
        # 1. gather the selected rows; an index outside [0, n_rows) (-1 padding included) and the
        #    tail past topk are masked out, as FlashMLA does
        k = k0 + tl.arange(0, BLOCK_K)
        idx = tl.load(idx_ptr + t * stride_it + k, mask=k < topk, other=-1).to(tl.int64)
        valid = (idx >= 0) & (idx < n_rows)
        row = kv_ptr + tl.where(valid, idx, 0) * stride_kv
        kv_lat = tl.load(row[:, None] + c[None, :], mask=valid[:, None], other=0.0).to(op_ty)  # [BLOCK_K, L]
        kv_pe = tl.load(row[:, None] + L + r[None, :], mask=valid[:, None] & (r[None, :] < R), other=0.0).to(op_ty)
        # 2. scores [BLOCK_H, BLOCK_K], fp32
        s = (tl.dot(q_lat, tl.trans(kv_lat)) + tl.dot(q_pe, tl.trans(kv_pe))) * sm_scale
        s = tl.where(valid[None, :], s, float("-inf"))
        # 3. online softmax; a head that has seen no valid row keeps m = -inf, so shift by 0 there
        m_new = tl.maximum(m, tl.max(s, axis=1))
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - shift)
        p = tl.exp(s - shift[:, None])
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(op_ty), kv_lat)
        m = m_new
    # 4. normalise; rows with no valid index give out = 0, lse = -inf (our contract; FlashMLA: +inf)
    has = l_sum > 0
    out = acc / tl.where(has, l_sum, 1.0)[:, None]
    lse = tl.where(has, m + tl.log(tl.where(has, l_sum, 1.0)), float("-inf"))
    if OUT_BF16:  # rounded to nearest even from the bits: the interpreter's own fp32 -> bf16 cast truncates
        out_store = to_bf16(out)
    else:
        out_store = out.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + t * stride_ot + h[:, None] * stride_oh + c[None, :], out_store, mask=hmask[:, None])
    tl.store(lse_ptr + t * H + h, lse, mask=hmask)


def sparse_mla_prefill(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    kv_lora_rank: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``out [T, H, L]`` (q's dtype) and ``lse [T, H]`` fp32; shapes as the reference."""
    contract.sparse_mla_prefill(q, kv_cache, indices, sm_scale, kv_lora_rank)
    dev = kv_cache.device
    t_count, heads, width = q.shape
    lat = kv_lora_rank
    out = torch.empty(t_count, heads, lat, dtype=q.dtype, device=dev)
    lse = torch.empty(t_count, heads, dtype=torch.float32, device=dev)
    if t_count == 0:
        return out, lse
    rope = width - lat
    block_h = 16  # 16 heads x L fp32 accumulators per program keeps registers bounded at L = 512
    _sparse_mla_prefill_kernel[(t_count, triton.cdiv(heads, block_h))](
        q, kv_cache, indices, out, lse,
        q.stride(0), q.stride(1), kv_cache.stride(0), indices.stride(0), out.stride(0), out.stride(1),
        indices.shape[1], kv_cache.shape[0], float(sm_scale),
        H=heads, BLOCK_H=block_h, L=lat, R=rope, BLOCK_R=max(16, triton.next_power_of_2(rope)), BLOCK_K=32,
        DOT_BF16=not envs.triton_interpret() and kv_cache.dtype == torch.bfloat16,
        OUT_BF16=q.dtype == torch.bfloat16, WIDE=wide(),
    )
    return out, lse


def default_sm_scale(qk_head_dim: int) -> float:
    """``1 / sqrt(nope + rope)`` — the softmax scale of the un-absorbed attention."""
    return 1.0 / math.sqrt(qk_head_dim)
