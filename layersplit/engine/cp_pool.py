"""The CP KV pools behind one interface: ``redundant`` (every layer on every rank, SGLang CP today)
and ``layersplit`` (owned layers at full capacity + two batch-sized scratch slots).

``read_buffers(layer, plan)`` returns what the forward of ``layer`` reads: the KV buffer, the
indexer buffer and the page table that maps the batch's request positions into them. The KV buffers
hold rows of the spec's ``kv_dtype`` (bf16, or fp8 as uint8 rows); a scratch slot's page view is uint8
for both, so a broadcast lands in it as bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hicache.device_pool import DSADevicePool
from hicache.paged_buffers import DSACacheSpec, PagedDSABuffers
from layersplit.engine.batch_plan import BatchPlan
from layersplit.plan.choices import MODES  # re-exported
from layersplit.plan.config import ModelConfig
from layersplit.plan.ownership import OwnershipPlan


def cache_spec(model: ModelConfig, kv_dtype: str = "bf16") -> DSACacheSpec:
    """The :class:`~hicache.paged_buffers.DSACacheSpec` of ``model``'s per-layer caches."""
    return DSACacheSpec(model.num_layers, model.kv_lora_rank, model.qk_rope_head_dim, model.index_head_dim,
                        model.indexer_layer_ids, kv_dtype)


@dataclass
class ReadBuffers:
    kv: torch.Tensor
    index: torch.Tensor | None
    table: torch.Tensor
    new_slots: torch.Tensor  # where this batch's new rows go in ``kv`` / ``index``


class CPPool:
    """``num_pages``: the pool capacity (pages per held layer); ``scratch_pages``: per scratch slot."""

    def __init__(self, mode: str, spec: DSACacheSpec, num_pages: int, rank: int, ownership: OwnershipPlan,
                 scratch_pages: int = 0, device: torch.device | str = "cpu") -> None:
        if mode not in MODES:
            raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
        self.mode, self.spec, self.rank, self.ownership = mode, spec, rank, ownership
        layers = None if mode == "redundant" else ownership.owned_layers(rank)
        self.pool = DSADevicePool(spec, num_pages, device, layers)
        self.scratch: list[PagedDSABuffers] = []
        if mode == "layersplit" and len(self.pool.layers) < spec.num_layers:
            if scratch_pages < 1:
                raise ValueError(f"scratch_pages: expected >= 1 for layersplit, got {scratch_pages}")
            remote = [layer for layer in range(spec.num_layers) if layer not in self.pool.layers]
            widest = max(remote, key=spec.page_bytes)  # a slot must fit any remote layer (with its indexer keys)
            self.scratch = [PagedDSABuffers(spec, scratch_pages, device, layers=(widest,)) for _ in range(2)]
            self._slot_layer = widest
            # double buffer: the i-th remote layer uses slot i % 2, so layer l+1's prefetch never
            # overwrites the slot that layer l still reads
            self.slot_of = {layer: i % 2 for i, layer in enumerate(remote)}

    def holds(self, layer: int) -> bool:
        return layer in self.pool.kv

    def slot(self, layer: int) -> PagedDSABuffers:
        return self.scratch[self.slot_of[layer]]

    def slot_pages(self, layer: int, part: str) -> torch.Tensor:
        """``[scratch_pages, page_bytes]`` uint8 view of ``layer``'s scratch slot."""
        s = self.slot(layer)
        return s.kv_pages(self._slot_layer) if part == "kv" else s.index[self._slot_layer]

    def read_buffers(self, layer: int, plan: BatchPlan) -> ReadBuffers:
        if self.holds(layer):
            return ReadBuffers(self.pool.kv[layer], self.pool.index.get(layer), plan.pool_table, plan.new_pool_slots)
        s = self.slot(layer)
        index = s.index[self._slot_layer] if self.spec.has_indexer(layer) else None
        return ReadBuffers(s.kv[self._slot_layer], index, plan.scratch_table, plan.new_scratch_slots)

    def check_fits(self, plan: BatchPlan) -> None:
        if self.scratch and plan.scratch_pages_needed > self.scratch[0].num_pages:
            raise ValueError(f"batch: expected <= {self.scratch[0].num_pages} scratch pages (max-batch-tokens), "
                             f"got {plan.scratch_pages_needed}")

    def kv_bytes(self) -> dict[str, int]:
        """Allocated cache bytes on this rank: owned (pool) and scratch."""
        scratch = sum(s.nbytes for s in self.scratch)
        return {"owned": self.pool.nbytes, "scratch": scratch, "total": self.pool.nbytes + scratch}
