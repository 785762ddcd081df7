"""Page copies between two paged pools (host <-> device, or within one device), one layer part at a time.

Called from a stream's worker (emulated) or under a stream context (CUDA), so every tensor op here
is ordered on that stream; the page ids reach their devices once per transfer (:class:`PageIds`). Cross-device copies stage the packed pages in a pinned buffer and
copy them with ``non_blocking=True``; the staging tensor is returned so the caller keeps it alive
until the stream's event for this copy has completed.
"""

from __future__ import annotations

import torch

from dsa_kernels import gather_pages, scatter_pages
from hicache import sanitizer
from hicache.paged_buffers import PagedDSABuffers


def part_pages(pool: PagedDSABuffers, layer: int, part: str) -> torch.Tensor:
    """``[num_pages, page_bytes]`` uint8 view of ``layer``'s ``part`` ('kv' or 'index')."""
    if part == "kv":
        return pool.kv_pages(layer)
    buf = pool.index_pages(layer)
    assert buf is not None, f"layer {layer} has no indexer-key cache"
    return buf


class PageIds:
    """The page ids of one transfer, given on the host, moved to their pools' devices once.

    Call :meth:`stage` as the first operation on the copying stream; every layer's copy then uses
    the staged tensors instead of moving the ids again.
    """

    def __init__(self, src: PagedDSABuffers, src_pages: list[int], dst: PagedDSABuffers, dst_pages: list[int]) -> None:
        self._devices = (src.device, dst.device)
        with sanitizer.host_work():  # built by the host, read by the copying stream
            self.src = torch.tensor(src_pages, dtype=torch.int64)
            self.dst = torch.tensor(dst_pages, dtype=torch.int64)

    def stage(self) -> None:
        self.src, self.dst = self.src.to(self._devices[0]), self.dst.to(self._devices[1])


def copy_layer_part(src: PagedDSABuffers, dst: PagedDSABuffers, ids: PageIds, layer: int, part: str) -> list[torch.Tensor]:
    """``dst[layer].part[ids.dst] = src[layer].part[ids.src]``; returns the staging buffers."""
    packed = gather_pages(part_pages(src, layer, part), ids.src)
    staging = [packed]
    if dst.device != src.device:
        if dst.device.type == "cuda" and not packed.is_pinned():
            packed = packed.pin_memory()  # an async H2D copy needs a pinned source
            staging.append(packed)
        packed = packed.to(dst.device, non_blocking=True)
        staging.append(packed)
    scatter_pages(packed, part_pages(dst, layer, part), ids.dst)
    return staging
