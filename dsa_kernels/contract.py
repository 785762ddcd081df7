"""The input contract of every DSA op, one function per op, checked for **every** backend.

``dsa_kernels.dispatch`` runs the op's check before the torch reference or a vendor kernel; each
Triton launcher calls the same check itself. So a CPU run on the torch reference refuses exactly
what the Triton kernels (the GPU path) refuse, with the same message: a non-contiguous column
slice (``rows[:, lat + rope:]``, strides ``(176, 1)``) is refused on CPU, not first on CUDA.

The checks read tensor metadata only (shape, dtype, device, strides): no device reads, no syncs.
Errors name the argument, what was expected and what came (``ValueError``; ``TypeError`` for a
non-tensor).
"""

from __future__ import annotations

import torch

from dsa_kernels.layout import FP8_DTYPE, FP8_TILE, PAGE_SIZE, index_head_dim_of, kv_dtype_of, mla_row_bytes

INDEX_DTYPES = (torch.int32, torch.int64)
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_tensor(name: str, t: torch.Tensor, *, dim: int, dtypes: tuple[torch.dtype, ...], device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dim() != dim:
        raise ValueError(f"{name}: expected {dim} dims, got shape {list(t.shape)}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name}: expected dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name}: expected device {device}, got {t.device}")
    if not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor, got strides {t.stride()}")


def check_len(name: str, t: torch.Tensor, n: int, what: str) -> None:
    if t.shape[0] != n:
        raise ValueError(f"{name}: expected {n} rows ({what}), got {t.shape[0]}")


# indexer keys ------------------------------------------------------------------------------------

def dequantize_index_keys(index_cache: torch.Tensor, slots: torch.Tensor) -> int:
    """Returns the head dim ``D`` of the cache."""
    d = index_head_dim_of(index_cache)
    check_tensor("index_cache", index_cache, dim=2, dtypes=(torch.uint8,), device=index_cache.device)
    check_tensor("slots", slots, dim=1, dtypes=INDEX_DTYPES, device=index_cache.device)
    return d


def quantize_index_keys(keys: torch.Tensor, index_cache: torch.Tensor, slots: torch.Tensor) -> int:
    d = dequantize_index_keys(index_cache, slots)
    check_tensor("keys", keys, dim=2, dtypes=FLOAT_DTYPES, device=index_cache.device)
    if keys.shape[1] != d:
        raise ValueError(f"keys: expected head dim {d} (from index_cache page size), got {keys.shape[1]}")
    check_len("slots", slots, keys.shape[0], "one slot per key")
    return d


# MLA latent rows ---------------------------------------------------------------------------------

def _mla_cache(kv_cache: torch.Tensor, slots: torch.Tensor, lat: int, rope: int) -> None:
    kv_dtype = kv_dtype_of(kv_cache)
    check_tensor("kv_cache", kv_cache, dim=2, dtypes=(torch.bfloat16, torch.uint8), device=kv_cache.device)
    check_tensor("slots", slots, dim=1, dtypes=INDEX_DTYPES, device=kv_cache.device)
    width = kv_cache.shape[1] * kv_cache.element_size()
    if width != mla_row_bytes(lat, rope, kv_dtype):
        raise ValueError(
            f"kv_cache: expected rows of {mla_row_bytes(lat, rope, kv_dtype)} B for latent {lat} + rope {rope} "
            f"({kv_dtype}), got {width} B"
        )


def pack_mla_kv(kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor) -> None:
    check_tensor("kv_c", kv_c, dim=2, dtypes=FLOAT_DTYPES, device=kv_cache.device)
    check_tensor("k_pe", k_pe, dim=2, dtypes=FLOAT_DTYPES, device=kv_cache.device)
    _mla_cache(kv_cache, slots, kv_c.shape[1], k_pe.shape[1])
    check_len("k_pe", k_pe, kv_c.shape[0], "one rope key per latent row")
    check_len("slots", slots, kv_c.shape[0], "one slot per row")


def unpack_mla_kv(kv_cache: torch.Tensor, slots: torch.Tensor, kv_lora_rank: int) -> int:
    """Returns the rope dim ``R`` the row width implies."""
    width = kv_cache.shape[1] * kv_cache.element_size() if kv_cache.dim() == 2 else 0
    lat = kv_lora_rank
    fp8 = kv_dtype_of(kv_cache) == "fp8"
    rope = (width - lat - 4 * (lat // FP8_TILE)) // 2 if fp8 else width // 2 - lat
    _mla_cache(kv_cache, slots, lat, rope)
    return rope


# lightning indexer -------------------------------------------------------------------------------

def indexer_scores(q, weights, index_cache, page_table, req_idx, positions, max_context: int,
                   s_start: int = 0) -> int:
    """Returns the head dim ``D``. ``q`` raw (float) or already e4m3 (``quantize_index_q``)."""
    dev = index_cache.device
    d = index_head_dim_of(index_cache)
    check_tensor("q", q, dim=3, dtypes=FLOAT_DTYPES + (FP8_DTYPE,), device=dev)
    t_count, heads, qd = q.shape
    if qd != d or d & (d - 1) or d < 16:
        raise ValueError(f"q: expected head dim {d} (from index_cache), a power of 2 >= 16; got {qd}")
    check_tensor("weights", weights, dim=2, dtypes=FLOAT_DTYPES, device=dev)
    if tuple(weights.shape) != (t_count, heads):
        raise ValueError(f"weights: expected shape {[t_count, heads]}, got {list(weights.shape)}")
    check_tensor("page_table", page_table, dim=2, dtypes=INDEX_DTYPES, device=dev)
    for name, t in (("req_idx", req_idx), ("positions", positions)):
        check_tensor(name, t, dim=1, dtypes=INDEX_DTYPES, device=dev)
        check_len(name, t, t_count, "one per query row")
    if max_context > page_table.shape[1] * PAGE_SIZE:
        raise ValueError(
            f"max_context: expected <= {page_table.shape[1] * PAGE_SIZE} (page_table width), got {max_context}")
    if not 0 <= s_start <= max_context:
        raise ValueError(f"s_start: expected in [0, max_context={max_context}], got {s_start}")
    return d


# sparse MLA --------------------------------------------------------------------------------------

def sparse_mla_prefill(q, kv_cache, indices, sm_scale: float, kv_lora_rank: int) -> None:
    """kv_cache: ``[S, L + R]`` bf16 (fp16 / fp32 accepted), or uint8 ``[S, L + 4L/128 + 2R]`` in
    the fp8 layout (``dsa_kernels.layout``), ``L + R`` being q's last dim."""
    dev = kv_cache.device
    check_tensor("q", q, dim=3, dtypes=FLOAT_DTYPES, device=dev)
    check_tensor("kv_cache", kv_cache, dim=2, dtypes=(torch.bfloat16, torch.float16, torch.float32, torch.uint8),
                 device=dev)
    check_tensor("indices", indices, dim=2, dtypes=INDEX_DTYPES, device=dev)
    t_count, _, width = q.shape
    lat = kv_lora_rank
    fp8 = kv_cache.dtype == torch.uint8
    if not fp8 and width != kv_cache.shape[1]:
        raise ValueError(f"q: expected last dim {kv_cache.shape[1]} (kv_cache row), got {width}")
    if lat & (lat - 1) or lat < 16 or lat >= width:
        raise ValueError(f"kv_lora_rank: expected a power of 2 >= 16 below the row width {width}, got {lat}")
    if fp8:
        _fp8_mla_rows(kv_cache, lat, width - lat)
    if indices.shape[0] != t_count:
        raise ValueError(f"indices: expected {t_count} rows (one per query token), got {indices.shape[0]}")


def _fp8_mla_rows(kv_cache: torch.Tensor, lat: int, rope: int) -> None:
    """A uint8 cache must hold fp8-layout rows for latent ``lat`` and rope ``rope`` (from q)."""
    if lat % FP8_TILE:
        raise ValueError(f"kv_lora_rank: expected a multiple of {FP8_TILE} for an fp8-layout (uint8) kv_cache, "
                         f"got {lat}")
    want = mla_row_bytes(lat, rope, "fp8")
    if kv_cache.shape[1] != want:
        raise ValueError(f"kv_cache: expected fp8-layout rows of {want} B (latent {lat} + rope {rope}, from q's "
                         f"last dim {lat + rope}), got {kv_cache.shape[1]} B")


# paged copies ------------------------------------------------------------------------------------

def gather_pages(pages: torch.Tensor, page_ids: torch.Tensor) -> None:
    check_tensor("pages", pages, dim=2, dtypes=(torch.uint8,), device=pages.device)
    check_tensor("page_ids", page_ids, dim=1, dtypes=INDEX_DTYPES, device=pages.device)


def scatter_pages(packed: torch.Tensor, pages: torch.Tensor, page_ids: torch.Tensor) -> None:
    gather_pages(pages, page_ids)
    check_tensor("packed", packed, dim=2, dtypes=(torch.uint8,), device=pages.device)
    if tuple(packed.shape) != (page_ids.shape[0], pages.shape[1]):
        raise ValueError(f"packed: expected shape {[page_ids.shape[0], pages.shape[1]]}, got {list(packed.shape)}")


CHECKS = {
    "quantize_index_keys": quantize_index_keys, "dequantize_index_keys": dequantize_index_keys,
    "pack_mla_kv": pack_mla_kv, "unpack_mla_kv": unpack_mla_kv, "indexer_scores": indexer_scores,
    "sparse_mla_prefill": sparse_mla_prefill, "gather_pages": gather_pages, "scatter_pages": scatter_pages,
}
