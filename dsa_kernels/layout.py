"""Byte layouts of the DSA caches (one place; every kernel and pool reads them from here).

Pages hold ``PAGE_SIZE`` = 64 tokens. All layouts are per layer.

MLA latent cache, one row per token slot (slot = page * 64 + offset):

* **bf16** — ``[num_slots, kv_lora_rank + rope_dim]`` bf16: latent ``c_kv`` then rope key ``k_pe``
  (GLM-5 / DeepSeek-V3.2: 512 + 64 = 576 elements = 1152 B).
* **fp8** — ``[num_slots, row_bytes]`` uint8 with ``row_bytes = L + 4 * L/128 + 2 * R``
  (GLM-5: 512 + 16 + 128 = 656 B): ``L`` e4m3 latent bytes, then ``L/128`` fp32 scales (one per
  128-element tile, ``scale = amax / 448``), then ``R`` bf16 rope elements. This is FlashMLA's
  "FP8 with scale" sparse KV layout, which its sparse decode kernel reads (its sparse prefill kernel
  reads bf16 only: ``dsa_kernels.vendor``).

Indexer-key cache, ``[num_pages, PAGE_SIZE * (D + 4)]`` uint8 (D = 128: 64 * 132 = 8448 B per page):
the page's 64 keys of ``D`` e4m3 bytes come first (token ``o`` at byte ``o * D``), then its 64 fp32
scales (token ``o`` at byte ``64 * D + 4 * o``). One scale per token (``D <= 128``: one quantization
block, as DeepSeek-V3.2 / GLM-5 use at ``D = 128``), a power of two (ue8m0)::

    scale = 2 ** ceil(log2(max(amax, 1e-4) * fp32(1 / 448)))      # computed in fp32

This is DeepSeek-V3.2-Exp's ``act_quant`` with ``scale_fmt`` set (``inference/kernel.py``,
``act_quant_kernel`` with ``round_scale``): the product ``amax * (1/448)`` rounded to fp32, then its
exponent rounded up. Dividing by a power of two is exact, so every backend writes the same bytes.
The MLA fp8 layout keeps the non-rounded ``amax / 448`` scale (FlashMLA's kernels read any fp32
scale; its ``tests/quant.py`` at commit 520fec6 rounds it up to a power of two).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the tensor helpers below take tensors; the constants and sizes need no torch
    import torch

PAGE_SIZE = 64
FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP8_TILE = 128  # latent elements per fp32 scale in the fp8 MLA layout
INDEX_BLOCK = 128  # indexer values per ue8m0 scale (DeepSeek's block_size); keys and query heads are one block
AMAX_FLOOR = 1e-4  # keeps an all-zero row from producing a zero scale


def __getattr__(name: str):
    """``FP8_DTYPE`` (``torch.float8_e4m3fn``), resolved on first use: this module stays importable
    without torch (``layersplit plan`` is arithmetic over the sizes above), while the kernels that make
    fp8 tensors keep importing ``FP8_DTYPE`` from here."""
    if name == "FP8_DTYPE":
        import torch

        globals()["FP8_DTYPE"] = torch.float8_e4m3fn
        return torch.float8_e4m3fn
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def mla_row_bytes(kv_lora_rank: int, rope_dim: int, kv_dtype: str) -> int:
    """Bytes of one token's MLA latent row: 1152 for bf16 and 656 for fp8 at 512 + 64."""
    if kv_dtype == "bf16":
        return 2 * (kv_lora_rank + rope_dim)
    if kv_dtype == "fp8":
        if kv_lora_rank % FP8_TILE:
            raise ValueError(f"fp8 MLA layout: expected kv_lora_rank divisible by {FP8_TILE}, got {kv_lora_rank}")
        return kv_lora_rank + 4 * (kv_lora_rank // FP8_TILE) + 2 * rope_dim
    raise ValueError(f"kv_dtype: expected 'bf16' or 'fp8', got {kv_dtype!r}")


def index_row_bytes(index_head_dim: int) -> int:
    """Bytes of one token's indexer key: ``D`` e4m3 bytes + one fp32 scale (132 at D = 128)."""
    return index_head_dim + 4


def index_page_bytes(index_head_dim: int) -> int:
    return PAGE_SIZE * index_row_bytes(index_head_dim)


def index_head_dim_of(index_cache: torch.Tensor) -> int:
    """Recover ``D`` from a paged indexer cache ``[num_pages, 64 * (D + 4)]`` uint8."""
    import torch

    if index_cache.dim() != 2 or index_cache.dtype != torch.uint8:
        raise ValueError(
            f"index_cache: expected uint8 [num_pages, {PAGE_SIZE} * (D + 4)], "
            f"got {index_cache.dtype} {list(index_cache.shape)}"
        )
    page_bytes = index_cache.shape[1]
    if page_bytes % PAGE_SIZE or page_bytes // PAGE_SIZE <= 4:
        raise ValueError(f"index_cache: page of {page_bytes} B is not {PAGE_SIZE} * (D + 4)")
    d = page_bytes // PAGE_SIZE - 4
    if d > INDEX_BLOCK:
        raise ValueError(f"index_cache: expected D <= {INDEX_BLOCK} (one scale per key), got D = {d}")
    return d


def kv_dtype_of(kv_cache: torch.Tensor) -> str:
    """'bf16' for a bf16 cache, 'fp8' for the uint8 656-byte layout."""
    import torch

    if kv_cache.dtype == torch.bfloat16:
        return "bf16"
    if kv_cache.dtype == torch.uint8:
        return "fp8"
    raise ValueError(f"kv_cache: expected bfloat16 or uint8 (fp8 layout), got {kv_cache.dtype}")


def as_pages(buf: torch.Tensor, rows_per_page: int) -> torch.Tensor:
    """View a per-layer buffer as ``[num_pages, page_bytes]`` uint8 without copying.

    ``rows_per_page`` is 64 for slot-indexed caches (MLA ``[num_slots, row]``) and 1 for
    page-indexed caches (indexer ``[num_pages, page_bytes]``).
    """
    import torch

    if not buf.is_contiguous():
        raise ValueError("paged buffer: expected a contiguous tensor")
    if buf.dim() < 1 or buf.shape[0] % rows_per_page:
        raise ValueError(
            f"paged buffer: expected first dim divisible by rows_per_page={rows_per_page}, "
            f"got shape {list(buf.shape)}"
        )
    pages = buf.reshape(buf.shape[0] // rows_per_page, -1)
    return pages if pages.dtype == torch.uint8 else pages.view(torch.uint8)


def slots_to_rows(slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Split token slots into (page, offset-in-page)."""
    return slots // PAGE_SIZE, slots % PAGE_SIZE
