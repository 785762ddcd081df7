"""Paged DSA cache on the device: every layer (or a given subset), with a ref-counted page allocator."""

from __future__ import annotations

import torch

from hicache.allocator import PageAllocator
from hicache.paged_buffers import DSACacheSpec, PagedDSABuffers


class DSADevicePool(PagedDSABuffers):
    """The device KV pool: ``num_pages`` pages of 64 tokens for each held layer.

    Example::

        pool = DSADevicePool(spec, num_pages=1024, device="cuda")
        pages = pool.allocator.alloc(3)
        pool.set_mla_kv_buffer(0, loc, k_nope, k_rope)
    """

    PADDING_PAGE = 0

    def __init__(self, spec: DSACacheSpec, num_pages: int, device: torch.device | str = "cpu",
                 layers: tuple[int, ...] | None = None, padding_page: bool = False) -> None:
        """``padding_page``: reserve page 0 (never allocated, never written after init) for padded
        page-table entries and masked top-k slots, as SGLang reserves slot 0; the pool then hands
        out ``num_pages - 1`` pages."""
        super().__init__(spec, num_pages, device, layers)
        self.allocator = PageAllocator(num_pages, name="device pool", reserved=1 if padding_page else 0)
