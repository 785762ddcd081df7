"""What each DSA op really reads and writes, declared to the stream sanitizer around interpreted Triton launches.

Under ``TRITON_INTERPRET=1`` the Triton interpreter copies every tensor argument to a host buffer and
back, whole, around each launch. The dispatch mode would see a write of every argument — of the
whole pool, the whole scratch slot — which no GPU kernel does, and report hazards against another
stream's accesses to rows the kernel never touches (e.g. the KV broadcast's gather on its own stream
reading pages of the same pool). So, while a sanitizer is active, each interpreted launch is an
:func:`hicache.sanitizer.opaque` op whose reads and writes are the kernel's own, at row granularity:

=====================  ========================================  ============================================
op                     reads                                     writes
=====================  ========================================  ============================================
quantize_index_keys    keys, slots                               index_cache pages ``slots // 64``
dequantize_index_keys  index_cache pages ``slots // 64``, slots  —
pack_mla_kv            kv_c, k_pe, slots                         kv_cache rows ``slots``
unpack_mla_kv          kv_cache rows ``slots``, slots            —
indexer_scores         every tensor argument                     —
sparse_mla_prefill     every tensor argument                     —
gather_pages           pages rows ``page_ids``, page_ids         —
scatter_pages          packed, page_ids                          pages rows ``page_ids``
=====================  ========================================  ============================================

Results are fresh tensors of the launching stream. :func:`hicache.sanitizer.enable` installs the
launch hook that uses this table (this module does not import the sanitizer).
"""

from __future__ import annotations

from typing import Callable

import torch

from dsa_kernels.layout import PAGE_SIZE

# op -> (position of the tensor written by row or None, position of its row index, index -> row divisor)
_ROWED = {
    "quantize_index_keys": (1, 2, PAGE_SIZE),
    "dequantize_index_keys": (None, 1, PAGE_SIZE),
    "pack_mla_kv": (2, 3, 1),
    "unpack_mla_kv": (None, 1, 1),
    "gather_pages": (None, 1, 1),
    "scatter_pages": (1, 2, 1),
}
_ROWED_READ = {"dequantize_index_keys": 0, "unpack_mla_kv": 0, "gather_pages": 0}


def accesses(op: str, args: tuple, rows_of: Callable[[torch.Tensor, int], list[int]]) -> tuple[list, list]:
    """``(reads, writes)`` as ``[(tensor, rows or None)]`` for one call of ``op``; ``rows_of(index,
    divisor)`` lists the distinct rows an index tensor selects (the sanitizer's own host read)."""
    tensors = [(i, a) for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    if op not in _ROWED:
        return [(t, None) for _, t in tensors], []
    written, index_pos, divisor = _ROWED[op]
    rows = rows_of(args[index_pos], divisor)
    rowed_read = _ROWED_READ.get(op)
    reads = [(t, None) for i, t in tensors if i not in (written, rowed_read)]
    if rowed_read is not None:
        reads.append((args[rowed_read], rows))
    writes = [(args[written], rows)] if written is not None else []
    return reads, writes


def distinct_rows(index: torch.Tensor, divisor: int) -> list[int]:
    """Distinct non-negative ``index // divisor`` values (padding entries are -1)."""
    return sorted({i // divisor for i in index.reshape(-1).tolist() if i >= 0})
