"""MLA latent rows <-> bf16 (576-element) or fp8 (656-byte) cache layout (see ``dsa_kernels.layout``)."""

from __future__ import annotations

import torch

from dsa_kernels.layout import FP8_DTYPE, FP8_MAX, FP8_TILE, kv_dtype_of


def pack_mla_kv(kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor) -> None:
    """Write latent ``kv_c [n, L]`` and rope key ``k_pe [n, R]`` into ``kv_cache`` rows ``slots [n]``.

    bf16 cache ``[S, L + R]``: ``row = bf16(kv_c) ++ bf16(k_pe)``.
    fp8 cache ``[S, L + 4L/128 + 2R]`` uint8: ``e4m3(kv_c / s) ++ fp32 s ++ bf16(k_pe)``,
    ``s = amax(|tile|) / 448`` per 128-element tile (0 tiles keep ``s = 0`` and store zeros).
    """
    if kv_dtype_of(kv_cache) == "bf16":
        kv_cache[slots] = torch.cat([kv_c, k_pe], dim=-1).to(torch.bfloat16)
        return
    n, lat = kv_c.shape
    tiles = kv_c.float().view(n, lat // FP8_TILE, FP8_TILE)
    scale = tiles.abs().amax(dim=-1) / FP8_MAX  # [n, L/128]
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = (tiles / safe[..., None]).reshape(n, lat).to(FP8_DTYPE).view(torch.uint8)
    rope = k_pe.to(torch.bfloat16).contiguous().view(torch.uint8)
    kv_cache[slots] = torch.cat([q, scale.contiguous().view(torch.uint8), rope], dim=-1)


def unpack_mla_kv(kv_cache: torch.Tensor, slots: torch.Tensor, kv_lora_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Read rows ``slots [n]`` back as fp32 ``(kv_c [n, L], k_pe [n, R])``."""
    rows = kv_cache[slots]
    lat = kv_lora_rank
    if kv_dtype_of(kv_cache) == "bf16":
        return rows[:, :lat].float(), rows[:, lat:].float()
    n, n_tiles = rows.shape[0], lat // FP8_TILE
    q = rows[:, :lat].contiguous().view(FP8_DTYPE).float().view(n, n_tiles, FP8_TILE)
    scale = rows[:, lat : lat + 4 * n_tiles].contiguous().view(torch.float32)  # [n, L/128]
    rope = rows[:, lat + 4 * n_tiles :].contiguous().view(torch.bfloat16).float()
    return (q * scale[..., None]).reshape(n, lat), rope
