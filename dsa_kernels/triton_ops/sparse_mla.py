"""Sparse MLA prefill attention, absorbed form, over cache rows chosen by top-k indices.

Two caches (``dsa_kernels.layout``): bf16 rows ``[S, L + R]``, or fp8-layout rows ``[S, row_bytes]``
uint8, dequantized in registers as they are gathered (e4m3 latent bytes x their 128-tile's fp32
scale, bf16 rope): no dequantize pass over the cache, no bf16 copy of it.

On a GPU the dots take bf16 operands (the bf16 cache as stored or the fp8 rows dequantized to bf16,
q and the probabilities rounded to bf16, as FlashMLA does) with fp32 accumulation; under the
interpreter everything stays fp32.

The fp8 path reads e4m3 as ``tl.float8e4nv``, which compiles on sm89+ only: the launcher refuses a
uint8 cache on an older CUDA device before any launch (``fp8_gate``; the Triton backend and the
vendor adapter's fallback both pass through it), and launches the fp8 path with ``FP8_NUM_WARPS``
warps (register spills, see there). The bf16 path has no e4m3 and runs on any CUDA device.

Grid: ``(T, cdiv(H, BLOCK_H))``: each program gathers every selected row of its token for its
``BLOCK_H`` heads, so a token's rows are loaded ``cdiv(H, BLOCK_H)`` times (4 at H = 64; repeats may
hit L2). The GPU check counts its bytes read that way.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from dsa_kernels import contract
from dsa_kernels.layout import FP8_TILE
from dsa_kernels.triton_ops.fp8_gate import require_e4m3
from dsa_kernels.triton_ops.offsets import as_offset, wide
from dsa_kernels.triton_ops.rounding import to_bf16
from lsconfig import envs

BLOCK_H = 16  # heads per program: 16 x L fp32 accumulators keep registers bounded at L = 512
# ptxas on sm90, fp8 path at 4 warps: 255 registers with 220 B of spill stores / 204 B of spill loads
# (the gathered [BLOCK_K, N_TILES, TILE] bytes, their scales and the dequantized rows are live at once);
# at 8 warps each thread holds half of them: 12 / 8 B. The bf16 path keeps Triton's default.
FP8_NUM_WARPS = 8
BF16_NUM_WARPS = 4


@triton.jit
def _load_rows_bf16(kv_ptr, safe, valid, stride_kv, r, L: tl.constexpr, R: tl.constexpr):
    """Rows ``safe [BLOCK_K]`` of a ``[S, L + R]`` cache: ``(latent [BLOCK_K, L], rope [BLOCK_K, BLOCK_R])``
    fp32, 0 where not ``valid``."""
    c = tl.arange(0, L)
    row = kv_ptr + safe * stride_kv
    kv_lat = tl.load(row[:, None] + c[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
    kv_pe = tl.load(row[:, None] + L + r[None, :], mask=valid[:, None] & (r[None, :] < R), other=0.0).to(tl.float32)
    return kv_lat, kv_pe


@triton.jit
def _load_rows_fp8(kv_u8_ptr, kv_bf16_ptr, safe, valid, row_bytes, r, L: tl.constexpr, R: tl.constexpr,
                   TILE: tl.constexpr, N_TILES: tl.constexpr, BLOCK_K: tl.constexpr):
    """Rows ``safe [BLOCK_K]`` of an fp8-layout cache, dequantized: ``(latent [BLOCK_K, L], rope
    [BLOCK_K, BLOCK_R])`` fp32, 0 where not ``valid``. Row bytes: ``[0, L)`` e4m3, ``[L, L + 4 N_TILES)``
    fp32 scales, then ``R`` bf16."""
    base = safe * row_bytes  # [BLOCK_K] byte offsets, int64
    j = tl.arange(0, N_TILES)
    # 1. latent bytes as [BLOCK_K, N_TILES, TILE] (a tile's values beside its scale), loaded as uint8
    #    and reinterpreted: no fp8 constant for the masked lanes, every e4m3 -> fp32 conversion exact
    e = j[:, None] * TILE + tl.arange(0, TILE)[None, :]  # [N_TILES, TILE]
    x = tl.load(kv_u8_ptr + base[:, None, None] + e[None, :, :], mask=valid[:, None, None], other=0)
    x = x.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    # 2. scales from their 4 little-endian bytes: a row starts 4-byte aligned only when 2R % 4 == 0,
    #    so an fp32 view of the cache is not always possible; 4 byte loads always are
    s_at = kv_u8_ptr + base[:, None] + L + 4 * j[None, :]  # [BLOCK_K, N_TILES]
    bits = tl.zeros([BLOCK_K, N_TILES], tl.uint32)
    for b in tl.static_range(4):
        bits |= tl.load(s_at + b, mask=valid[:, None], other=0).to(tl.uint32) << (8 * b)
    scale = bits.to(tl.float32, bitcast=True)
    kv_lat = tl.reshape(x * scale[:, :, None], (BLOCK_K, L))
    # 3. rope, bf16 at byte L + 4 N_TILES (even: row_bytes is even, so the bf16 view holds every row)
    pe_at = kv_bf16_ptr + (base + L + 4 * N_TILES) // 2
    kv_pe = tl.load(pe_at[:, None] + r[None, :], mask=valid[:, None] & (r[None, :] < R), other=0.0).to(tl.float32)
    # a valid row's NaN stays (the data is bad); an invalid row is 0 whatever row 0 holds (loads masked)
    return kv_lat, kv_pe


@triton.jit
def _sparse_mla_prefill_kernel(
    q_ptr, kv_ptr, kv_bf16_ptr, idx_ptr, out_ptr, lse_ptr,
    stride_qt, stride_qh, stride_kv, stride_it, stride_ot, stride_oh, topk, n_rows, sm_scale,
    H: tl.constexpr, BLOCK_H: tl.constexpr, L: tl.constexpr, R: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr, FP8: tl.constexpr, TILE: tl.constexpr, N_TILES: tl.constexpr,
    DOT_BF16: tl.constexpr, OUT_BF16: tl.constexpr, WIDE: tl.constexpr,
):
    """``kv_ptr``: the bf16 (fp16, fp32) cache, or the uint8 fp8-layout cache (``FP8``), whose rope is
    read through its bf16 view ``kv_bf16_ptr``; ``stride_kv`` is then the row's bytes."""
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
        safe = tl.where(valid, idx, 0)
        if FP8:
            kv_lat, kv_pe = _load_rows_fp8(kv_ptr, kv_bf16_ptr, safe, valid, stride_kv, r, L, R, TILE, N_TILES,
                                           BLOCK_K)
        else:
            kv_lat, kv_pe = _load_rows_bf16(kv_ptr, safe, valid, stride_kv, r, L, R)
        kv_lat = kv_lat.to(op_ty)  # [BLOCK_K, L]
        kv_pe = kv_pe.to(op_ty)  # [BLOCK_K, BLOCK_R]
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
    """``out [T, H, L]`` (q's dtype) and ``lse [T, H]`` fp32; shapes, the bf16 or fp8-layout (uint8)
    cache and the masking as the reference (``reference.sparse_mla``)."""
    contract.sparse_mla_prefill(q, kv_cache, indices, sm_scale, kv_lora_rank)
    fp8 = kv_cache.dtype == torch.uint8
    if fp8:
        require_e4m3("sparse_mla_prefill", kv_cache)
    dev = kv_cache.device
    t_count, heads, width = q.shape
    lat = kv_lora_rank
    out = torch.empty(t_count, heads, lat, dtype=q.dtype, device=dev)
    lse = torch.empty(t_count, heads, dtype=torch.float32, device=dev)
    if t_count == 0:
        return out, lse
    rope = width - lat
    # the fp8 layout's rope through a bf16 view (rows have an even byte count); unused otherwise
    kv_bf16 = kv_cache.view(torch.bfloat16) if fp8 else kv_cache
    _sparse_mla_prefill_kernel[(t_count, triton.cdiv(heads, BLOCK_H))](
        q, kv_cache, kv_bf16, indices, out, lse,
        q.stride(0), q.stride(1), kv_cache.stride(0), indices.stride(0), out.stride(0), out.stride(1),
        indices.shape[1], kv_cache.shape[0], float(sm_scale),
        H=heads, BLOCK_H=BLOCK_H, L=lat, R=rope, BLOCK_R=max(16, triton.next_power_of_2(rope)), BLOCK_K=32,
        FP8=fp8, TILE=FP8_TILE, N_TILES=max(1, lat // FP8_TILE),
        DOT_BF16=not envs.triton_interpret() and kv_cache.dtype in (torch.bfloat16, torch.uint8),
        OUT_BF16=q.dtype == torch.bfloat16, WIDE=wide(), num_warps=FP8_NUM_WARPS if fp8 else BF16_NUM_WARPS,
    )
    return out, lse


def default_sm_scale(qk_head_dim: int) -> float:
    """``1 / sqrt(nope + rope)`` — the softmax scale of the un-absorbed attention."""
    return 1.0 / math.sqrt(qk_head_dim)
