"""MLA latent rows <-> bf16 (L + R elements) or fp8 (L e4m3 + L/128 fp32 + R bf16) cache rows.

The fp8 layout's kernels read or write e4m3: sm89+ on CUDA (``fp8_gate``, checked before launch);
the bf16 layout's have no e4m3 and run on any CUDA device."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsa_kernels import contract
from dsa_kernels.layout import FP8_DTYPE, FP8_MAX, FP8_TILE, kv_dtype_of
from dsa_kernels.triton_ops.fp8_gate import require_e4m3
from dsa_kernels.triton_ops.offsets import as_offset, wide
from dsa_kernels.triton_ops.rounding import round_to_e4m3, to_bf16


@triton.jit
def _pack_mla_kv_kernel(
    kv_c_ptr, k_pe_ptr, slots_ptr, row_ptr, row_f32_ptr, row_bf16_ptr,
    stride_c, stride_pe, row_bytes,
    L: tl.constexpr, R: tl.constexpr, BLOCK_R: tl.constexpr,
    FP8: tl.constexpr, TILE: tl.constexpr, N_TILES: tl.constexpr, FMAX: tl.constexpr, WIDE: tl.constexpr,
):
    i = as_offset(tl.program_id(0), WIDE)
    slot = tl.load(slots_ptr + i).to(tl.int64)
    r = tl.arange(0, BLOCK_R)
    pe = tl.load(k_pe_ptr + i * stride_pe + r, mask=r < R, other=0.0).to(tl.float32)  # [BLOCK_R]
    if FP8:
        # 1. latent: one scale per TILE elements, bytes [0, L)
        tile = tl.arange(0, N_TILES)[:, None] * TILE + tl.arange(0, TILE)[None, :]  # [N_TILES, TILE]
        x = tl.load(kv_c_ptr + i * stride_c + tile).to(tl.float32)
        # IEEE divisions (not the approximate div.full.f32 of `/`) so GPU bytes equal the torch
        # reference's, for the scale as for the scaled values
        scale = tl.math.div_rn(tl.max(tl.abs(x), axis=1), tl.full([N_TILES], FMAX, tl.float32))  # [N_TILES]
        safe = tl.where(scale > 0, scale, 1.0)
        # |x / scale| <= 448 up to one rounding; onto the e4m3 grid here, so the cast is exact anywhere
        y = round_to_e4m3(tl.math.div_rn(x, safe[:, None]), FMAX)
        tl.store(row_ptr + slot * row_bytes + tile, y.to(row_ptr.dtype.element_ty))
        # 2. scales as fp32 at bytes [L, L + 4 * N_TILES)
        tl.store(row_f32_ptr + (slot * row_bytes + L) // 4 + tl.arange(0, N_TILES), scale)
        # 3. rope as bf16 at bytes [L + 4 * N_TILES, row_bytes)
        pe_base = (slot * row_bytes + L + 4 * N_TILES) // 2
        tl.store(row_bf16_ptr + pe_base + r, to_bf16(pe), mask=r < R)
    else:
        # bf16 row = latent ++ rope, row_bytes // 2 elements per row
        for c0 in tl.static_range(0, L, TILE):
            c = c0 + tl.arange(0, TILE)
            x = tl.load(kv_c_ptr + i * stride_c + c, mask=c < L, other=0.0).to(tl.float32)
            tl.store(row_bf16_ptr + slot * (row_bytes // 2) + c, to_bf16(x), mask=c < L)
        tl.store(row_bf16_ptr + slot * (row_bytes // 2) + L + r, to_bf16(pe), mask=r < R)


@triton.jit
def _unpack_mla_kv_kernel(
    slots_ptr, row_ptr, row_f32_ptr, row_bf16_ptr, kv_c_ptr, k_pe_ptr, row_bytes,
    L: tl.constexpr, R: tl.constexpr, BLOCK_R: tl.constexpr,
    FP8: tl.constexpr, TILE: tl.constexpr, N_TILES: tl.constexpr, WIDE: tl.constexpr,
):
    i = as_offset(tl.program_id(0), WIDE)
    slot = tl.load(slots_ptr + i).to(tl.int64)
    r = tl.arange(0, BLOCK_R)
    if FP8:
        tile = tl.arange(0, N_TILES)[:, None] * TILE + tl.arange(0, TILE)[None, :]  # [N_TILES, TILE]
        q = tl.load(row_ptr + slot * row_bytes + tile).to(tl.float32)
        scale = tl.load(row_f32_ptr + (slot * row_bytes + L) // 4 + tl.arange(0, N_TILES))
        tl.store(kv_c_ptr + i * L + tile, q * scale[:, None])
        pe_base = (slot * row_bytes + L + 4 * N_TILES) // 2
    else:
        for c0 in tl.static_range(0, L, TILE):
            c = c0 + tl.arange(0, TILE)
            x = tl.load(row_bf16_ptr + slot * (row_bytes // 2) + c, mask=c < L, other=0.0).to(tl.float32)
            tl.store(kv_c_ptr + i * L + c, x, mask=c < L)
        pe_base = slot * (row_bytes // 2) + L
    pe = tl.load(row_bf16_ptr + pe_base + r, mask=r < R, other=0.0).to(tl.float32)
    tl.store(k_pe_ptr + i * R + r, pe, mask=r < R)


def _views(op: str, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, bool]:
    """``(row, row_f32, row_bf16, row_bytes, fp8)`` views of the cache's bytes. Only the fp8 layout
    passes an e4m3 pointer, so only it needs sm89+ (gated here, before any launch): a bf16 cache's
    unused ``row`` / ``row_f32`` are its uint8 bytes, since an e4m3 pointer argument alone fails to
    compile below sm89."""
    fp8 = kv_dtype_of(kv_cache) == "fp8"
    raw = kv_cache.view(torch.uint8)
    if fp8:
        require_e4m3(op, kv_cache)
        return raw.view(FP8_DTYPE), raw.view(torch.float32), raw.view(torch.bfloat16), raw.shape[1], True
    return raw, raw, raw.view(torch.bfloat16), raw.shape[1], False


def pack_mla_kv(kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor) -> None:
    """Write ``kv_c [n, L]`` and ``k_pe [n, R]`` into ``kv_cache`` rows ``slots [n]`` (bf16 or fp8 layout)."""
    contract.pack_mla_kv(kv_c, k_pe, kv_cache, slots)
    lat, rope = kv_c.shape[1], k_pe.shape[1]
    row, row_f32, row_bf16, row_bytes, fp8 = _views("pack_mla_kv", kv_cache)
    if kv_c.shape[0] == 0:
        return
    tile = FP8_TILE if fp8 else min(FP8_TILE, triton.next_power_of_2(lat))
    _pack_mla_kv_kernel[(kv_c.shape[0],)](
        kv_c, k_pe, slots, row, row_f32, row_bf16, kv_c.stride(0), k_pe.stride(0), row_bytes,
        L=lat, R=rope, BLOCK_R=triton.next_power_of_2(rope),
        FP8=fp8, TILE=tile, N_TILES=max(1, lat // FP8_TILE), FMAX=FP8_MAX, WIDE=wide(),
    )


def unpack_mla_kv(kv_cache: torch.Tensor, slots: torch.Tensor, kv_lora_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Read rows ``slots [n]`` as fp32 ``(kv_c [n, L], k_pe [n, R])``."""
    rope = contract.unpack_mla_kv(kv_cache, slots, kv_lora_rank)
    row, row_f32, row_bf16, row_bytes, fp8 = _views("unpack_mla_kv", kv_cache)
    lat = kv_lora_rank
    n = slots.shape[0]
    kv_c = torch.empty(n, lat, dtype=torch.float32, device=kv_cache.device)
    k_pe = torch.empty(n, rope, dtype=torch.float32, device=kv_cache.device)
    if n:
        _unpack_mla_kv_kernel[(n,)](
            slots, row, row_f32, row_bf16, kv_c, k_pe, row_bytes,
            L=lat, R=rope, BLOCK_R=triton.next_power_of_2(rope),
            FP8=fp8, TILE=FP8_TILE if fp8 else min(FP8_TILE, triton.next_power_of_2(lat)),
            N_TILES=max(1, lat // FP8_TILE), WIDE=wide(),
        )
    return kv_c, k_pe
