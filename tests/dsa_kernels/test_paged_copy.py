"""Paged gather/scatter: exact byte movement, round trips through an MLA cache view."""

from __future__ import annotations

import pytest
import torch

from dsa_kernels import layout
from tests.dsa_kernels.helpers import op

# (pages in the pool, pages moved, page bytes): empty, one, odd byte count, GLM-5 indexer / bf16 KV pages
SHAPES = [(4, 0, 8448), (4, 1, 8448), (9, 5, 1001), (70, 64, 132), (3, 3, 64 * 1152), (17, 7, 64 * 656)]
IDS = [f"P{p}-n{n}-B{b}" for p, n, b in SHAPES]


@pytest.mark.parametrize("pool,n,page_bytes", SHAPES, ids=IDS)
def test_gather_then_scatter_exact(backend, device, pool, n, page_bytes):
    gen = torch.Generator().manual_seed(pool + n)
    pages = torch.randint(0, 256, (pool, page_bytes), dtype=torch.uint8, generator=gen).to(device)
    ids = torch.randperm(pool, generator=gen)[:n].to(device)
    packed = op("gather_pages", backend, device)(pages, ids)
    assert torch.equal(packed.cpu(), pages.cpu()[ids.cpu()])
    dst = torch.zeros_like(pages)
    op("scatter_pages", backend, device)(packed, dst, ids)
    want = torch.zeros_like(pages.cpu())
    want[ids.cpu()] = pages.cpu()[ids.cpu()]
    assert torch.equal(dst.cpu(), want)


def test_mla_cache_pages_view(backend, device):
    """A slot-indexed bf16 KV cache moves as whole 64-row pages through ``as_pages``."""
    kv = torch.randn(4 * 64, 576).to(torch.bfloat16).to(device)
    pages = layout.as_pages(kv, rows_per_page=64)
    assert pages.shape == (4, 64 * 1152) and pages.data_ptr() == kv.data_ptr()
    packed = op("gather_pages", backend, device)(pages, torch.tensor([2], device=device))
    assert torch.equal(packed.view(torch.bfloat16).view(64, 576), kv[128:192])


def test_errors(device):
    with pytest.raises(ValueError, match="expected first dim divisible by rows_per_page=64"):
        layout.as_pages(torch.zeros(100, 576, dtype=torch.bfloat16), 64)
    with pytest.raises(ValueError, match="packed: expected shape"):
        op("scatter_pages", "triton", device)(torch.zeros(2, 10, dtype=torch.uint8, device=device),
                                              torch.zeros(4, 12, dtype=torch.uint8, device=device),
                                              torch.tensor([0, 1], device=device))
