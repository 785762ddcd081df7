"""LayerSplit pool for SGLang: a subclass of SGLang's ``LayerSplitDSATokenToKVPool``.

Upstream broadcasts a non-owned layer's **whole** pool-sized buffer (``size + page_size`` rows of
KV, every page of index keys) each time a rank reads it, into one scratch buffer, so a prefetch of
layer l + 1 must first wait for layer l. This subclass:

* broadcasts only the **batch's pages** (the pages of every request in the forward batch, prefix and
  new tokens; :meth:`set_forward_pages`, fed by the hook on the DSA backend's
  ``init_forward_metadata``), both for the latent KV and for the indexer keys;
* moves the indexer keys of the **prefix** pages off the critical path: they do not change during
  the forward, so they are broadcast one layer ahead on the broadcast stream (with the KV prefetch)
  into two staging slots; only the pages holding new tokens are broadcast when the indexer reads the
  layer, after it stored their keys;
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

from lsconfig import envs
from layersplit.sglang_plugin import compat

log = logging.getLogger(__name__)


def _wait_index(counter, idx: int) -> None:
    """Wait for the indexer keys of local layer ``idx``: the indexer-ready event where the counter has
    one (our HiCache adapter), else the whole layer (upstream's counter)."""
    if counter is not None:
        getattr(counter, "wait_index_until", counter.wait_until)(idx)


class _Slots:
    """Two staging buffers for one kind of rows (KV rows, or indexer-key pages of the prefix), the
    layer each holds, the events guarding broadcasts in flight into them (layer l uses slot l % 2),
    and the layer last scattered into the landing buffer."""

    def __init__(self, kind: str, count: int = 2) -> None:
        self.kind = kind
        self.buffers: list[torch.Tensor | None] = [None] * count
        self.layer: list[int | None] = [None, None]
        self.events: dict[int, object] = {}
        self.landed: int | None = None

    def reserve(self, rows: int, like: torch.Tensor, minimum: int = 0) -> None:
        for i, buf in enumerate(self.buffers):
            if buf is None or buf.shape[0] < rows:
                if buf is not None:
                    log.info("layersplit: a batch of %d %s rows exceeds the staging slots (%d); growing them",
                             rows, self.kind, buf.shape[0])
                self.buffers[i] = torch.empty((max(rows, minimum), *like.shape[1:]), dtype=like.dtype,
                                              device=like.device)

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers if b is not None)


def make_index_cache_class(base: type | None = None) -> type:
    """The indexer-key cache of our pool: prefix pages staged one layer ahead, new pages broadcast
    at read time, indexer-ready waits."""
    base = base or compat.resolve("layer_split_index_cache")

    class LayerSplitPlusIndexKeyCache(base):
        def get_buffer(self, layer_id: int) -> torch.Tensor:
            _wait_index(self.pool.layer_transfer_counter, layer_id - self.pool.start_layer)
            return self.get_broadcastable_buffer(layer_id)

        def get_broadcastable_buffer(self, layer_id: int) -> torch.Tensor:
            pool = self.pool
            if pool.forward_pages is None:
                return super().get_broadcastable_buffer(layer_id)  # whole buffer, upstream
            local = layer_id - pool.start_layer
            owned = pool._is_layer_owned(layer_id)
            if self.remote_layer_id != layer_id:
                pool._land_index_prefix(layer_id)
                new = pool._new_pages
                if new.numel():  # pages with new tokens: their keys were stored just now, by the owner
                    staging = pool._index_new.buffers[0][: new.numel()]
                    source, landing = self.buffer[local], self.remote_buffer

                    def send_new():
                        if owned:
                            torch.index_select(source, 0, new, out=staging)
                        pool._broadcast_tensor_from_owner(staging, layer_id, src_tensor=staging if owned else None)
                        if not owned:
                            landing.index_copy_(0, new, staging)

                    pool._run(send_new, "index_broadcast")
                    pool.broadcast_bytes["index_new"] += staging.nbytes
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
            self._forward_rows: torch.Tensor | None = None  # their token rows
            self._prefix_pages: torch.Tensor | None = None  # batch pages without new tokens
            self._new_pages: torch.Tensor | None = None  # batch pages with new tokens
            self._kv = _Slots("kv")
            self._index_prefix = _Slots("index_prefix")
            self._index_new = _Slots("index_new", count=1)  # the new pages' broadcast is not staged ahead
            # bytes this rank entered into broadcasts: KV rows, prefix index pages (off the critical
            # path when prefetched), new-token index pages (on it)
            self.broadcast_bytes = {"kv": 0, "index_prefix": 0, "index_new": 0}
            self._staging_rows = envs.sglang_scratch_tokens()
            self._unsafe_skip = envs.sglang_unsafe_skip()
            super().__init__(*args, layer_shard_rank=layer_shard_rank, layer_shard_size=layer_shard_size, **kwargs)

        # buffers -------------------------------------------------------------------------------
        def _create_buffers(self):
            super()._create_buffers()
            cap = -(-min(self._staging_rows, self.size + self.page_size) // self.page_size) * self.page_size
            self._kv.reserve(cap, self.remote_kv_buffer)
            log.info("layersplit: KV staging 2 x %d rows = %.3f GB, on top of SGLang's KV-pool plan "
                     "(indexer-key staging follows with the first batch)", cap, self._kv.nbytes() / 1e9)

        @property
        def kv_staging(self) -> list[torch.Tensor]:
            return self._kv.buffers

        def _create_index_key_cache(self):
            return index_cache_cls(self, self.index_buf_size)

        def _clear_buffers(self):
            for slots in (self._kv, self._index_prefix, self._index_new):
                slots.buffers = [None] * len(slots.buffers)
            super()._clear_buffers()

        def kv_scratch_bytes(self) -> int:
            """Bytes of remote-layer scratch: upstream's two landing buffers (KV, index keys) and our
            staging slots."""
            landing = [self.remote_kv_buffer, self.index_key_cache.remote_buffer]
            return (sum(b.numel() * b.element_size() for b in landing)
                    + sum(s.nbytes() for s in (self._kv, self._index_prefix, self._index_new)))

        # the forward batch's pages -------------------------------------------------------------
        def set_forward_pages(self, pages: torch.Tensor | None, new_pages: torch.Tensor | None = None) -> None:
            """Pages (page ids) the next forward reads, and among them ``new_pages``, those its new
            tokens are written to (``None``: treat every page as new, so no indexer keys are
            prefetched). ``pages=None``: unknown, broadcast whole buffers (upstream). Every CP rank
            must pass the same pages (it runs the same batch)."""
            self._drain()
            for slots in (self._kv, self._index_prefix):
                slots.layer, slots.landed = [None, None], None
            self.index_key_cache.remote_layer_id = None
            if pages is None:
                self.forward_pages = self._forward_rows = self._prefix_pages = self._new_pages = None
                return
            n_pages = (self.size + self.page_size) // self.page_size
            pages = self._check_pages(pages, n_pages, "pages")
            new = pages if new_pages is None else self._check_pages(new_pages, n_pages, "new_pages")
            if new_pages is not None and not bool(torch.isin(new, pages).all()):
                raise ValueError("set_forward_pages: expected new_pages to be a subset of pages, got "
                                 f"{sorted(set(new.tolist()) - set(pages.tolist()))} outside it")
            rows = (pages[:, None] * self.page_size + torch.arange(self.page_size, device=self.device)).flatten()
            self._kv.reserve(rows.numel(), self.remote_kv_buffer)
            index_landing = self.index_key_cache.remote_buffer
            minimum = min(self._staging_rows // self.page_size, n_pages)
            self._index_prefix.reserve(pages.numel(), index_landing, minimum)
            self._index_new.reserve(pages.numel(), index_landing, minimum)
            self.forward_pages, self._forward_rows = pages, rows
            self._new_pages = new
            self._prefix_pages = pages[~torch.isin(pages, new)]

        def _check_pages(self, pages: torch.Tensor, n_pages: int, name: str) -> torch.Tensor:
            pages = torch.unique(pages.to(device=self.device, dtype=torch.int64))  # sorted
            if pages.numel() and (int(pages[0]) < 0 or int(pages[-1]) >= n_pages):
                raise ValueError(f"set_forward_pages: {name}: expected page ids in [0, {n_pages}), got "
                                 f"[{int(pages[0])}, {int(pages[-1])}]")
            return pages

        def _drain(self) -> None:
            for slots in (self._kv, self._index_prefix):
                for slot in list(slots.events):
                    self._slot_ready(slots, slot)

        # staged broadcasts (KV rows; prefix index pages) ---------------------------------------
        def _async_device(self) -> bool:
            """Staged broadcasts run on the broadcast stream only with a communicator of their own
            (upstream's ``layer_broadcast_comm``): the read-time index broadcast uses the CP group's,
            and one communicator driven from two streams could order its collectives differently on
            different ranks. CUDA, or the emulated device module of the CPU race test."""
            if self.layer_broadcast_comm is None:
                return False
            return str(self.device).startswith("cuda") or hasattr(self.device_module, "launch")

        def _run(self, fn, name: str = "op") -> None:
            """Run ``fn`` on the current stream: queued there by the emulated device module, else now
            (on CUDA the kernels it launches are queued on the current stream)."""
            launch = getattr(self.device_module, "launch", None)
            launch(fn, name) if launch else fn()

        def _slot_ready(self, slots: _Slots, slot: int) -> None:
            event = slots.events.pop(slot, None)
            if "slot_wait" in self._unsafe_skip:  # UNSAFE: stress tests only
                return
            if event is not None:  # hazard: read (or overwrite) the slot only after its broadcast completed
                self.device_module.current_stream().wait_event(event)

        def _stage(self, slots: _Slots, layer_id: int, index: torch.Tensor, source: torch.Tensor, wait_loaded) -> None:
            """Broadcast rows ``index`` of the owner's ``source`` (its buffer of ``layer_id``) into slot
            ``layer_id % 2`` of ``slots``; every rank calls this. CUDA: on the broadcast stream after
            the current stream's work, which waits for nothing; an event per slot guards the result.
            CPU (gloo): complete when it returns."""
            slot = layer_id % 2
            self._slot_ready(slots, slot)  # the slot's previous broadcast must be complete before reuse
            staging = slots.buffers[slot][: index.numel()]
            owned = self._is_layer_owned(layer_id)

            def send():
                if owned:  # the owner gathers the rows; the others receive into the slot
                    torch.index_select(source, 0, index, out=staging)
                self._broadcast_tensor_from_owner(staging, layer_id, src_tensor=staging if owned else None,
                                                  use_layer_broadcast_comm=True)

            if self._async_device():
                dm = self.device_module
                self.kv_broadcast_stream.wait_stream(dm.current_stream())
                with dm.stream(self.kv_broadcast_stream):
                    if "load_wait" not in self._unsafe_skip:  # (skipping it is UNSAFE: stress tests only)
                        wait_loaded()  # the broadcast stream waits for HiCache's load, the forward stream does not
                    self._run(send, "broadcast")
                    event = dm.Event()
                    event.record(self.kv_broadcast_stream)
                slots.events[slot] = event
            else:
                if "load_wait" not in self._unsafe_skip:
                    wait_loaded()
                send()
            self.broadcast_bytes[slots.kind] += staging.nbytes
            slots.layer[slot] = layer_id

        def _land_slot(self, slots: _Slots, layer_id: int, index: torch.Tensor, landing: torch.Tensor, fetch) -> None:
            """Scatter ``layer_id``'s staged rows into ``landing`` (non-owners), fetching them first if
            no prefetch staged them."""
            slot = layer_id % 2
            if slots.layer[slot] != layer_id:
                fetch()
            self._slot_ready(slots, slot)
            if not self._is_layer_owned(layer_id):
                staged = slots.buffers[slot][: index.numel()]
                self._run(lambda: landing.index_copy_(0, index, staged), "scatter")
            slots.layer[slot] = None
            slots.landed = layer_id

        # KV rows ------------------------------------------------------------------------------
        def _fetch(self, layer_id: int, counter=None, counter_idx: int | None = None) -> None:
            counter = counter or self.layer_transfer_counter

            def wait_loaded():  # hazard: the owner's rows of this layer may still be loading from host
                if counter is not None:
                    counter.wait_until(layer_id - self.start_layer if counter_idx is None else counter_idx)

            source = self.kv_buffer[layer_id - self.start_layer]
            self._stage(self._kv, layer_id, self._forward_rows, source, wait_loaded)

        def _land(self, layer_id: int) -> None:
            self._land_slot(self._kv, layer_id, self._forward_rows, self.remote_kv_buffer, lambda: self._fetch(layer_id))

        # prefix indexer keys ------------------------------------------------------------------
        def _has_index(self, layer_id: int) -> bool:
            skip = getattr(self, "skip_topk_layers", None)  # layers reusing the previous top-k: no keys
            return not (skip and skip[layer_id - self.start_layer])

        def _fetch_index_prefix(self, layer_id: int) -> None:
            local = layer_id - self.start_layer
            # hazard: the owner's prefix pages may still be loading from host (indexer-ready only)
            self._stage(self._index_prefix, layer_id, self._prefix_pages, self.index_key_cache.buffer[local],
                        lambda: _wait_index(self.layer_transfer_counter, local))

        def _land_index_prefix(self, layer_id: int) -> None:
            if self._index_prefix.landed == layer_id or not self._prefix_pages.numel():
                return
            self._land_slot(self._index_prefix, layer_id, self._prefix_pages, self.index_key_cache.remote_buffer,
                            lambda: self._fetch_index_prefix(layer_id))

        # what SGLang calls --------------------------------------------------------------------
        def prefetch_kv_buffer(self, layer_id: int, layer_transfer_counter=None, layer_transfer_idx=None) -> None:
            if self.forward_pages is None:
                return super().prefetch_kv_buffer(layer_id, layer_transfer_counter, layer_transfer_idx)
            # the indexer reads first: its prefix pages go first on the broadcast stream
            if (self._prefix_pages.numel() and self._has_index(layer_id)
                    and self._index_prefix.landed != layer_id and self._index_prefix.layer[layer_id % 2] != layer_id):
                self._fetch_index_prefix(layer_id)
            if self._kv.landed != layer_id and self._kv.layer[layer_id % 2] != layer_id:
                self._fetch(layer_id, layer_transfer_counter, layer_transfer_idx)

        def _get_broadcastable_kv_buffer(self, layer_id: int):
            if self.forward_pages is None:
                return super()._get_broadcastable_kv_buffer(layer_id)
            if self._kv.landed != layer_id:
                self._land(layer_id)
            if self._is_layer_owned(layer_id):
                return self.kv_buffer[layer_id - self.start_layer]
            return self.remote_kv_buffer

        def _write_rows(self, layer_id: int, write) -> None:
            """Apply ``write(buffer)`` to the owner's buffer and, where it holds this layer, the landing
            buffer; a layer staged but not yet landed is landed first so its new rows are not lost."""
            if self._kv.layer[layer_id % 2] == layer_id:
                self._land(layer_id)  # also waits for an in-flight send of the owner's buffer
            if self._is_layer_owned(layer_id):
                buf = self.kv_buffer[layer_id - self.start_layer]
            elif self._kv.landed == layer_id:
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
            # moved rows: staged and landed copies are stale
            self.set_forward_pages(self.forward_pages, self._new_pages)

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
