"""Host-memory DSA cache tier: same layouts as the device pool, pinned when CUDA is present.

``layers`` may hold a subset: with LayerSplit each CP rank offloads and reloads only its owned layers.
"""

from __future__ import annotations

import torch

from hicache import sanitizer
from hicache.allocator import PageAllocator
from hicache.paged_buffers import DSACacheSpec, PagedDSABuffers


class DSAHostPool(PagedDSABuffers):
    host_tier = True

    def __init__(self, spec: DSACacheSpec, num_pages: int, layers: tuple[int, ...] | None = None,
                 pin_memory: bool | None = None) -> None:
        # pinned host memory makes H2D copies asynchronous; pin_memory() needs an accelerator
        pin = torch.cuda.is_available() if pin_memory is None else pin_memory
        with sanitizer.host_work():  # host memory, made by the host
            super().__init__(spec, num_pages, "cpu", layers, pin_memory=pin)
        self.pinned = pin
        sanitizer.mark_host_memory(*self.kv.values(), *self.index.values())
        self.allocator = PageAllocator(num_pages, name="host pool")
