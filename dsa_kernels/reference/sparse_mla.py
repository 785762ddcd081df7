"""Sparse MLA prefill attention in absorbed form, over a bf16 or an fp8-layout (656-byte) cache."""

from __future__ import annotations

import torch

from dsa_kernels.reference.mla_kv import unpack_mla_kv


def gather_rows(kv_cache: torch.Tensor, indices: torch.Tensor, valid: torch.Tensor, kv_lora_rank: int) -> torch.Tensor:
    """The rows ``indices [T, K]`` as fp32 ``[T, K, L + R]`` (latent ++ rope), 0 where not ``valid``.

    fp8 layout (a uint8 cache): only the gathered rows are dequantized (``unpack_mla_kv``: e4m3 byte
    x its tile's fp32 scale, bf16 rope), never the whole cache. An invalid index reads row 0 and is
    zeroed after: a pool's unused rows may hold any bytes (e4m3 NaN, an inf scale), which must not leak.
    """
    safe = torch.where(valid, indices, 0).long()  # [T, K]
    if kv_cache.dtype != torch.uint8:  # bf16 (or an fp16 / fp32 cache, which the contract admits)
        kv = kv_cache[safe].float()
    else:
        kv_c, k_pe = unpack_mla_kv(kv_cache, safe.reshape(-1), kv_lora_rank)
        kv = torch.cat([kv_c, k_pe], dim=-1).view(*safe.shape, kv_c.shape[1] + k_pe.shape[1])
    return kv.masked_fill(~valid[..., None], 0.0)


def sparse_mla_prefill(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    kv_lora_rank: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query token ``t`` and head ``h``, attention over the cache rows ``indices[t]``.

    q ``[T, H, L + R]`` (absorbed latent query ++ rope query); kv_cache either ``[S, L + R]`` bf16,
    or ``[S, L + 4L/128 + 2R]`` uint8 in the fp8 layout of ``dsa_kernels.layout`` (e4m3 latent,
    fp32 scale per 128 latent elements, bf16 rope; 656 B at 512 + 64), whose rows are dequantized
    to fp32 as gathered; values are the first ``L`` columns of the same (dequantized) rows.
    indices ``[T, K]`` int32 cache slots;
    an index outside ``[0, S)`` (the -1 padding, or past the cache) is skipped, as FlashMLA masks it
    (``flash_mla/flash_mla_interface.py``, ``flash_mla_sparse_fwd``: "-1 or >= s_kv" is invalid).
    ``p = softmax(sm_scale * q . kv)`` over valid rows;
    returns ``out [T, H, L]`` fp32 = ``p @ kv[:, :L]`` and ``lse [T, H]`` fp32.

    lse convention (ours, every backend): natural log; a row with no valid index gives ``out = 0``
    and ``lse = -inf`` (log of an empty sum). FlashMLA differs on both counts — base 2 in its
    legacy mode, ``+inf`` for an empty row — and ``dsa_kernels.vendor`` converts at the boundary.
    """
    valid = (indices >= 0) & (indices < kv_cache.shape[0])  # [T, K]
    kv = gather_rows(kv_cache, indices, valid, kv_lora_rank)  # [T, K, L + R] fp32
    logits = torch.einsum("thd,tkd->thk", q.float(), kv) * sm_scale
    logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)  # [T, H]
    p = torch.exp(logits - lse[..., None]).nan_to_num(0.0)
    out = torch.einsum("thk,tkl->thl", p, kv[..., :kv_lora_rank])
    return out, lse
