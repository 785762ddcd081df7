"""Sparse MLA prefill attention in absorbed form."""

from __future__ import annotations

import torch


def sparse_mla_prefill(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    kv_lora_rank: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query token ``t`` and head ``h``, attention over the cache rows ``indices[t]``.

    q ``[T, H, L + R]`` (absorbed latent query ++ rope query); kv_cache ``[S, L + R]`` bf16
    (values are the first ``L`` columns of the same rows); indices ``[T, K]`` int32 cache slots;
    an index outside ``[0, S)`` (the -1 padding, or past the cache) is skipped, as FlashMLA masks it
    (``flash_mla/flash_mla_interface.py``, ``flash_mla_sparse_fwd``: "-1 or >= s_kv" is invalid).
    ``p = softmax(sm_scale * q . kv)`` over valid rows;
    returns ``out [T, H, L]`` fp32 = ``p @ kv[:, :L]`` and ``lse [T, H]`` fp32.

    lse convention (ours, every backend): natural log; a row with no valid index gives ``out = 0``
    and ``lse = -inf`` (log of an empty sum). FlashMLA differs on both counts — base 2 in its
    legacy mode, ``+inf`` for an empty row — and ``dsa_kernels.vendor`` converts at the boundary.
    """
    valid = (indices >= 0) & (indices < kv_cache.shape[0])  # [T, K]
    kv = kv_cache[torch.where(valid, indices, 0).long()].float()  # [T, K, L + R]
    kv = kv.masked_fill(~valid[..., None], 0.0)  # skipped rows must not leak NaN/inf through 0 * x
    logits = torch.einsum("thd,tkd->thk", q.float(), kv) * sm_scale
    logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)  # [T, H]
    p = torch.exp(logits - lse[..., None]).nan_to_num(0.0)
    out = torch.einsum("thk,tkl->thl", p, kv[..., :kv_lora_rank])
    return out, lse
