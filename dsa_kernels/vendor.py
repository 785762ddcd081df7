"""Vendor CUDA kernels behind per-call gates (imported lazily by ``dsa_kernels.dispatch``).

Each adapter checks every call against what the vendor kernel accepts and, when the call is outside
that, runs the next tier instead (Triton for sparse MLA, the torch reference for top-k) and logs
the reason once. Nothing here can be called with arguments the vendor kernel would misread.

* ``sparse_mla_prefill`` — FlashMLA's sparse prefill (``flash_mla_sparse_fwd`` from ``sgl_kernel``).
  Accepts: CUDA sm90 / sm100; bf16 ``q [T, h_q, d_qk]`` with ``d_qk`` 576 (or 512, no rope);
  ``d_v = kv_lora_rank = 512``; a bf16 cache (the fp8 656-byte layout falls back); heads padded
  with zeros to the kernel's multiple (64 on sm90, 128 on sm100) and ``K`` padded with -1 to a
  multiple of 128. Semantics as FlashMLA's ``flash_mla/flash_mla_interface.py``
  (``flash_mla_sparse_fwd``: an index of -1 or ``>= s_kv`` is invalid) and its README's definition of
  ``out`` / ``max_logits`` / ``lse``. Its lse is converted to our convention (``reference.sparse_mla``: natural log,
  ``-inf`` for a row with no valid index; FlashMLA gives ``+inf`` there). The base of FlashMLA's
  lse changed (base 2 in the legacy kernel, natural log in its 2026 release), so it is measured
  once per installed ``sgl_kernel`` version by ``flash_mla_lse_base`` (also a GPU check case),
  never assumed; an inconclusive probe disables the vendor tier for the op.
* ``topk_indices`` / ``topk_merge`` / ``topk_slots`` — FlashInfer's radix top-k
  (``flashinfer.top_k``) and fused top-k + page-table lookup (``flashinfer.top_k_page_table_transform``,
  over a page-size-1 table), where the installed FlashInfer has them. Same index sets as the
  reference up to ties (FlashInfer does not promise our lower-index tie rule).
"""

from __future__ import annotations

import functools
import logging
import math

import torch

from dsa_kernels.layout import PAGE_SIZE

log = logging.getLogger(__name__)
_LOGGED: set[tuple[str, str]] = set()

FLASH_MLA_HEAD_MULTIPLE = {9: 64, 10: 128}  # sm major -> h_q multiple of FlashMLA's sparse prefill
FLASH_MLA_D_QK = (512, 576)
FLASH_MLA_D_V = 512
FLASH_MLA_TOPK_MULTIPLE = 128  # FlashMLA's own tests use multiples of 128; -1 padding is free
TOPK_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _fallback_once(op: str, reason: str) -> None:
    if (op, reason) not in _LOGGED:
        _LOGGED.add((op, reason))
        log.warning("dsa_kernels: %s falls back from the vendor kernel: %s", op, reason)


# seams the CPU tests replace (a fake vendor module on CPU tensors) ------------------------------

def _on_cuda(t: torch.Tensor) -> bool:
    return t.is_cuda


def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def _flash_mla() -> tuple[object, str] | None:
    """``(flash_mla_sparse_fwd, sgl_kernel version)`` or None when not importable."""
    try:
        import sgl_kernel
    except Exception:  # a GPU wheel can fail at import for many reasons: fall back, never crash
        return None
    fn = getattr(sgl_kernel, "flash_mla_sparse_fwd", None)
    if fn is None:
        fn = getattr(getattr(sgl_kernel, "flash_mla", None), "flash_mla_sparse_fwd", None)
    return (fn, str(getattr(sgl_kernel, "__version__", "unknown"))) if fn is not None else None


def _flashinfer(name: str) -> object | None:
    try:
        import flashinfer
    except Exception:
        return None
    return getattr(flashinfer, name, None)


# sparse MLA --------------------------------------------------------------------------------------

def flash_mla_unsupported(
    q: torch.Tensor, kv_cache: torch.Tensor, indices: torch.Tensor, kv_lora_rank: int
) -> str | None:
    """Why FlashMLA cannot take this call (``None``: it can)."""
    if not (_on_cuda(q) and _on_cuda(kv_cache) and _on_cuda(indices)):
        return "tensors not on CUDA"
    major = _capability(q.device)[0]
    if major not in FLASH_MLA_HEAD_MULTIPLE:
        return f"sm{major}x: FlashMLA sparse prefill runs on sm90 / sm100 only"
    if kv_cache.dtype != torch.bfloat16:
        return f"kv_cache {kv_cache.dtype}: FlashMLA sparse prefill reads a bf16 cache (fp8 layout not adapted)"
    if q.dtype != torch.bfloat16:
        return f"q {q.dtype}: expected bf16 (casting would change the result's precision)"
    if q.shape[-1] not in FLASH_MLA_D_QK or kv_cache.shape[-1] != q.shape[-1]:
        return f"d_qk {q.shape[-1]} (cache row {kv_cache.shape[-1]}): expected one of {FLASH_MLA_D_QK}"
    if kv_lora_rank != FLASH_MLA_D_V:
        return f"d_v {kv_lora_rank}: expected {FLASH_MLA_D_V}"
    if indices.dtype not in (torch.int32, torch.int64) or indices.dim() != 2 or indices.shape[0] != q.shape[0]:
        return f"indices {indices.dtype} {list(indices.shape)}: expected int [T, K]"
    return None


def _pad_dim(x: torch.Tensor, dim: int, multiple: int, value: float) -> torch.Tensor:
    pad = -x.shape[dim] % multiple
    if pad == 0:
        return x
    shape = list(x.shape)
    shape[dim] = pad
    return torch.cat([x, x.new_full(shape, value)], dim=dim)


def _flash_mla_call(fn, q, kv_cache, indices, sm_scale: float, kv_lora_rank: int):
    """Pad to the kernel's multiples, call, un-pad: raw ``(out, lse)`` in FlashMLA's convention."""
    multiple = FLASH_MLA_HEAD_MULTIPLE[_capability(q.device)[0]]
    heads = q.shape[1]
    valid = (indices >= 0) & (indices < kv_cache.shape[0])
    idx = torch.where(valid, indices, -1).to(torch.int32)
    idx = _pad_dim(idx, 1, FLASH_MLA_TOPK_MULTIPLE, -1)
    qp = _pad_dim(q, 1, multiple, 0.0).contiguous()
    out, _max_logits, lse = fn(qp, kv_cache.unsqueeze(1), idx.unsqueeze(1), sm_scale, kv_lora_rank)
    return out[:, :heads], lse[:, :heads].float()


@functools.cache
def flash_mla_lse_base(version: str, device: torch.device) -> float | None:
    """FlashMLA's lse base for this ``sgl_kernel`` version, measured: ``2.0``, ``math.e`` or None.

    A tiny probe (one sm-multiple of heads, 576-wide rows, 64 indices) is compared with the natural
    lse of the torch reference; the base whose conversion matches within bf16 accuracy wins.
    """
    from dsa_kernels.reference.sparse_mla import sparse_mla_prefill as reference

    found = _flash_mla()
    if found is None:
        return None
    fn, dev = found[0], device
    gen = torch.Generator().manual_seed(0)
    heads = FLASH_MLA_HEAD_MULTIPLE[_capability(dev)[0]]
    q = torch.randn(4, heads, 576, generator=gen).to(torch.bfloat16).to(dev)
    kv = torch.randn(256, 576, generator=gen).to(torch.bfloat16).to(dev)
    idx = torch.stack([torch.randperm(256, generator=gen)[:64] for _ in range(4)]).to(torch.int32).to(dev)
    _, lse = _flash_mla_call(fn, q, kv, idx, 576**-0.5, 512)
    _, want = reference(q, kv, idx, 576**-0.5, 512)
    for base in (math.e, 2.0):
        if torch.allclose(lse * math.log(base), want, rtol=1e-2, atol=1e-2):
            return base
    return None


def sparse_mla_prefill(q, kv_cache, indices, sm_scale: float, kv_lora_rank: int):
    """FlashMLA where the gate passes, else the Triton kernel; ``(out [T, H, L], lse [T, H])`` in our
    convention either way (see the module docstring)."""
    found = _flash_mla()
    reason = "sgl_kernel flash_mla_sparse_fwd not importable" if found is None else \
        flash_mla_unsupported(q, kv_cache, indices, kv_lora_rank)
    base = None
    if reason is None:
        base = flash_mla_lse_base(found[1], q.device)
        if base is None:
            reason = f"lse base of sgl_kernel {found[1]} not established (probe matched neither e nor 2)"
    if reason is not None:
        from dsa_kernels.triton_ops.sparse_mla import sparse_mla_prefill as triton_sparse_mla

        _fallback_once("sparse_mla_prefill", reason)
        return triton_sparse_mla(q, kv_cache, indices, sm_scale, kv_lora_rank)
    out, lse = _flash_mla_call(found[0], q, kv_cache, indices, sm_scale, kv_lora_rank)
    lse = lse * math.log(base)  # to natural log
    return out, torch.where(torch.isposinf(lse), float("-inf"), lse)  # empty row: +inf there, -inf here


# top-k -------------------------------------------------------------------------------------------

def topk_unsupported(scores: torch.Tensor, k: int, fn_name: str = "top_k") -> str | None:
    if _flashinfer(fn_name) is None:
        return f"flashinfer.{fn_name} not available"
    if not _on_cuda(scores):
        return "scores not on CUDA"
    if scores.dim() != 2 or scores.dtype not in TOPK_DTYPES:
        return f"scores {scores.dtype} {list(scores.shape)}: expected 2-D fp32/fp16/bf16"
    if k < 1 or scores.shape[1] == 0:
        return f"k {k} over {scores.shape[1]} columns: nothing to select"
    return None


def _top_k(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    vals, idx = _flashinfer("top_k")(scores.contiguous(), min(k, scores.shape[1]), sorted=True)
    return vals, idx.to(torch.int32)


def topk_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """As ``reference.indexer.topk_indices`` (``[T, k]`` int32, -1 padded), on ``flashinfer.top_k``."""
    from dsa_kernels.reference import indexer as ref

    reason = topk_unsupported(scores, k)
    if reason is not None:
        _fallback_once("topk_indices", reason)
        return ref.topk_indices(scores, k)
    vals, idx = _top_k(scores, k)
    idx = torch.where(torch.isfinite(vals), idx, -1)
    return torch.cat([idx, idx.new_full((idx.shape[0], k - idx.shape[1]), -1)], dim=1)


def topk_merge(best_scores, best_idx, chunk_scores, s_start: int, k: int):
    """As ``reference.indexer.topk_merge``, selecting with ``flashinfer.top_k``."""
    from dsa_kernels.reference import indexer as ref

    reason = topk_unsupported(chunk_scores, k)
    if reason is not None:
        _fallback_once("topk_merge", reason)
        return ref.topk_merge(best_scores, best_idx, chunk_scores, s_start, k)
    t_count, n = chunk_scores.shape
    cols = torch.arange(s_start, s_start + n, dtype=torch.int32, device=chunk_scores.device)
    scores = torch.cat([best_scores, chunk_scores], dim=1)
    vals, pick = _top_k(scores, k)
    return vals, torch.cat([best_idx, cols.expand(t_count, n)], dim=1).gather(1, pick.long())


def topk_slots(scores, page_table, req_idx, positions, k: int) -> torch.Tensor:
    """As ``reference.indexer.topk_slots``, fused in ``flashinfer.top_k_page_table_transform`` over a
    page-size-1 table built from the 64-token ``page_table``; row ``t`` selects among its first
    ``min(positions[t] + 1, n)`` columns."""
    from dsa_kernels.reference import indexer as ref

    reason = topk_unsupported(scores, k, "top_k_page_table_transform")
    if reason is not None:
        _fallback_once("topk_slots", reason)
        return ref.topk_slots(scores, page_table, req_idx, positions, k)
    n = scores.shape[1]
    s = torch.arange(n, device=scores.device)
    table1 = (page_table[:, s // PAGE_SIZE].long() * PAGE_SIZE + s % PAGE_SIZE).to(torch.int32).contiguous()
    lengths = (positions.long() + 1).clamp(max=n).to(torch.int32).contiguous()
    fn = _flashinfer("top_k_page_table_transform")
    return fn(scores.contiguous(), table1, lengths, k, row_to_batch=req_idx.to(torch.int32).contiguous())


def available() -> dict[str, object]:
    """Vendor ops importable here, by op name (empty on CPU or without the ``gpu`` extra). Each
    still gates every call and falls back (see the module docstring)."""
    if not torch.cuda.is_available():
        return {}
    ops: dict[str, object] = {}
    if _flash_mla() is not None:
        ops["sparse_mla_prefill"] = sparse_mla_prefill
    if _flashinfer("top_k") is not None:
        ops |= {"topk_indices": topk_indices, "topk_merge": topk_merge}
    if _flashinfer("top_k_page_table_transform") is not None:
        ops["topk_slots"] = topk_slots
    return ops
