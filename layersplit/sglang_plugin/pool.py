"""LayerSplit pool for SGLang: a subclass of SGLang's ``LayerSplitDSATokenToKVPool``.

Upstream broadcasts a non-owned layer's **whole** pool-sized buffer (``size + page_size`` rows of
KV, every page of index keys) each time a rank reads it, into one scratch buffer, so a prefetch of
layer l + 1 must first wait for layer l. This subclass:

* broadcasts only the **batch's pages** (the pages of every request in the forward batch, prefix and
  new tokens; :meth:`set_forward_pages`, fed by the hook on the DSA backend's
  ``init_forward_metadata``), both for the latent KV and for the indexer keys;
* stages the KV broadcast in **two batch-sized buffers** (layer l uses staging slot l % 2), so the
  model's one-layer-ahead ``prefetch_kv_buffer(l + 1)`` runs on the broadcast stream while layer l
  still reads; a layer's rows are scattered into upstream's landing buffer (``remote_kv_buffer``,
  still pool-sized because SGLang's attention backend addresses it with pool locations) on the
  forward stream right before the layer's first read or write;
* lets the owner read its own buffer in place (upstream copies it into the scratch buffer first);
* always waits for HiCache's per-layer load before broadcasting: the KV broadcast waits the layer's
  KV-ready event, the indexer-key broadcast only its indexer-ready event
  (:class:`layersplit.sglang_plugin.hicache.SplitLayerDoneCounter`), so the indexer starts while the
  KV rows are still loading.

Ownership stays upstream's contiguous split: SGLang's PD transfer labels a rank's layers as one range
``[layer_shard_start, layer_shard_start + len(buffers))`` and its HiCache host pools assume the same,
so any other layout would land layers under the wrong index on the decode side.

Every rank runs the same state machine (which layer each staging slot and the landing buffer hold),
independent of ownership, because a broadcast is a collective that every rank must enter in the
same order. Without forward pages (a batch the hook did not see) it falls back to upstream's
whole-buffer broadcast.
"""

from __future__ import annotations

import logging

import torch

from dsa_kernels import envs
from layersplit.sglang_plugin import compat

log = logging.getLogger(__name__)


def _wait_index(counter, idx: int) -> None:
    """Wait for the indexer keys of local layer ``idx``: the indexer-ready event where the counter has
    one (our HiCache adapter), else the whole layer (upstream's counter)."""
    if counter is not None:
        getattr(counter, "wait_index_until", counter.wait_until)(idx)


def make_index_cache_class(base: type | None = None) -> type:
    """The indexer-key cache of our pool: row-only broadcast, indexer-ready waits."""
    base = base or compat.resolve("layer_split_index_cache")

    class LayerSplitPlusIndexKeyCache(base):
        def get_buffer(self, layer_id: int) -> torch.Tensor:
            _wait_index(self.pool.layer_transfer_counter, layer_id - self.pool.start_layer)
            return self.get_broadcastable_buffer(layer_id)

        def get_broadcastable_buffer(self, layer_id: int) -> torch.Tensor:
            pool = self.pool
            pages = pool.forward_pages
            if pages is None:
                return super().get_broadcastable_buffer(layer_id)  # whole buffer, upstream
            local = layer_id - pool.start_layer
            owned = pool._is_layer_owned(layer_id)
            if self.remote_layer_id != layer_id:
                # hazard: the owner's index pages of this layer may still be loading from host
                _wait_index(pool.layer_transfer_counter, local)
                staging = pool._index_staging(pages.numel(), self.remote_buffer)
                if owned:
                    torch.index_select(self.buffer[local], 0, pages, out=staging)
                pool._broadcast_tensor_from_owner(staging, layer_id, src_tensor=staging if owned else None)
                pool.broadcast_bytes["index"] += staging.nbytes
                if not owned:
                    self.remote_buffer.index_copy_(0, pages, staging)
                self.remote_layer_id = layer_id
            return self.buffer[local] if owned else self.remote_buffer  # upstream's raw layout for both

    return LayerSplitPlusIndexKeyCache


def make_pool_class(base: type | None = None, index_cache_base: type | None = None) -> type:
    """Build the subclass of ``base`` (default: the installed ``LayerSplitDSATokenToKVPool``)."""
    base = base or compat.resolve("layer_split_pool")
    index_cache_cls = make_index_cache_class(index_cache_base)

    class LayerSplitPlusDSATokenToKVPool(base):
        def __init__(self, *args, layer_shard_rank: int, layer_shard_size: int, **kwargs):
            self.forward_pages: torch.Tensor | None = None  # sorted page ids of the current batch
            self._forward_rows: torch.Tensor | None = None
            self._slot_layer: list[int | None] = [None, None]  # layer staged in each KV staging slot
            self._events: dict[int, object] = {}  # slot -> event guarding an in-flight broadcast
            self._landing_layer: int | None = None  # layer whose batch rows the landing buffer holds
            self.broadcast_bytes = {"kv": 0, "index": 0}  # bytes this rank entered into broadcasts
            self._staging_rows = envs.sglang_scratch_tokens()
            self._unsafe_skip = envs.sglang_unsafe_skip()
            super().__init__(*args, layer_shard_rank=layer_shard_rank, layer_shard_size=layer_shard_size, **kwargs)

        # buffers -------------------------------------------------------------------------------
        def _create_buffers(self):
            super()._create_buffers()
            cap = -(-min(self._staging_rows, self.size + self.page_size) // self.page_size) * self.page_size
            self.kv_staging = [self._empty_rows(cap), self._empty_rows(cap)]
            self.index_staging = None  # allocated with the index cache's row width on first use

        def _empty_rows(self, rows: int) -> torch.Tensor:
            return torch.empty((rows, 1, self.kv_cache_dim), dtype=self.store_dtype, device=self.device)

        def _create_index_key_cache(self):
            return index_cache_cls(self, self.index_buf_size)

        def _clear_buffers(self):
            del self.kv_staging
            self.index_staging = None
            super()._clear_buffers()

        def _index_staging(self, pages: int, like: torch.Tensor) -> torch.Tensor:
            if self.index_staging is None or self.index_staging.shape[0] < pages:
                self.index_staging = torch.empty((max(pages, self._staging_rows // self.page_size), like.shape[1]),
                                                 dtype=like.dtype, device=like.device)
            return self.index_staging[:pages]

        def kv_scratch_bytes(self) -> int:
            """Bytes of remote-layer scratch: upstream's landing buffer, the two KV staging slots and
            the index staging and landing buffers."""
            bufs = [self.remote_kv_buffer, *self.kv_staging, self.index_key_cache.remote_buffer]
            if self.index_staging is not None:
                bufs.append(self.index_staging)
            return sum(b.numel() * b.element_size() for b in bufs)

        # the forward batch's pages -------------------------------------------------------------
        def set_forward_pages(self, pages: torch.Tensor | None) -> None:
            """Pages (page ids) whose rows the next forward reads; ``None``: unknown, broadcast whole
            buffers. Every CP rank must pass the same pages (it runs the same batch)."""
            self._drain()
            self._slot_layer = [None, None]
            self._landing_layer = None
            self.index_key_cache.remote_layer_id = None
            if pages is None:
                self.forward_pages = self._forward_rows = None
                return
            pages = torch.unique(pages.to(device=self.device, dtype=torch.int64))  # sorted
            n_pages = (self.size + self.page_size) // self.page_size
            if pages.numel() and (int(pages[0]) < 0 or int(pages[-1]) >= n_pages):
                raise ValueError(f"set_forward_pages: expected page ids in [0, {n_pages}), got "
                                 f"[{int(pages[0])}, {int(pages[-1])}]")
            rows = (pages[:, None] * self.page_size + torch.arange(self.page_size, device=self.device)).flatten()
            if rows.numel() > self.kv_staging[0].shape[0]:
                log.info("layersplit: batch of %d rows exceeds the KV staging slots (%d rows); growing them",
                         rows.numel(), self.kv_staging[0].shape[0])
                self.kv_staging = [self._empty_rows(rows.numel()), self._empty_rows(rows.numel())]
            self.forward_pages, self._forward_rows = pages, rows

        def _drain(self) -> None:
            for slot in list(self._events):
                self._ready(slot)

        # KV: staged broadcast of the batch's rows ----------------------------------------------
        def _fetch(self, layer_id: int, counter=None, counter_idx: int | None = None) -> None:
            """Broadcast ``layer_id``'s batch rows from its owner into staging slot ``layer_id % 2``
            (every rank calls this). CUDA: on the pool's broadcast stream after the current stream's
            work, an event per slot guards the result. CPU (gloo): complete when it returns."""
            counter = counter or self.layer_transfer_counter

            def wait_loaded():  # hazard: the owner's rows of this layer may still be loading from host
                if counter is not None:
                    counter.wait_until(layer_id - self.start_layer if counter_idx is None else counter_idx)

            slot = layer_id % 2
            self._ready(slot)  # the slot's previous broadcast must be complete before it is reused
            rows = self._forward_rows
            staging = self.kv_staging[slot][: rows.numel()]
            owned = self._is_layer_owned(layer_id)

            def send():
                if owned:  # the owner gathers its batch rows; the others receive into the slot
                    torch.index_select(self.kv_buffer[layer_id - self.start_layer], 0, rows, out=staging)
                self._broadcast_tensor_from_owner(staging, layer_id, src_tensor=staging if owned else None,
                                                  use_layer_broadcast_comm=True)

            if self._async_device():
                dm = self.device_module
                self.kv_broadcast_stream.wait_stream(dm.current_stream())
                with dm.stream(self.kv_broadcast_stream):
                    wait_loaded()  # the broadcast stream waits for the load, the forward stream does not
                    self._run(send, "broadcast")
                    event = dm.Event()
                    event.record(self.kv_broadcast_stream)
                self._events[slot] = event
            else:
                wait_loaded()
                send()
            self.broadcast_bytes["kv"] += staging.nbytes
            self._slot_layer[slot] = layer_id

        def _async_device(self) -> bool:
            """CUDA, or the emulated device module of the CPU race test: broadcasts run on a side stream."""
            return str(self.device).startswith("cuda") or hasattr(self.device_module, "launch")

        def _run(self, fn, name: str = "op") -> None:
            """Run ``fn`` on the current stream: queued there by the emulated device module, else now
            (on CUDA the kernels it launches are queued on the current stream)."""
            launch = getattr(self.device_module, "launch", None)
            launch(fn, name) if launch else fn()

        def _ready(self, slot: int) -> None:
            event = self._events.pop(slot, None)
            if "slot_wait" in self._unsafe_skip:  # UNSAFE: stress tests only
                return
            if event is not None:  # hazard: read (or overwrite) the slot only after its broadcast completed
                self.device_module.current_stream().wait_event(event)

        def _land(self, layer_id: int) -> None:
            """Make ``layer_id`` the landing buffer's layer: scatter its staged rows (non-owners)."""
            slot = layer_id % 2
            if self._slot_layer[slot] != layer_id:
                self._fetch(layer_id)
            self._ready(slot)
            if not self._is_layer_owned(layer_id):
                rows, staged = self._forward_rows, self.kv_staging[slot][: self._forward_rows.numel()]
                self._run(lambda: self.remote_kv_buffer.index_copy_(0, rows, staged), "scatter")
            self._slot_layer[slot] = None
            self._landing_layer = layer_id

        def prefetch_kv_buffer(self, layer_id: int, layer_transfer_counter=None, layer_transfer_idx=None) -> None:
            if self.forward_pages is None:
                return super().prefetch_kv_buffer(layer_id, layer_transfer_counter, layer_transfer_idx)
            if self._landing_layer != layer_id and self._slot_layer[layer_id % 2] != layer_id:
                self._fetch(layer_id, layer_transfer_counter, layer_transfer_idx)

        def _get_broadcastable_kv_buffer(self, layer_id: int):
            if self.forward_pages is None:
                return super()._get_broadcastable_kv_buffer(layer_id)
            if self._landing_layer != layer_id:
                self._land(layer_id)
            if self._is_layer_owned(layer_id):
                return self.kv_buffer[layer_id - self.start_layer]
            return self.remote_kv_buffer

        def _write_rows(self, layer_id: int, write) -> None:
            """Apply ``write(buffer)`` to the owner's buffer and, where it holds this layer, the landing
            buffer; a layer staged but not yet landed is landed first so its new rows are not lost."""
            if self._slot_layer[layer_id % 2] == layer_id:
                self._land(layer_id)  # also waits for an in-flight send of the owner's buffer
            if self._is_layer_owned(layer_id):
                buf = self.kv_buffer[layer_id - self.start_layer]
            elif self._landing_layer == layer_id:
                buf = self.remote_kv_buffer
            else:
                return
            self._run(lambda: write(buf), "write")

        def set_mla_kv_buffer(self, layer, loc_info, cache_k_nope, cache_k_rope):
            if self.forward_pages is None:
                return super().set_mla_kv_buffer(layer, loc_info, cache_k_nope, cache_k_rope)
            from sglang.srt.mem_cache.memory_pool import unwrap_write_loc

            loc, _, _ = unwrap_write_loc(loc_info)
            self._write_rows(layer.layer_id, lambda buf: self._write_mla_kv_buffer(buf, loc, cache_k_nope, cache_k_rope))

        def set_kv_buffer(self, layer, loc_info, cache_k, cache_v):
            if self.forward_pages is None:
                return super().set_kv_buffer(layer, loc_info, cache_k, cache_v)
            from sglang.srt.mem_cache.memory_pool import unwrap_write_loc

            loc, _, _ = unwrap_write_loc(loc_info)
            if cache_k.dtype != self.dtype:
                cache_k = cache_k.to(self.dtype)
            rows = cache_k.view(self.store_dtype) if self.store_dtype != self.dtype else cache_k

            def write(buf):
                buf[loc] = rows

            self._write_rows(layer.layer_id, write)

        def move_kv_cache(self, tgt_loc, src_loc):
            super().move_kv_cache(tgt_loc, src_loc)
            self.set_forward_pages(self.forward_pages)  # moved rows: staged and landed copies are stale

    return LayerSplitPlusDSATokenToKVPool


# The upstream methods this adapter overrides or calls, with the signatures it was written against.
# tests/layersplit/test_sglang_plugin.py fails if any of them disappears or changes signature.
UPSTREAM_CONTRACT = {
    "layer_split_pool": {
        "_is_layer_owned": "(self, layer_id: 'int') -> 'bool'",
        "_owned_local_layer_range": "(self) -> 'tuple[int, int]'",
        "_create_buffers": "(self)",
        "_create_index_key_cache": "(self) -> 'IndexKeyCache'",
        "_clear_buffers": "(self)",
        "prefetch_kv_buffer": "(self, layer_id: 'int', layer_transfer_counter: 'Optional[LayerDoneCounter]' = None, "
                              "layer_transfer_idx: 'Optional[int]' = None) -> 'None'",
        "_get_broadcastable_kv_buffer": "(self, layer_id: 'int') -> 'torch.Tensor'",
        "set_mla_kv_buffer": "(self, layer: 'RadixAttention', loc_info, cache_k_nope: 'torch.Tensor', "
                             "cache_k_rope: 'torch.Tensor')",
        "set_kv_buffer": "(self, layer: 'RadixAttention', loc_info, cache_k: 'torch.Tensor', cache_v: 'torch.Tensor')",
        "move_kv_cache": "(self, tgt_loc: 'torch.Tensor', src_loc: 'torch.Tensor')",
        "_broadcast_tensor_from_owner": "(self, tensor: 'torch.Tensor', layer_id: 'int', src_tensor: "
                                        "'Optional[torch.Tensor]' = None, use_layer_broadcast_comm: 'bool' = False) "
                                        "-> 'torch.Tensor'",
        "_write_mla_kv_buffer": "(self, dst_buffer: 'torch.Tensor', loc: 'torch.Tensor', cache_k_nope: "
                                "'torch.Tensor', cache_k_rope: 'torch.Tensor') -> 'None'",
        "get_key_buffer": "(self, layer_id: 'int')",
        "get_contiguous_buf_infos": "(self)",
    },
    "layer_split_index_cache": {
        "get_buffer": "(self, layer_id: 'int') -> 'torch.Tensor'",
        "get_broadcastable_buffer": "(self, layer_id: 'int') -> 'torch.Tensor'",
        "_kernel_view": "(self, buffer: 'torch.Tensor') -> 'torch.Tensor'",
        "state_buf_infos": "(self)",
    },
}
