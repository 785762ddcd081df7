"""Paged gather/scatter of one layer's pages (``[P, page_bytes]`` uint8 views)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsa_kernels import contract
from dsa_kernels.triton_ops.offsets import as_offset, wide


@triton.jit
def _copy_pages_kernel(src_ptr, dst_ptr, ids_ptr, words, GATHER: tl.constexpr, BLOCK: tl.constexpr,
                       WIDE: tl.constexpr):
    i = as_offset(tl.program_id(0), WIDE)
    w = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    page = tl.load(ids_ptr + i).to(tl.int64)
    src_row = page if GATHER else i
    dst_row = i if GATHER else page
    x = tl.load(src_ptr + src_row * words + w, mask=w < words)
    tl.store(dst_ptr + dst_row * words + w, x, mask=w < words)


def _words(t: torch.Tensor) -> torch.Tensor:
    # move 4-byte words when the page size allows it: 4x fewer elements, same bytes
    return t.view(torch.int32) if t.shape[1] % 4 == 0 else t


def _launch(src: torch.Tensor, dst: torch.Tensor, ids: torch.Tensor, gather: bool) -> None:
    if ids.shape[0] == 0:
        return
    s, d = _words(src), _words(dst)
    block = 1024
    grid = (ids.shape[0], triton.cdiv(s.shape[1], block))
    _copy_pages_kernel[grid](s, d, ids, s.shape[1], GATHER=gather, BLOCK=block, WIDE=wide())


def gather_pages(pages: torch.Tensor, page_ids: torch.Tensor) -> torch.Tensor:
    """``out[i] = pages[page_ids[i]]``: ``[P, page_bytes]`` uint8 -> ``[n, page_bytes]``."""
    contract.gather_pages(pages, page_ids)
    out = torch.empty(page_ids.shape[0], pages.shape[1], dtype=torch.uint8, device=pages.device)
    _launch(pages, out, page_ids, gather=True)
    return out


def scatter_pages(packed: torch.Tensor, pages: torch.Tensor, page_ids: torch.Tensor) -> None:
    """``pages[page_ids[i]] = packed[i]`` (page ids distinct)."""
    contract.scatter_pages(packed, pages, page_ids)
    _launch(packed, pages, page_ids, gather=False)
