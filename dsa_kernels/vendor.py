"""Adapters from vendor CUDA kernels to our op signatures (imported lazily by dispatch).

Only ops whose vendor semantics match ours exactly are adapted; the rest fall back to Triton.
Correctness of these adapters is checked on a GPU by the GPU check against the torch reference.
"""

from __future__ import annotations

import math

import torch


def sparse_mla_prefill(
    q: torch.Tensor, kv_cache: torch.Tensor, indices: torch.Tensor, sm_scale: float, kv_lora_rank: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashMLA sparse prefill (``sgl_kernel.flash_mla_sparse_fwd``): bf16 q/kv, int32 indices.

    The kernel takes ``kv [S, 1, L + R]`` and ``indices [T, 1, K]`` and returns a base-2 lse in its
    legacy mode; we convert it to the natural log our contract uses.
    """
    from sgl_kernel import flash_mla_sparse_fwd

    out, _, lse2 = flash_mla_sparse_fwd(
        q.contiguous(), kv_cache.unsqueeze(1), indices.to(torch.int32).unsqueeze(1), sm_scale, kv_lora_rank
    )
    return out, lse2.float() * math.log(2.0)


def available() -> dict[str, object]:
    """Vendor ops importable here, by op name (empty on CPU or without the ``gpu`` extra)."""
    if not torch.cuda.is_available():
        return {}
    try:
        import sgl_kernel  # noqa: F401

        has_flash_mla = hasattr(sgl_kernel, "flash_mla_sparse_fwd")
    except Exception:  # a GPU wheel can fail at import for many reasons: fall back, never crash
        has_flash_mla = False
    return {"sparse_mla_prefill": sparse_mla_prefill} if has_flash_mla else {}
