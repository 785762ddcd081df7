"""Indexer keys <-> paged fp8 layout (64 keys of D e4m3 bytes, then 64 fp32 ue8m0 scales, per page).

Both kernels read or write e4m3: sm89+ on CUDA (``fp8_gate``, checked before launch)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsa_kernels import contract
from dsa_kernels.layout import AMAX_FLOOR, FP8_DTYPE, FP8_MAX, PAGE_SIZE
from dsa_kernels.triton_ops.fp8_gate import require_e4m3
from dsa_kernels.triton_ops.offsets import as_offset, wide
from dsa_kernels.triton_ops.rounding import round_to_e4m3


@triton.jit
def ue8m0_scale(amax, FMAX: tl.constexpr, FLOOR: tl.constexpr):
    """``2 ** ceil(log2(max(amax, FLOOR) * fp32(1 / FMAX)))`` from the fp32 bits (no approximate log2/exp2)."""
    x = tl.maximum(amax, FLOOR) * (1.0 / FMAX)
    bits = x.to(tl.int32, bitcast=True)
    exp = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    return ((exp + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _quantize_index_keys_kernel(
    keys_ptr, cache_f8_ptr, cache_f32_ptr, slots_ptr,
    stride_keys, page_bytes,
    D: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr, FMAX: tl.constexpr, FLOOR: tl.constexpr,
    WIDE: tl.constexpr,
):
    row = as_offset(tl.program_id(0), WIDE)
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    # 1. per-token power-of-two scale from the fp32 amax
    x = tl.load(keys_ptr + row * stride_keys + d, mask=dmask, other=0.0).to(tl.float32)  # [BLOCK_D]
    scale = ue8m0_scale(tl.max(tl.abs(x), axis=0), FMAX, FLOOR)
    # 2. IEEE division (exact here: the scale is a power of two), saturated like the reference and
    #    rounded onto the e4m3 grid here, so the cast below is exact on any converter (rounding.py)
    y = round_to_e4m3(tl.math.div_rn(x, scale), FMAX)
    # 3. key bytes at page * page_bytes + off * D, scale at page * page_bytes + PAGE * D + 4 * off
    slot = tl.load(slots_ptr + row).to(tl.int64)
    page, off = slot // PAGE, slot % PAGE
    base = page * page_bytes
    tl.store(cache_f8_ptr + base + off * D + d, y.to(cache_f8_ptr.dtype.element_ty), mask=dmask)
    tl.store(cache_f32_ptr + (base + PAGE * D) // 4 + off, scale)


@triton.jit
def _dequantize_index_keys_kernel(
    cache_f8_ptr, cache_f32_ptr, slots_ptr, out_ptr, page_bytes,
    D: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr, WIDE: tl.constexpr,
):
    row = as_offset(tl.program_id(0), WIDE)
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    slot = tl.load(slots_ptr + row).to(tl.int64)
    page, off = slot // PAGE, slot % PAGE
    base = page * page_bytes
    k = tl.load(cache_f8_ptr + base + off * D + d, mask=dmask, other=0.0).to(tl.float32)  # [BLOCK_D]
    scale = tl.load(cache_f32_ptr + (base + PAGE * D) // 4 + off)
    tl.store(out_ptr + row * D + d, k * scale, mask=dmask)


def quantize_index_keys(keys: torch.Tensor, index_cache: torch.Tensor, slots: torch.Tensor) -> None:
    """Write ``keys [n, D]`` (fp32/bf16/fp16) as e4m3 + fp32 scale into ``index_cache`` at ``slots [n]``."""
    d = contract.quantize_index_keys(keys, index_cache, slots)
    require_e4m3("quantize_index_keys", index_cache)
    if keys.shape[0] == 0:
        return
    _quantize_index_keys_kernel[(keys.shape[0],)](
        keys, index_cache.view(FP8_DTYPE), index_cache.view(torch.float32), slots,
        keys.stride(0), index_cache.shape[1],
        D=d, BLOCK_D=triton.next_power_of_2(d), PAGE=PAGE_SIZE, FMAX=FP8_MAX, FLOOR=AMAX_FLOOR, WIDE=wide(),
    )


def dequantize_index_keys(index_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Read the keys at ``slots [n]`` as fp32 ``[n, D]``."""
    d = contract.dequantize_index_keys(index_cache, slots)
    require_e4m3("dequantize_index_keys", index_cache)
    out = torch.empty(slots.shape[0], d, dtype=torch.float32, device=index_cache.device)
    if slots.shape[0]:
        _dequantize_index_keys_kernel[(slots.shape[0],)](
            index_cache.view(FP8_DTYPE), index_cache.view(torch.float32), slots, out, index_cache.shape[1],
            D=d, BLOCK_D=triton.next_power_of_2(d), PAGE=PAGE_SIZE, WIDE=wide(),
        )
    return out
