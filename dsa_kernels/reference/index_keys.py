"""Indexer keys <-> paged fp8 layout (see ``dsa_kernels.layout``), and the e4m3 + ue8m0 quantizer
the indexer uses for its keys and its query heads."""

from __future__ import annotations

import torch

from dsa_kernels.layout import AMAX_FLOOR, FP8_DTYPE, FP8_MAX, PAGE_SIZE, index_head_dim_of

# fp32(1 / 448): DeepSeek multiplies the amax by this rounded reciprocal, it does not divide by 448.
# A Python float holding that fp32 value exactly: an fp32 tensor times it computes in fp32 with this
# very factor, on any device, with no per-call host-to-device copy of a constant tensor.
FP8_MAX_INV = torch.tensor(1.0 / FP8_MAX, dtype=torch.float32).item()


def ue8m0_scale(amax: torch.Tensor) -> torch.Tensor:
    """``2 ** ceil(log2(max(amax, 1e-4) * fp32(1/448)))`` in fp32 (a power of two; see ``layout``)."""
    x = amax.float().clamp_min(AMAX_FLOOR) * FP8_MAX_INV
    mant, exp = torch.frexp(x)  # x = mant * 2**exp, mant in [0.5, 1): an exact power of two has mant 0.5
    return torch.ldexp(torch.ones_like(x), torch.where(mant == 0.5, exp - 1, exp))


def quantize_e4m3(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One ue8m0 scale per vector of the last dim: ``(e4m3 [..., D], scale [...] fp32)``.

    ``e4m3 = saturate(x / scale)``: the division by a power of two is exact, the clamp matters only
    where ``fp32(1/448)`` rounded the scale a hair low.
    """
    y = x.to(torch.float32, copy=True)  # one fp32 temporary, divided and clamped in place
    scale = ue8m0_scale(y.abs().amax(dim=-1))
    return y.div_(scale[..., None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def _byte_positions(slots: torch.Tensor, d: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    page, off = slots.long() // PAGE_SIZE, slots.long() % PAGE_SIZE
    key_pos = off[:, None] * d + torch.arange(d, device=slots.device)  # [n, D]
    scale_pos = PAGE_SIZE * d + off[:, None] * 4 + torch.arange(4, device=slots.device)  # [n, 4]
    return page, key_pos, scale_pos


def quantize_index_keys(keys: torch.Tensor, index_cache: torch.Tensor, slots: torch.Tensor) -> None:
    """Write ``keys [n, D]`` into ``index_cache [P, 64 * (D + 4)]`` uint8 at token ``slots [n]``:
    ``key_bytes[t], scale[t] = quantize_e4m3(keys[t])``."""
    d = index_head_dim_of(index_cache)
    key_fp8, scale = quantize_e4m3(keys)
    page, key_pos, scale_pos = _byte_positions(slots, d)
    index_cache[page[:, None], key_pos] = key_fp8.view(torch.uint8)
    index_cache[page[:, None], scale_pos] = scale.contiguous().view(torch.uint8).view(-1, 4)


def read_index_keys(index_cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The stored ``(e4m3 [n, D], scale [n] fp32)`` of ``slots [n]``, not yet multiplied."""
    d = index_head_dim_of(index_cache)
    page, key_pos, scale_pos = _byte_positions(slots, d)
    key_bytes = index_cache[page[:, None], key_pos].contiguous()
    scale = index_cache[page[:, None], scale_pos].contiguous().view(torch.float32)[:, 0]
    return key_bytes.view(FP8_DTYPE), scale


def dequantize_index_keys(index_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Read the keys at ``slots [n]`` back as fp32 ``[n, D]`` (``e4m3 * scale``)."""
    key_fp8, scale = read_index_keys(index_cache, slots)
    return key_fp8.float() * scale[:, None]
