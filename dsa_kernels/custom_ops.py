"""The Triton and vendor DSA ops as PyTorch custom ops (``torch.ops.dsa_kernels.<op>``).

A Triton launch from Python, or a call into sgl_kernel / FlashInfer, is invisible to the PyTorch
dispatcher: CUDA's stream sanitizer (``TORCH_CUDA_SANITIZER=1``, a dispatch mode that reads each
op's schema to tell reads from writes), the profiler's op list and ``torch.compile`` would not see
it. Registered here, each call is one dispatcher op whose schema names what it writes in place
(``Tensor(a!)``), so CSAN sees e.g. a read of ``index_cache`` before the write that fills it is
ordered. ``dsa_kernels.dispatch`` routes the Triton and vendor backends through these ops; the torch
reference stays plain torch (the dispatcher sees its aten ops already).

Names: ``dsa_kernels::<op>`` for a Triton launcher, ``dsa_kernels::vendor_<op>`` for a vendor
adapter (``dsa_kernels.vendor``, registered only when dispatch resolves one, i.e. on a GPU with the
vendor wheels). Schemas, as inferred from the prototypes below::

    quantize_index_keys(Tensor keys, Tensor(a1!) index_cache, Tensor slots) -> ()
    dequantize_index_keys(Tensor index_cache, Tensor slots) -> Tensor
    pack_mla_kv(Tensor kv_c, Tensor k_pe, Tensor(a2!) kv_cache, Tensor slots) -> ()
    unpack_mla_kv(Tensor kv_cache, Tensor slots, SymInt kv_lora_rank) -> (Tensor, Tensor)
    indexer_scores(Tensor q, Tensor weights, Tensor index_cache, Tensor page_table, Tensor req_idx,
                   Tensor positions, SymInt max_context, SymInt s_start=0) -> Tensor
    sparse_mla_prefill(Tensor q, Tensor kv_cache, Tensor indices, float sm_scale, SymInt kv_lora_rank)
                       -> (Tensor, Tensor)
    gather_pages(Tensor pages, Tensor page_ids) -> Tensor
    scatter_pages(Tensor packed, Tensor(a1!) pages, Tensor page_ids) -> ()
    vendor_topk_indices(Tensor scores, SymInt k) -> Tensor
    vendor_topk_merge(Tensor best_scores, Tensor best_idx, Tensor chunk_scores, SymInt s_start, SymInt k)
                      -> (Tensor, Tensor)
    vendor_topk_slots(Tensor scores, Tensor page_table, Tensor req_idx, Tensor positions, SymInt k) -> Tensor

Every result is a fresh tensor (a custom op may not return a view of an input).
"""

from __future__ import annotations

import functools
import threading
from typing import Callable

import torch
from torch import Tensor

from dsa_kernels import contract

NAMESPACE = "dsa_kernels"


# prototypes: the typed signature each schema is inferred from; the body is the op's fake (meta)
# implementation, the output shapes and dtypes that torch.compile traces with ----------------------

def quantize_index_keys(keys: Tensor, index_cache: Tensor, slots: Tensor) -> None:
    return None


def dequantize_index_keys(index_cache: Tensor, slots: Tensor) -> Tensor:
    d = contract.dequantize_index_keys(index_cache, slots)
    return index_cache.new_empty(slots.shape[0], d, dtype=torch.float32)


def pack_mla_kv(kv_c: Tensor, k_pe: Tensor, kv_cache: Tensor, slots: Tensor) -> None:
    return None


def unpack_mla_kv(kv_cache: Tensor, slots: Tensor, kv_lora_rank: int) -> tuple[Tensor, Tensor]:
    rope = contract.unpack_mla_kv(kv_cache, slots, kv_lora_rank)
    n = slots.shape[0]
    return (kv_cache.new_empty(n, kv_lora_rank, dtype=torch.float32),
            kv_cache.new_empty(n, rope, dtype=torch.float32))


def indexer_scores(q: Tensor, weights: Tensor, index_cache: Tensor, page_table: Tensor, req_idx: Tensor,
                   positions: Tensor, max_context: int, s_start: int = 0) -> Tensor:
    return index_cache.new_empty(q.shape[0], max_context - s_start, dtype=torch.float32)


def sparse_mla_prefill(q: Tensor, kv_cache: Tensor, indices: Tensor, sm_scale: float,
                       kv_lora_rank: int) -> tuple[Tensor, Tensor]:
    t_count, heads = q.shape[:2]
    return (kv_cache.new_empty(t_count, heads, kv_lora_rank, dtype=q.dtype),
            kv_cache.new_empty(t_count, heads, dtype=torch.float32))


def gather_pages(pages: Tensor, page_ids: Tensor) -> Tensor:
    return pages.new_empty(page_ids.shape[0], pages.shape[1])


def scatter_pages(packed: Tensor, pages: Tensor, page_ids: Tensor) -> None:
    return None


def topk_indices(scores: Tensor, k: int) -> Tensor:
    return scores.new_empty(scores.shape[0], k, dtype=torch.int32)


def topk_merge(best_scores: Tensor, best_idx: Tensor, chunk_scores: Tensor, s_start: int,
               k: int) -> tuple[Tensor, Tensor]:
    t_count, kept = best_scores.shape[0], best_scores.shape[1] + chunk_scores.shape[1]
    width = torch.sym_min(k, kept)
    return (chunk_scores.new_empty(t_count, width, dtype=torch.promote_types(best_scores.dtype, chunk_scores.dtype)),
            chunk_scores.new_empty(t_count, width, dtype=torch.promote_types(best_idx.dtype, torch.int32)))


def topk_slots(scores: Tensor, page_table: Tensor, req_idx: Tensor, positions: Tensor, k: int) -> Tensor:
    return scores.new_empty(scores.shape[0], k, dtype=torch.int32)


PROTOTYPES: dict[str, Callable] = {fn.__name__: fn for fn in (
    quantize_index_keys, dequantize_index_keys, pack_mla_kv, unpack_mla_kv, indexer_scores,
    sparse_mla_prefill, gather_pages, scatter_pages, topk_indices, topk_merge, topk_slots)}
MUTATES: dict[str, tuple[str, ...]] = {  # the arguments each op writes in place; every other op writes none
    "quantize_index_keys": ("index_cache",),
    "pack_mla_kv": ("kv_cache",),
    "scatter_pages": ("pages",),
}

_IMPLS: dict[str, Callable] = {}  # qualified op name -> the function its calls run (replaced on re-registration)
_DEFINING = threading.Lock()  # two emulated streams (threads) may resolve an op for the first time at once


def register(qualname: str, impl: Callable, prototype: Callable, mutates: tuple[str, ...] = ()) -> Callable:
    """Define ``qualname`` (``"namespace::name"``, once per process) as a custom op with
    ``prototype``'s typed signature and fake implementation, writing ``mutates`` in place; its calls
    run ``impl`` (the latest one registered under the name). Returns the op's default overload."""
    with _DEFINING:
        if qualname not in _IMPLS:
            @functools.wraps(prototype)  # the schema is inferred from the prototype's signature
            def run(*args, **kwargs):
                return _IMPLS[qualname](*args, **kwargs)

            torch.library.custom_op(qualname, run, mutates_args=mutates).register_fake(prototype)
        _IMPLS[qualname] = impl
    namespace, name = qualname.split("::")
    return getattr(getattr(torch.ops, namespace), name).default


def routed(op: str, fn: Callable, backend: str) -> Callable:
    """``fn`` (the ``backend`` implementation of ``op``: ``"triton"`` or ``"vendor"``) called through
    its custom op. Same arguments and results as ``fn``."""
    name = op if backend == "triton" else f"{backend}_{op}"
    overload = register(f"{NAMESPACE}::{name}", fn, PROTOTYPES[op], MUTATES.get(op, ()))

    @functools.wraps(fn)
    def call(*args, **kwargs):
        return overload(*args, **kwargs)

    return call
