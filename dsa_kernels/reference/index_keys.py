"""Indexer keys <-> paged fp8 layout (see ``dsa_kernels.layout``)."""

from __future__ import annotations

import torch

from dsa_kernels.layout import AMAX_FLOOR, FP8_DTYPE, FP8_MAX, PAGE_SIZE, index_head_dim_of


def quantize_index_keys(keys: torch.Tensor, index_cache: torch.Tensor, slots: torch.Tensor) -> None:
    """Write ``keys [n, D]`` into ``index_cache [P, 64 * (D + 4)]`` uint8 at token ``slots [n]``.

    ``scale[t] = max(amax(|keys[t]|), 1e-4) / 448``; ``key_bytes[t] = e4m3(keys[t] / scale[t])``.
    """
    d = index_head_dim_of(index_cache)
    k = keys.float()
    scale = k.abs().amax(dim=-1).clamp_min(AMAX_FLOOR) / FP8_MAX  # [n]
    key_bytes = (k / scale[:, None]).to(FP8_DTYPE).view(torch.uint8)  # [n, D]
    page, off = slots // PAGE_SIZE, slots % PAGE_SIZE
    key_pos = off[:, None] * d + torch.arange(d, device=slots.device)  # [n, D]
    scale_pos = PAGE_SIZE * d + off[:, None] * 4 + torch.arange(4, device=slots.device)  # [n, 4]
    index_cache[page[:, None], key_pos] = key_bytes
    index_cache[page[:, None], scale_pos] = scale.contiguous().view(torch.uint8).view(-1, 4)


def dequantize_index_keys(index_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Read the keys at ``slots [n]`` back as fp32 ``[n, D]`` (``e4m3 * scale``)."""
    d = index_head_dim_of(index_cache)
    page, off = slots // PAGE_SIZE, slots % PAGE_SIZE
    key_pos = off[:, None] * d + torch.arange(d, device=slots.device)
    scale_pos = PAGE_SIZE * d + off[:, None] * 4 + torch.arange(4, device=slots.device)
    key_bytes = index_cache[page[:, None], key_pos].contiguous()
    scale = index_cache[page[:, None], scale_pos].contiguous().view(torch.float32)  # [n, 1]
    return key_bytes.view(FP8_DTYPE).float() * scale
