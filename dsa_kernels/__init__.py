"""DSA compute ops: indexer-key fp8 paging, MLA latent packing, lightning indexer + top-k,
sparse MLA prefill, paged gather/scatter. Each op dispatches (``dsa_kernels.dispatch``) to a
vendor kernel, a Triton kernel or the fp32 torch reference in ``dsa_kernels.reference``.

Byte layouts: ``dsa_kernels.layout``. Example::

    cache = torch.zeros(num_pages, 64 * 132, dtype=torch.uint8)
    quantize_index_keys(keys, cache, slots)          # keys [n, 128]
    top = indexer_topk(q, w, cache, page_table, req_idx, positions, max_context, 2048)
    # [T, 2048] int32 positions, -1 padded; positions_to_slots(top, page_table, req_idx) -> cache slots

The ops live in :mod:`dsa_kernels.ops` and are imported on first use, so ``import dsa_kernels.layout``
(sizes and constants; ``layersplit plan``) does not import torch.
"""

from __future__ import annotations

from importlib import import_module

__all__ = [
    "quantize_index_keys",
    "dequantize_index_keys",
    "pack_mla_kv",
    "unpack_mla_kv",
    "hadamard_rotate",
    "quantize_index_q",
    "indexer_scores",
    "indexer_topk",
    "query_block_extents",
    "topk_indices",
    "topk_slots",
    "positions_to_slots",
    "sparse_mla_prefill",
    "gather_pages",
    "scatter_pages",
]
_LAZY = frozenset(__all__) | {"DEFAULT_CHUNK", "DEFAULT_QUERY_BLOCK"}


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(import_module("dsa_kernels.ops"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'dsa_kernels' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | _LAZY)
