"""Page copies between two paged pools (host <-> device, or within one device), one layer part at a time.

Called from a stream's worker (emulated) or under a stream context (CUDA), so every op here is
ordered on that stream. The page ids reach their devices once per transfer (:class:`PageIds`).

* **Across tiers** (host pool <-> device pool) the pages move as runs of consecutive page ids, one
  ``copy_(non_blocking=True)`` per run, straight between the pinned host pool and the device pool:
  a DMA on the copying stream. No host-side op touches the pages, so nothing reads pinned memory
  before a device->host copy has landed, and nothing gathers host pages before the stream's fences
  (an offload still writing them) are met: there is no host half to run out of stream order.
* **Within a tier** (device -> device) a gather kernel packs the source pages and a scatter kernel
  unpacks them, both on the stream.

The same code runs on CUDA and on the emulated runtime; the sanitizer sees the cross-tier copies
as DMA on the stream (:mod:`hicache.sanitizer`).
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


def page_runs(src_pages: list[int], dst_pages: list[int]) -> list[tuple[int, int, int]]:
    """``(src_start, dst_start, n)`` runs where both page lists advance by one."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src_pages, dst_pages):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs


class PageIds:
    """The page ids of one transfer, given on the host.

    Across tiers: the runs of consecutive pages (host integers, no tensor). Within a tier: id
    tensors moved to the device once, by :meth:`stage` as the first operation on the copying stream.
    """

    def __init__(self, src: PagedDSABuffers, src_pages: list[int], dst: PagedDSABuffers, dst_pages: list[int]) -> None:
        if len(src_pages) != len(dst_pages):
            raise ValueError(f"dst_pages: expected {len(src_pages)} pages (one per source page), got {len(dst_pages)}")
        self.cross_tier = src.host_tier != dst.host_tier
        self.count = len(src_pages)
        self.runs = page_runs(list(src_pages), list(dst_pages))
        self._devices = (src.device, dst.device)
        self.src = self.dst = None
        if not self.cross_tier:
            self.src, self.dst = host_ids(src_pages, src.device), host_ids(dst_pages, dst.device)

    def stage(self) -> None:
        if self.src is not None:  # asynchronous from pinned memory; this object keeps the host copies alive
            self.src, self.dst = (x.to(d, non_blocking=True) for x, d in zip((self.src, self.dst), self._devices))


def host_ids(values: list[int], device: torch.device) -> torch.Tensor:
    """Page ids built by the host for a copy to ``device`` (pinned for a CUDA device, so the copy
    is asynchronous instead of a host sync on the copying stream)."""
    with sanitizer.host_work():  # built by the host, read by the copying stream
        return torch.tensor(values, dtype=torch.int64, pin_memory=torch.device(device).type == "cuda")


def copy_layer_part(src: PagedDSABuffers, dst: PagedDSABuffers, ids: PageIds, layer: int, part: str) -> int:
    """``dst[layer].part[dst pages] = src[layer].part[src pages]``; returns the bytes copied."""
    src_view, dst_view = part_pages(src, layer, part), part_pages(dst, layer, part)
    if ids.cross_tier:
        for s, d, n in ids.runs:
            dst_view[d:d + n].copy_(src_view[s:s + n], non_blocking=True)
    elif ids.count:
        scatter_pages(gather_pages(src_view, ids.src), dst_view, ids.dst)
    return ids.count * src_view.shape[1]
