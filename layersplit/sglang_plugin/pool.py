"""LayerSplit pool for SGLang: a subclass of SGLang's ``LayerSplitDSATokenToKVPool``.

Upstream broadcasts a non-owned layer's **whole** pool-sized buffer (``size + page_size`` rows of
KV, every page of index keys) each time a rank reads it, into one pool-sized scratch layer, so a
prefetch of layer l + 1 must first wait for layer l, and every rank gives up one layer of KV
capacity for the scratch. This subclass:

* broadcasts only the **batch's pages** (prefix pages, then the pages holding new tokens, as the
  hook on the DSA backend's ``init_forward_metadata`` hands them to :meth:`set_batch_pages`), both
  for the latent KV and for the indexer keys;
* moves the indexer keys of the **prefix** pages off the critical path: they do not change during
  the forward, so they are broadcast one layer ahead on the broadcast stream (with the KV prefetch);
  only the pages holding new tokens are broadcast when the indexer reads the layer, after it stored
  their keys;
* stages the broadcasts in **two batch-sized slots** (layer l uses slot l % 2), so the model's
  one-layer-ahead ``prefetch_kv_buffer(l + 1)`` runs on the broadcast stream while layer l reads;
* **landing** (``LAYERSPLIT_SGLANG_LANDING``): ``batch`` (default) — the slots *are* where a
  non-owned layer is read: slot row ``i * 64 + t`` holds token ``t`` of the batch's i-th page, and
  the DSA backend reads non-owned layers through page tables remapped to those rows
  (:mod:`layersplit.sglang_plugin.landing`), so no pool-sized scratch exists; ``pool`` — upstream's
  pool-sized landing buffers are kept and each staged layer is scattered into them (for attention
  configurations the remap does not cover, decided at start-up by :mod:`.startup`, which counts
  them in SGLang's KV budget). Nothing is allocated after start-up: the slots are sized once (a
  whole context each; admission keeps a batch's de-duplicated pages within one, :mod:`.sharing`);
* stores the latent rows in SGLang's own fp8 DSA layout when the pool is fp8
  (``dsa_kv_cache_store_fp8``: 512 e4m3 + 4 fp32 scales + 64 bf16 rope = 656 B a token) — upstream's
  layer split asserts that away; the bytes move as uint8, so the broadcasts need no fp8 support;
* lets the owner read its own buffer in place (upstream copies it into the scratch first);
* always waits for HiCache's per-layer load before broadcasting: the KV broadcast waits the layer's
  KV-ready event, the indexer-key broadcast only its indexer-ready event
  (:class:`layersplit.sglang_plugin.hicache.SplitLayerDoneCounter`).

The per-forward path reads no device value on the host (no ``.item()``, ``unique``, boolean masks):
sizes come from the host lists the hook builds. Ownership stays upstream's contiguous split: SGLang's
PD transfer labels a rank's layers as one range ``[layer_shard_start, ...)`` and its HiCache host
pools assume the same.

Every rank runs the same state machine (which layer each slot holds), independent of ownership,
because a broadcast is a collective every rank must enter in the same order. Without batch pages (a
batch the hook did not see: a CUDA-graph replay, a batch without host lengths) it runs upstream's
whole-buffer path into upstream's landing layer, which exists only where the start-up plan chose
``pool`` landing for such a worker (a ``batch`` pool refuses that path rather than allocate it); on
objects that are not this pool (the stand-ins of SGLang's own unit tests) upstream's methods run,
with one intended difference: without a broadcast communicator upstream's prefetch broadcasts at
once without waiting for HiCache's layer counter (a read before the layer is loaded); ours waits.
"""

from __future__ import annotations

import logging

import torch

from lsconfig import envs
from layersplit.sglang_plugin import compat, metrics, sizing, startup

log = logging.getLogger(__name__)


def _wait_index(counter, idx: int) -> None:
    """Wait for the indexer keys of local layer ``idx``: the indexer-ready event where the counter has
    one (our HiCache adapter), else the whole layer (upstream's counter)."""
    if counter is not None:
        getattr(counter, "wait_index_until", counter.wait_until)(idx)


class _Slots:
    """Staging slots for one kind of rows (KV rows, or indexer-key pages), the layer each holds (layer
    l uses slot l % 2), the events guarding broadcasts in flight into them, and (``pool`` landing) the
    layer last scattered into the landing buffer. Allocated once, at start-up; never grown."""

    def __init__(self, kind: str, count: int = 2) -> None:
        self.kind = kind
        self.buffers: list[torch.Tensor | None] = [None] * count
        self.layer: list[int | None] = [None, None]
        self.events: dict[int, object] = {}
        self.landed: int | None = None

    def allocate(self, rows: int, row_shape: tuple, dtype, device) -> None:
        self.buffers = [torch.empty((rows, *row_shape), dtype=dtype, device=device) for _ in self.buffers]

    def check_fits(self, rows: int) -> None:
        capacity = self.buffers[0].shape[0]
        if rows > capacity:  # admission (sharing.around_add_one_req) keeps every batch within a slot
            raise RuntimeError(f"layersplit: a batch of {rows} {self.kind} rows exceeds the staging slot of "
                               f"{capacity} rows sized at start-up; batches reach the pool through SGLang's "
                               "PrefillAdder, which the plug-in's admission hook limits to a slot")

    def forget(self) -> None:
        self.layer, self.landed = [None, None], None

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers if b is not None)


def _ours(obj) -> bool:
    """Whether ``obj`` carries the plug-in pool's state (SGLang's unit tests call the pool's methods
    on stand-in objects that hold only upstream's attributes: those get upstream's methods)."""
    return getattr(obj, "_kv", None) is not None


def make_index_cache_class(base: type | None = None) -> type:
    """The indexer-key cache of our pool: prefix pages staged one layer ahead, new pages broadcast
    at read time, indexer-ready waits; with ``batch`` landing no pool-sized remote buffer."""
    base = base or compat.resolve("layer_split_index_cache")

    class LayerSplitPlusIndexKeyCache(base):
        def __init__(self, pool, index_buf_size: int):
            if pool.landing == "pool":
                super().__init__(pool, index_buf_size)
                return
            # upstream's owned-only per-layer buffers (IndexKeyCache), without the pool-sized
            # remote buffer LayerSplitIndexKeyCache adds; allocated only if a forward falls back
            super(base, self).__init__(pool, index_buf_size)
            self.remote_buffer = None
            self.remote_layer_id = None

        def move(self, tgt_loc: torch.Tensor, src_loc: torch.Tensor) -> None:
            """Token locations -> the tokens' bytes inside their pages (keys, then scales), owned
            layers only: SGLang's ``IndexKeyCache.move``. Upstream's layer-split override indexes page
            rows by token location (an ``IndexError`` past the page count, wrong rows below it)."""
            compat.resolve("index_key_cache").move(self, tgt_loc, src_loc)

        def get_buffer(self, layer_id: int) -> torch.Tensor:
            _wait_index(self.pool.layer_transfer_counter, layer_id - self.pool.start_layer)
            return self.get_broadcastable_buffer(layer_id)

        def get_broadcastable_buffer(self, layer_id: int) -> torch.Tensor:
            pool = self.pool
            if not _ours(pool) or pool.forward_pages is None:
                if _ours(pool):
                    pool.require_pool_landing()
                return base.get_broadcastable_buffer(self, layer_id)  # whole buffer, upstream
            local = layer_id - pool.start_layer
            owned = pool._is_layer_owned(layer_id)
            if self.remote_layer_id != layer_id:
                pool._land_index_prefix(layer_id)
                if pool._new_pages.numel():
                    pool._send_new_index_pages(layer_id, self.buffer[local])
                self.remote_layer_id = layer_id
            if owned:
                return self.buffer[local]  # upstream's raw layout, read in place
            return self.remote_buffer if pool.landing_now == "pool" else pool._index.buffers[layer_id % 2]

    return LayerSplitPlusIndexKeyCache


def make_pool_class(base: type | None = None, index_cache_base: type | None = None) -> type:
    """Build the subclass of ``base`` (default: the installed ``LayerSplitDSATokenToKVPool``)."""
    base = base or compat.resolve("layer_split_pool")
    index_cache_cls = make_index_cache_class(index_cache_base)

    class LayerSplitPlusDSATokenToKVPool(base):
        def __init__(self, *args, layer_shard_rank: int, layer_shard_size: int, **kwargs):
            self.landing = envs.sglang_landing()  # configured: "batch" or "pool"
            self.landing_now = self.landing  # this forward's ("pool" where the remap does not apply)
            self.forward_pages: torch.Tensor | None = None  # prefix pages, then new pages (device)
            self._forward_rows: torch.Tensor | None = None  # their token rows
            self._prefix_pages: torch.Tensor | None = None  # batch pages without new tokens
            self._new_pages: torch.Tensor | None = None  # batch pages with new tokens
            self._slot_of_page: torch.Tensor | None = None  # batch landing: pool page -> slot page
            self.remapped_metadata = None  # (backend metadata, its remapped copy) of this forward
            self._kv = _Slots("kv")
            self._index = _Slots("index")  # [prefix pages | new pages] of a layer
            # bytes this rank entered into broadcasts: KV rows, prefix index pages (off the critical
            # path when prefetched), new-token index pages (on it)
            self.broadcast_bytes = {"kv": 0, "index_prefix": 0, "index_new": 0}
            self.metrics = metrics.shared()
            self.startup_plan = startup.current()  # made by the budget hook; None outside a server
            if self.startup_plan is not None:
                self.landing = self.landing_now = self.startup_plan.landing
            self._unsafe_skip = envs.sglang_unsafe_skip()
            super().__init__(*args, layer_shard_rank=layer_shard_rank, layer_shard_size=layer_shard_size, **kwargs)
            self._allocate_index_slots()
            self._check_counted()
            self.publish_capacity()
            log.info("layersplit: %s landing; staging 2 x %d KV rows + 2 x %d index pages = %.3f GB",
                     self.landing, self._kv.buffers[0].shape[0], self._slot_pages(), self.staging_bytes() / 1e9)

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

        # buffers -------------------------------------------------------------------------------
        def _slot_pages(self) -> int:
            """The start-up plan's slot pages; without one (a pool built outside a server),
            ``LAYERSPLIT_SGLANG_SCRATCH_TOKENS`` rows, at most the pool's."""
            if self.startup_plan is not None:
                return self.startup_plan.slot_pages
            return sizing.slot_pages(envs.sglang_scratch_tokens(), self.size, self.page_size)

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

        def _index_row_shape(self) -> tuple:
            return tuple(self.index_key_cache._buffer_shape(1)[1:])

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

        def _allocate_index_slots(self) -> None:
            """The indexer-key slots (after upstream's constructor set the index geometry)."""
            with self._kv_region():
                self._index.allocate(self._slot_pages(), self._index_row_shape(), self.index_k_with_scale_buffer_dtype,
                                     self.device)

        def _kv_region(self):
            """SGLang's KV memory-saver region and ``custom_mem_pool``, where upstream allocates its pool."""
            import contextlib

            from sglang.srt.mem_cache.memory_pool import GPU_MEMORY_TYPE_KV_CACHE

            stack = contextlib.ExitStack()
            stack.enter_context(self.memory_saver_adapter.region(GPU_MEMORY_TYPE_KV_CACHE))
            if self.custom_mem_pool:
                stack.enter_context(torch.cuda.use_mem_pool(self.custom_mem_pool))
            return stack

        def _create_owned_buffers(self) -> None:
            """Upstream's owned-only layer buffers, broadcast stream and communicator, without the
            pool-sized ``remote_kv_buffer`` (allocated only if a forward falls back to it)."""
            from contextlib import nullcontext

            from sglang.srt.mem_cache.memory_pool import GPU_MEMORY_TYPE_KV_CACHE

            self._log_layer_shard_plan()
            mem_pool = torch.cuda.use_mem_pool(self.custom_mem_pool) if self.custom_mem_pool else nullcontext()
            with self.memory_saver_adapter.region(GPU_MEMORY_TYPE_KV_CACHE), mem_pool:
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

        def require_pool_landing(self, reason: str = "upstream's whole-buffer path") -> None:
            """Upstream's landing layer exists only where the start-up plan chose ``pool`` landing
            (and counted it); a forward that needs it in a ``batch`` pool is a start-up plan error."""
            if self.remote_kv_buffer is None:
                raise RuntimeError(f"layersplit: {reason} needs upstream's pool-sized landing layer, which the "
                                   "start-up plan did not allocate (batch landing); the start-up checks "
                                   "(layersplit/sglang_plugin/startup.py) should have chosen pool landing")

        @property
        def kv_staging(self) -> list[torch.Tensor]:
            return self._kv.buffers

        def _create_index_key_cache(self):
            return index_cache_cls(self, self.index_buf_size)

        def _clear_buffers(self):
            for slots in (self._kv, self._index):
                slots.buffers = [None] * len(slots.buffers)
            super()._clear_buffers()

        def staging_bytes(self) -> int:
            """Bytes of our staging slots (KV and index keys) and the page remap table."""
            remap = 0 if self._slot_of_page is None else self._slot_of_page.nbytes
            return self._kv.nbytes() + self._index.nbytes() + remap

        def kv_scratch_bytes(self) -> int:
            """Bytes of remote-layer scratch: our staging slots and upstream's landing buffers where
            allocated (``pool`` landing, or a fallback)."""
            landing = [self.remote_kv_buffer, self.index_key_cache.remote_buffer]
            return self.staging_bytes() + sum(b.numel() * b.element_size() for b in landing if b is not None)

        # the forward batch's pages -------------------------------------------------------------
        def set_batch_pages(self, prefix_pages: torch.Tensor, new_pages: torch.Tensor,
                            landing: str | None = None, reason: str | None = None) -> None:
            """The next forward reads ``prefix_pages`` (only cached tokens) and ``new_pages`` (pages its
            new tokens are written to): device int64 page ids, as the hook builds them from SGLang's
            own tables (trusted: not validated here, which would read them on the host). Every CP rank
            passes the same pages. ``landing``: ``"pool"`` for a forward the remap does not cover."""
            self._reset_forward()
            self.landing_now = landing or self.landing
            if self.landing_now == "pool":
                self.require_pool_landing(reason or "a forward with pool landing")
            pages = torch.cat([prefix_pages, new_pages])
            rows = (pages[:, None] * self.page_size + torch.arange(self.page_size, device=pages.device)).flatten()
            self._index.check_fits(pages.numel())
            self._kv.check_fits(rows.numel())
            if self.landing_now == "batch":  # page -> its position in the slots (a repeated page: either)
                assert self._slot_of_page is not None, "batch landing in a pool configured for pool landing"
                self._slot_of_page.index_copy_(0, pages, torch.arange(pages.numel(), device=pages.device))
            self.forward_pages, self._forward_rows = pages, rows
            self._prefix_pages, self._new_pages = prefix_pages, new_pages

        def set_forward_pages(self, pages: torch.Tensor | None, new_pages: torch.Tensor | None = None) -> None:
            """Public, validated form: ``pages`` the next forward reads, among them ``new_pages``
            (``None``: every page counts as new, so no indexer keys are prefetched). ``pages=None``:
            unknown, upstream's whole-buffer path. The checks read the ids on the host: pass host
            tensors, or use :meth:`set_batch_pages` in a forward."""
            if pages is None:
                self._reset_forward()
                self.forward_pages = self._forward_rows = self._prefix_pages = self._new_pages = None
                return
            n_pages = (self.size + self.page_size) // self.page_size
            pages = self._check_pages(pages, n_pages, "pages")
            new = pages if new_pages is None else self._check_pages(new_pages, n_pages, "new_pages")
            outside = sorted(set(new.tolist()) - set(pages.tolist()))
            if outside:
                raise ValueError(f"set_forward_pages: expected new_pages to be a subset of pages, got {outside} "
                                 "outside it")
            self.set_batch_pages(pages[~torch.isin(pages, new)], new)

        def _check_pages(self, pages: torch.Tensor, n_pages: int, name: str) -> torch.Tensor:
            pages = torch.unique(pages.to(device=self.device, dtype=torch.int64))  # sorted
            if pages.numel() and (int(pages[0]) < 0 or int(pages[-1]) >= n_pages):
                raise ValueError(f"set_forward_pages: {name}: expected page ids in [0, {n_pages}), got "
                                 f"[{int(pages[0])}, {int(pages[-1])}]")
            return pages

        def _reset_forward(self) -> None:
            """Broadcasts in flight complete before the slots change meaning; upstream's own scratch
            state is stale too (the landing buffer may have been written by row-only forwards)."""
            for slots in (self._kv, self._index):
                for slot in list(slots.events):
                    self._slot_ready(slots, slot)
                slots.forget()
            if getattr(self, "pending_remote_kv_broadcast", False):
                self._finalize_pending_kv_broadcast(set_remote_layer_id=False)
            self.remote_kv_layer_id = None
            self.index_key_cache.remote_layer_id = None
            self.remapped_metadata = None

        # the batch-sized landing: pool locations -> slot rows ------------------------------------
        def remap_locs(self, loc: torch.Tensor) -> torch.Tensor:
            """Token locations (page size 1) -> rows of the batch slots; negative (padding) kept."""
            page = self._slot_of_page[loc.clamp(min=0).long() // self.page_size]
            return torch.where(loc >= 0, page * self.page_size + loc % self.page_size, loc).to(loc.dtype)

        def remap_pages(self, pages: torch.Tensor) -> torch.Tensor:
            """Page ids -> pages of the batch slots; negative (padding) kept."""
            return torch.where(pages >= 0, self._slot_of_page[pages.clamp(min=0).long()], pages).to(pages.dtype)

        def reads_remapped(self, layer_id: int) -> bool:
            """Whether this forward reads ``layer_id`` through remapped page tables (a non-owned layer
            in a forward with batch landing)."""
            return (self.forward_pages is not None and self.landing_now == "batch"
                    and not self._is_layer_owned(layer_id))

        # staged broadcasts (KV rows; index pages) ----------------------------------------------
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
                self.metrics.timed_wait("broadcast", lambda: self.device_module.current_stream().wait_event(event))

        def _stage(self, slots: _Slots, layer_id: int, index: torch.Tensor, source: torch.Tensor, wait_loaded) -> None:
            """Broadcast rows ``index`` of the owner's ``source`` (its buffer of ``layer_id``) into the
            head of slot ``layer_id % 2`` of ``slots``; every rank calls this. CUDA: on the broadcast
            stream after the current stream's work, which waits for nothing; an event per slot guards
            the result. CPU (gloo): complete when it returns."""
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
            part = "kv" if slots is self._kv else "index_prefix"
            self.broadcast_bytes[part] += staging.nbytes
            self.metrics.add("broadcast_bytes", part, staging.nbytes)
            slots.layer[slot] = layer_id

        def _has(self, slots: _Slots, layer_id: int) -> bool:
            """``layer_id`` is staged in its slot or (pool landing) already scattered into the landing."""
            return slots.layer[layer_id % 2] == layer_id or (self.landing_now == "pool" and slots.landed == layer_id)

        def _holds(self, slots: _Slots, layer_id: int) -> bool:
            """``layer_id`` is readable where non-owners read it (the landing buffer, or its slot)."""
            if self.landing_now == "pool":
                return slots.landed == layer_id
            return slots.layer[layer_id % 2] == layer_id and layer_id % 2 not in slots.events

        def _land_slot(self, slots: _Slots, layer_id: int, index: torch.Tensor, landing, fetch) -> None:
            """Make ``layer_id``'s staged rows readable: fetch them if no prefetch staged them, wait for
            the broadcast; ``pool`` landing: scatter them into ``landing`` (non-owners) and free the slot."""
            slot = layer_id % 2
            if slots.layer[slot] != layer_id:
                fetch()
            self._slot_ready(slots, slot)
            if self.landing_now == "pool":
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
            self._land_slot(self._kv, layer_id, self._forward_rows, self.remote_kv_buffer,
                            lambda: self._fetch(layer_id))

        # indexer keys ---------------------------------------------------------------------------
        def _has_index(self, layer_id: int) -> bool:
            skip = getattr(self, "skip_topk_layers", None)  # layers reusing the previous top-k: no keys
            return not (skip and skip[layer_id - self.start_layer])

        def _fetch_index_prefix(self, layer_id: int) -> None:
            local = layer_id - self.start_layer
            # hazard: the owner's prefix pages may still be loading from host (indexer-ready only)
            self._stage(self._index, layer_id, self._prefix_pages, self.index_key_cache.buffer[local],
                        lambda: _wait_index(self.layer_transfer_counter, local))

        def _land_index_prefix(self, layer_id: int) -> None:
            if not self._prefix_pages.numel():
                self._slot_ready(self._index, layer_id % 2)  # the new pages reuse the slot
                self._index.layer[layer_id % 2] = layer_id
                return
            if self.landing_now == "pool" and self._index.landed == layer_id:
                return
            self._land_slot(self._index, layer_id, self._prefix_pages, self.index_key_cache.remote_buffer,
                            lambda: self._fetch_index_prefix(layer_id))

        def _send_new_index_pages(self, layer_id: int, source: torch.Tensor) -> None:
            """Broadcast the pages holding new tokens (their keys were stored just now, by the owner)
            into slot ``layer_id % 2`` after the prefix pages, synchronously on the CP group (they are
            on the critical path); ``pool`` landing: scatter them into the landing buffer."""
            new, n_prefix = self._new_pages, self._prefix_pages.numel()
            staging = self._index.buffers[layer_id % 2][n_prefix: n_prefix + new.numel()]
            owned = self._is_layer_owned(layer_id)
            landing = self.index_key_cache.remote_buffer if self.landing_now == "pool" else None

            def send_new():
                if owned:
                    torch.index_select(source, 0, new, out=staging)
                self._broadcast_tensor_from_owner(staging, layer_id, src_tensor=staging if owned else None)
                if not owned and landing is not None:
                    landing.index_copy_(0, new, staging)

            self._run(send_new, "index_broadcast")
            self.broadcast_bytes["index_new"] += staging.nbytes
            self.metrics.add("broadcast_bytes", "index_new", staging.nbytes)

        # what SGLang calls --------------------------------------------------------------------
        def prefetch_kv_buffer(self, layer_id: int, layer_transfer_counter=None, layer_transfer_idx=None) -> None:
            if not _ours(self):  # a stand-in of SGLang's unit tests: upstream's method
                return base.prefetch_kv_buffer(self, layer_id, layer_transfer_counter, layer_transfer_idx)
            if self.forward_pages is None:
                self.require_pool_landing()
                if self.layer_broadcast_comm is None and layer_transfer_counter is not None \
                        and layer_transfer_idx is not None and "load_wait" not in self._unsafe_skip:
                    # hazard: upstream's synchronous prefetch broadcasts the owner's layer before HiCache
                    # finished loading it (read-before-ready); wait for the layer first
                    layer_transfer_counter.wait_until(layer_transfer_idx)
                return base.prefetch_kv_buffer(self, layer_id, layer_transfer_counter, layer_transfer_idx)
            # the indexer reads first: its prefix pages go first on the broadcast stream
            if self._prefix_pages.numel() and self._has_index(layer_id) and not self._has(self._index, layer_id) \
                    and self.index_key_cache.remote_layer_id != layer_id:
                self._fetch_index_prefix(layer_id)
            if not self._has(self._kv, layer_id):
                self._fetch(layer_id, layer_transfer_counter, layer_transfer_idx)

        def _get_broadcastable_kv_buffer(self, layer_id: int):
            if not _ours(self) or self.forward_pages is None:
                if _ours(self):
                    self.require_pool_landing()
                return base._get_broadcastable_kv_buffer(self, layer_id)
            if not self._holds(self._kv, layer_id):
                self._land(layer_id)
            if self._is_layer_owned(layer_id):
                return self.kv_buffer[layer_id - self.start_layer]
            return self.remote_kv_buffer if self.landing_now == "pool" else self._kv.buffers[layer_id % 2]

        def _write_rows(self, layer_id: int, loc: torch.Tensor, write) -> None:
            """Apply ``write(buffer, loc)`` to the owner's buffer and, where this rank holds the layer
            for reading, the landing buffer (pool locations) or its slot (remapped locations); a layer
            staged but not yet landed is landed first so its new rows are not overwritten."""
            slot = layer_id % 2
            if self._kv.layer[slot] == layer_id:
                self._land(layer_id)  # also waits for an in-flight send of the owner's buffer
            if self._is_layer_owned(layer_id):
                buf, at = self.kv_buffer[layer_id - self.start_layer], loc
            elif self.landing_now == "pool" and self._kv.landed == layer_id:
                buf, at = self.remote_kv_buffer, loc
            elif self.landing_now == "batch" and self._kv.layer[slot] == layer_id:
                buf, at = self._kv.buffers[slot], self.remap_locs(loc)
            else:
                return  # not read here yet: the owner's rows, with these, arrive with the broadcast
            self._run(lambda: write(buf, at), "write")

        def set_mla_kv_buffer(self, layer, loc_info, cache_k_nope, cache_k_rope):
            from sglang.srt.mem_cache.memory_pool import unwrap_write_loc

            if self.forward_pages is None and self.remote_kv_buffer is not None:
                return super().set_mla_kv_buffer(layer, loc_info, cache_k_nope, cache_k_rope)
            loc, _, _ = unwrap_write_loc(loc_info)
            if self.forward_pages is None:  # no landing buffer to keep current: the owner's rows only
                if self._is_layer_owned(layer.layer_id):
                    self._write_mla_kv_buffer(self.kv_buffer[layer.layer_id - self.start_layer], loc,
                                              cache_k_nope, cache_k_rope)
                return None
            self._write_rows(layer.layer_id, loc,
                             lambda buf, at: self._write_mla_kv_buffer(buf, at, cache_k_nope, cache_k_rope))

        def set_kv_buffer(self, layer, loc_info, cache_k, cache_v):
            """The combined-row write. Upstream asserts a bf16 pool here; with fp8 KV the row is split
            into its latent and rope parts and stored through SGLang's fp8 DSA quantizer, like
            ``set_mla_kv_buffer``."""
            if self.dsa_kv_cache_store_fp8:
                nope, rope = cache_k[..., : self.kv_lora_rank], cache_k[..., self.kv_lora_rank:]
                return self.set_mla_kv_buffer(layer, loc_info, nope, rope)
            if self.forward_pages is None and self.remote_kv_buffer is not None:
                return super().set_kv_buffer(layer, loc_info, cache_k, cache_v)
            from sglang.srt.mem_cache.memory_pool import unwrap_write_loc

            loc, _, _ = unwrap_write_loc(loc_info)
            if cache_k.dtype != self.dtype:
                cache_k = cache_k.to(self.dtype)
            rows = cache_k.view(self.store_dtype) if self.store_dtype != self.dtype else cache_k

            def write(buf, at):
                buf[at] = rows

            if self.forward_pages is None:  # no landing buffer to keep current: the owner's rows only
                if self._is_layer_owned(layer.layer_id):
                    write(self.kv_buffer[layer.layer_id - self.start_layer], loc)
                return None
            self._write_rows(layer.layer_id, loc, write)

        def move_kv_cache(self, tgt_loc, src_loc):
            super().move_kv_cache(tgt_loc, src_loc)
            if self.forward_pages is not None:  # moved rows: staged and landed copies are stale
                self.set_batch_pages(self._prefix_pages, self._new_pages, self.landing_now)

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
