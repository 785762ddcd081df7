"""The plug-in pool's buffers, all allocated at start-up and counted in SGLang's KV budget: owned
layers (+ upstream's landing layer with ``pool`` landing), two KV and two indexer-key staging slots
(:mod:`.staging`), the page remap table (``batch`` landing). Never grown after start-up.

:class:`PoolBuffersMixin` holds the methods; :class:`layersplit.sglang_plugin.pool.LayerSplitPoolMixin`
builds on it (``landing``, ``startup_plan``, ``_kv``, ``_index`` are set by its constructor).
"""

from __future__ import annotations

import contextlib

import torch

from lsconfig import envs
from layersplit.plan import sizing


class PoolBuffersMixin:
    """Allocation and byte accounting, for a pool that also derives from SGLang's ``LayerSplitDSATokenToKVPool``."""

    # allocation (upstream's constructor calls _create_buffers and _create_index_key_cache) -----------
    def _create_buffers(self):
        """Owned layers (+ upstream's landing layer, ``pool`` landing), both KV staging slots and
        the remap table: all at start-up, in the KV memory-saver region and ``custom_mem_pool``."""
        if self.landing == "pool":
            super()._create_buffers()
        else:
            self._create_owned_buffers()
        with self._kv_region():
            self._kv.allocate(self._slot_pages() * self.page_size, (1, self.kv_cache_dim), self.store_dtype,
                              self.device)
            if self.landing == "batch":
                self._slot_of_page = torch.zeros(sizing.remap_pages(self.size, self.page_size),
                                                 dtype=torch.int64, device=self.device)

    def _create_owned_buffers(self) -> None:
        """Upstream's owned-only layer buffers, broadcast stream and communicator, without the
        pool-sized ``remote_kv_buffer`` (a forward that needs it is refused: :meth:`require_pool_landing`)."""
        self._log_layer_shard_plan()
        with self._kv_region():
            rows = [self.size + self.page_size if self._is_layer_owned(self.start_layer + i) else 0
                    for i in range(self.layer_num)]
            self.kv_buffer = [torch.zeros((n, 1, self.kv_cache_dim), dtype=self.store_dtype, device=self.device)
                              for n in rows]
        self.remote_kv_buffer = None
        self.remote_kv_layer_id = self.pending_remote_kv_layer_id = None
        self.pending_remote_kv_broadcast = False
        self.device_module = torch.get_device_module(self.device)
        self.kv_broadcast_stream = self.device_module.Stream()
        self._init_layer_broadcast_comm()

    def _create_index_key_cache(self):
        return self.index_cache_cls(self, self.index_buf_size)

    def _allocate_index_slots(self) -> None:
        """The indexer-key slots (after upstream's constructor set the index geometry)."""
        with self._kv_region():
            self._index.allocate(self._slot_pages(), self._index_row_shape(), self.index_k_with_scale_buffer_dtype,
                                 self.device)

    def _kv_region(self):
        """SGLang's KV memory-saver region and ``custom_mem_pool``, where upstream allocates its pool."""
        from sglang.srt.mem_cache.memory_pool import GPU_MEMORY_TYPE_KV_CACHE

        stack = contextlib.ExitStack()
        stack.enter_context(self.memory_saver_adapter.region(GPU_MEMORY_TYPE_KV_CACHE))
        if self.custom_mem_pool:
            stack.enter_context(torch.cuda.use_mem_pool(self.custom_mem_pool))
        return stack

    def _clear_buffers(self):
        for slots in (self._kv, self._index):
            slots.buffers = [None] * len(slots.buffers)
        super()._clear_buffers()

    def _slot_pages(self) -> int:
        """The start-up plan's slot pages; without one (a pool built outside a server),
        ``LAYERSPLIT_SGLANG_SCRATCH_TOKENS`` rows, at most the pool's."""
        if self.startup_plan is not None:
            return self.startup_plan.slot_pages
        return sizing.slot_pages(envs.sglang_scratch_tokens(), self.size, self.page_size)

    def _index_row_shape(self) -> tuple:
        return tuple(self.index_key_cache._buffer_shape(1)[1:])

    def require_pool_landing(self, reason: str = "upstream's whole-buffer path") -> None:
        """Upstream's landing layer exists only where the start-up plan chose ``pool`` landing
        (and counted it); a forward that needs it in a ``batch`` pool is a start-up plan error."""
        if self.remote_kv_buffer is None:
            raise RuntimeError(f"layersplit: {reason} needs upstream's pool-sized landing layer, which the "
                               "start-up plan did not allocate (batch landing); the start-up checks "
                               "(layersplit/sglang_plugin/startup.py) should have chosen pool landing")

    # byte accounting -------------------------------------------------------------------------------
    @property
    def kv_staging(self) -> list[torch.Tensor]:
        return self._kv.buffers

    def staging_bytes(self) -> int:
        """Bytes of our staging slots (KV and index keys) and the page remap table."""
        remap = 0 if self._slot_of_page is None else self._slot_of_page.nbytes
        return self._kv.nbytes() + self._index.nbytes() + remap

    def kv_scratch_bytes(self) -> int:
        """Bytes of remote-layer scratch: our staging slots and upstream's landing buffers where
        allocated (``pool`` landing)."""
        landing = [self.remote_kv_buffer, self.index_key_cache.remote_buffer]
        return self.staging_bytes() + sum(b.numel() * b.element_size() for b in landing if b is not None)

    def _check_counted(self) -> None:
        """The bytes allocated beside the owned layers are the ones the budget hook charged."""
        plan = self.startup_plan
        if plan is None:
            return
        row_bytes = self.kv_cache_dim * torch._utils._element_size(self.store_dtype)
        index_bytes = self._index.buffers[0][0].numel() * self._index.buffers[0].element_size()
        assert (row_bytes, index_bytes) == (plan.kv_row_bytes, plan.index_page_bytes), \
            f"staging rows {(row_bytes, index_bytes)} differ from the budget's {plan}"
        assert self.staging_bytes() == plan.staging_bytes + plan.remap_bytes(self.size), \
            (self.staging_bytes(), plan.staging_bytes + plan.remap_bytes(self.size))

    def publish_capacity(self) -> None:
        """Gauge the tokens this pool holds and what upstream's layout (owned layers + a pool-sized
        landing layer of KV rows and index pages) would hold in the same bytes."""
        rows = self.size + self.page_size
        owned_per_token = self.get_kv_size_bytes() / rows
        landing_per_token = (self.kv_cache_dim * torch._utils._element_size(self.store_dtype)
                             + self.index_key_cache._buffer_shape(1)[1] / self.page_size)
        held = self.get_kv_size_bytes() + self.staging_bytes()
        self.metrics.set("pool_tokens", "plugin", self.size)
        upstream = int(held / (owned_per_token + landing_per_token)) - self.page_size
        self.metrics.set("pool_tokens", "upstream", upstream)
