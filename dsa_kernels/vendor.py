"""Vendor CUDA kernels behind per-call gates (imported lazily by ``dsa_kernels.dispatch``).

Each adapter checks every call against what the vendor kernel accepts and, when the call is outside
that, runs the next tier instead (Triton for sparse MLA, the torch reference for top-k) and logs
the reason once. Nothing here can be called with arguments the vendor kernel would misread.

* ``sparse_mla_prefill`` — FlashMLA's sparse prefill, ``flash_mla_sparse_fwd`` from the
  ``sgl_kernel.flash_mla`` submodule (``sgl_kernel/__init__`` does not import it, so it is imported
  by name, never looked up as an attribute), else from the ``flash_mla`` module of the
  ``sgl-flash-mla`` wheel that sglang 0.5.23 requires (its ``kernels/ops/attention/flash_mla_interface``
  calls that one). Accepts: CUDA sm90 / sm100; bf16 ``q [T, h_q, d_qk]`` with ``d_qk`` 576 (or 512,
  no rope); ``d_v = kv_lora_rank = 512``; a bf16 cache. The fp8 (656-byte) cache runs the Triton
  kernel, which dequantizes the gathered rows in registers; that kernel refuses, before launch, an
  fp8 cache on a CUDA device below sm89 (``triton_ops.fp8_gate.require_e4m3``: e4m3 as
  ``tl.float8e4nv`` does not compile there), so this fallback raises that ValueError. Our fp8 row
  is byte for byte FlashMLA's "FP8 with scale" format (512 e4m3, 4 fp32 scales one per 128 values,
  64 bf16 rope: FlashMLA's README, "FP8 KV Cache", and ``flash_mla_with_kvcache``'s docstring in
  ``flash_mla/flash_mla_interface.py``; ``tests/quant.py`` ``V32_FP8Sparse`` dequantizes
  ``e4m3 * scale``), but FlashMLA reads it only in its sparse *decode* kernel
  (``flash_mla_with_kvcache(..., is_fp8_kvcache=True, indices=...)``): ``flash_mla_sparse_fwd``
  takes ``kv [s_kv, h_kv, d_qk]`` bf16 (same docstring; the README's support matrix lists FP8 for
  sparse decoding only; sglang 0.5.23's ``kernels/ops/attention/flash_mla_interface.py``: "Sparse
  prefill over a bf16 ``kv``"). Driving the decode kernel with the prefill's tokens as one batch
  (vLLM's "mixed batch mode") is a different contract (scheduler metadata per batch, lse
  ``[b, h_q, s_q]``, a call signature that differs between FlashMLA releases), not adapted here.
  Heads: the kernel takes exactly ``h_q`` in ``FLASH_MLA_HEADS`` (64 or 128 on sm90, 128 on sm100),
  not a multiple of them, so ``h_q`` is zero-padded to the smallest accepted count at or above it,
  and ``h_q > 128`` runs as groups of 128 heads (per-head attention is independent: exact).
  ``K`` is padded with -1 to a multiple of 128. Semantics as FlashMLA's ``flash_mla/flash_mla_interface.py``
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
import importlib
import logging
import math
import sys

import torch

from dsa_kernels.layout import PAGE_SIZE

log = logging.getLogger(__name__)
_LOGGED: set[tuple[str, str]] = set()

FLASH_MLA_HEADS = {9: (64, 128), 10: (128,)}  # sm major -> the h_q FlashMLA's sparse prefill accepts
FLASH_MLA_MODULES = ("sgl_kernel.flash_mla", "flash_mla")  # where flash_mla_sparse_fwd lives, in order
FLASH_MLA_D_QK = (512, 576)
FLASH_MLA_D_V = 512
FLASH_MLA_TOPK_MULTIPLE = 128  # FlashMLA's own tests use multiples of 128; -1 padding is free
TOPK_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _fallback_once(op: str, reason: str) -> None:
    if (op, reason) not in _LOGGED:
        _LOGGED.add((op, reason))
        log.warning("dsa_kernels: %s falls back from the vendor kernel: %s", op, reason)


# seams the CPU tests replace (a fake vendor module on CPU tensors; the Triton fallback's fp8 gate
# reads its own, ``triton_ops.fp8_gate.cuda_capability``) -------------------------------------

def _on_cuda(t: torch.Tensor) -> bool:
    return t.is_cuda


def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


_IMPORT_FAILED: set[str] = set()  # FlashMLA modules whose import failed in this process


def _flash_mla() -> tuple[object, str] | None:
    """``(flash_mla_sparse_fwd, "<module> <version>")`` from the first of ``FLASH_MLA_MODULES`` that
    imports and has it, or None."""
    for name in FLASH_MLA_MODULES:
        module = sys.modules.get(name)
        if module is None:
            if name in _IMPORT_FAILED:  # called once per layer: a failed import is not retried every call
                continue
            try:
                module = importlib.import_module(name)  # a submodule: imported, not read off its parent
            except Exception:  # a GPU wheel can fail at import for many reasons: fall back, never crash
                _IMPORT_FAILED.add(name)
                continue
        fn = getattr(module, "flash_mla_sparse_fwd", None)
        if fn is not None:
            package = sys.modules.get(name.split(".")[0], module)
            return fn, f"{name} {getattr(package, '__version__', 'unknown')}"
    return None


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
    if major not in FLASH_MLA_HEADS:
        return f"sm{major}x: FlashMLA sparse prefill runs on sm90 / sm100 only"
    if kv_cache.dtype != torch.bfloat16:
        return (f"kv_cache {kv_cache.dtype}: flash_mla_sparse_fwd reads a bf16 cache (FlashMLA reads the fp8 "
                "656-byte layout only in its sparse decode kernel)")
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


def flash_mla_head_groups(heads: int, major: int) -> list[tuple[int, int, int]]:
    """``(first head, heads in the group, h_q handed to FlashMLA)`` per call: groups of at most the
    largest accepted h_q, each zero-padded to the smallest accepted count that holds it."""
    accepted = FLASH_MLA_HEADS[major]
    groups = []
    for h0 in range(0, heads, accepted[-1]):
        n = min(accepted[-1], heads - h0)
        groups.append((h0, n, next(a for a in accepted if a >= n)))
    return groups


def _flash_mla_call(fn, q, kv_cache, indices, sm_scale: float, kv_lora_rank: int):
    """Pad (and split) to what the kernel accepts, call, un-pad: raw ``(out, lse)`` in FlashMLA's
    convention."""
    valid = (indices >= 0) & (indices < kv_cache.shape[0])
    idx = torch.where(valid, indices, -1).to(torch.int32)
    idx = _pad_dim(idx, 1, FLASH_MLA_TOPK_MULTIPLE, -1).unsqueeze(1)
    kv = kv_cache.unsqueeze(1)
    outs, lses = [], []
    for h0, n, h_q in flash_mla_head_groups(q.shape[1], _capability(q.device)[0]):
        qg = _pad_dim(q[:, h0:h0 + n], 1, h_q, 0.0).contiguous()
        out, _max_logits, lse = fn(qg, kv, idx, sm_scale, kv_lora_rank)
        outs.append(out[:, :n])
        lses.append(lse[:, :n].float())
    return torch.cat(outs, dim=1), torch.cat(lses, dim=1)


@functools.cache
def flash_mla_lse_base(version: str, device: torch.device) -> float | None:
    """FlashMLA's lse base for this ``sgl_kernel`` version, measured: ``2.0``, ``math.e`` or None.

    A tiny probe (the smallest accepted h_q, 576-wide rows, 64 indices) is compared with the torch
    reference: its ``out`` must match, then the base whose lse conversion matches within bf16
    accuracy wins. A probe that raises (a kernel that refuses the shape) or whose ``out`` differs
    gives None: the vendor tier is then off for the op (logged by the caller).
    """
    from dsa_kernels.reference.sparse_mla import sparse_mla_prefill as reference

    found = _flash_mla()
    if found is None:
        return None
    fn, dev = found[0], device
    gen = torch.Generator().manual_seed(0)
    heads = FLASH_MLA_HEADS[_capability(dev)[0]][0]
    q = torch.randn(4, heads, 576, generator=gen).to(torch.bfloat16).to(dev)
    kv = torch.randn(256, 576, generator=gen).to(torch.bfloat16).to(dev)
    idx = torch.stack([torch.randperm(256, generator=gen)[:64] for _ in range(4)]).to(torch.int32).to(dev)
    try:
        out, lse = _flash_mla_call(fn, q, kv, idx, 576**-0.5, 512)
    except Exception as e:  # noqa: BLE001 - a refusal (TORCH_CHECK) disables the tier, it must not crash
        log.warning("dsa_kernels: FlashMLA probe raised %r", e)
        return None
    want_out, want = reference(q, kv, idx, 576**-0.5, 512)
    if not torch.allclose(out.float(), want_out, rtol=2e-2, atol=2e-2):
        return None
    for base in (math.e, 2.0):
        if torch.allclose(lse * math.log(base), want, rtol=1e-2, atol=1e-2):
            return base
    return None


def sparse_mla_route(q, kv_cache, indices, kv_lora_rank: int) -> str | None:
    """Why ``sparse_mla_prefill`` would run the Triton kernel for this call, or None: FlashMLA runs it."""
    found = _flash_mla()
    if found is None:
        return f"flash_mla_sparse_fwd not importable from {' or '.join(FLASH_MLA_MODULES)}"
    reason = flash_mla_unsupported(q, kv_cache, indices, kv_lora_rank)
    if reason is None and flash_mla_lse_base(found[1], q.device) is None:
        reason = f"lse base of sgl_kernel {found[1]} not established (probe matched neither e nor 2)"
    return reason


def sparse_mla_prefill(q, kv_cache, indices, sm_scale: float, kv_lora_rank: int):
    """FlashMLA where the gate passes, else the Triton kernel; ``(out [T, H, L], lse [T, H])`` in our
    convention either way (see the module docstring)."""
    reason = sparse_mla_route(q, kv_cache, indices, kv_lora_rank)
    if reason is not None:
        from dsa_kernels.triton_ops.sparse_mla import sparse_mla_prefill as triton_sparse_mla

        _fallback_once("sparse_mla_prefill", reason)
        return triton_sparse_mla(q, kv_cache, indices, sm_scale, kv_lora_rank)
    fn, version = _flash_mla()
    out, lse = _flash_mla_call(fn, q, kv_cache, indices, sm_scale, kv_lora_rank)
    lse = lse * math.log(flash_mla_lse_base(version, q.device))  # to natural log (the probe is cached)
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
