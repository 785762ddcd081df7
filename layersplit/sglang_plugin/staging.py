"""The plug-in pool's staged broadcasts: which layer each of the two batch-sized slots holds, and the
events that guard them.

A non-owned layer's batch rows (KV rows; indexer-key pages) are broadcast by their owner into slot
``layer % 2``, so the model's one-layer-ahead ``prefetch_kv_buffer(l + 1)`` runs on the broadcast
stream while layer l reads the other slot. Every rank runs the same state machine, independent of
ownership: a broadcast is a collective every rank must enter in the same order.

:class:`StagedBroadcastMixin` holds the methods; :class:`layersplit.sglang_plugin.pool.LayerSplitPoolMixin`
builds on it and owns the state (``_kv``, ``_index``: :class:`Slots`; the batch's pages).
"""

from __future__ import annotations

import torch


def wait_index(counter, idx: int) -> None:
    """Wait for the indexer keys of local layer ``idx``: the indexer-ready event where the counter has
    one (our HiCache adapter), else the whole layer (upstream's counter)."""
    if counter is not None:
        getattr(counter, "wait_index_until", counter.wait_until)(idx)


class Slots:
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


class StagedBroadcastMixin:
    """Staged broadcasts of the batch's rows into the slots, for a pool that also derives from SGLang's
    ``LayerSplitDSATokenToKVPool`` (``_broadcast_tensor_from_owner``, ``kv_buffer``, ...)."""

    # the device side ----------------------------------------------------------------------------
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

    def _slot_ready(self, slots: Slots, slot: int) -> None:
        event = slots.events.pop(slot, None)
        if "slot_wait" in self._unsafe_skip:  # UNSAFE: stress tests only
            return
        if event is not None:  # hazard: read (or overwrite) the slot only after its broadcast completed
            self.metrics.timed_wait("broadcast", lambda: self.device_module.current_stream().wait_event(event))

    # one staged broadcast ---------------------------------------------------------------------------
    def _stage(self, slots: Slots, layer_id: int, index: torch.Tensor, source: torch.Tensor, wait_loaded) -> None:
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
            slots.events[slot] = self._send_on_broadcast_stream(send, wait_loaded)
        else:
            if "load_wait" not in self._unsafe_skip:
                wait_loaded()
            send()
        self._count_sent("kv" if slots is self._kv else "index_prefix", staging.nbytes)
        slots.layer[slot] = layer_id

    def _send_on_broadcast_stream(self, send, wait_loaded):
        """Run ``send`` on the broadcast stream after the current stream's work; the event it returns
        guards the result."""
        dm = self.device_module
        self.kv_broadcast_stream.wait_stream(dm.current_stream())
        with dm.stream(self.kv_broadcast_stream):
            if "load_wait" not in self._unsafe_skip:  # (skipping it is UNSAFE: stress tests only)
                wait_loaded()  # the broadcast stream waits for HiCache's load, the forward stream does not
            self._run(send, "broadcast")
            event = dm.Event()
            event.record(self.kv_broadcast_stream)
        return event

    def _count_sent(self, part: str, nbytes: int) -> None:
        self.broadcast_bytes[part] += nbytes
        self.metrics.add("broadcast_bytes", part, nbytes)

    # the slot state machine --------------------------------------------------------------------------
    def _has(self, slots: Slots, layer_id: int) -> bool:
        """``layer_id`` is staged in its slot or (pool landing) already scattered into the landing."""
        return slots.layer[layer_id % 2] == layer_id or (self.landing_now == "pool" and slots.landed == layer_id)

    def _holds(self, slots: Slots, layer_id: int) -> bool:
        """``layer_id`` is readable where non-owners read it (the landing buffer, or its slot)."""
        if self.landing_now == "pool":
            return slots.landed == layer_id
        return slots.layer[layer_id % 2] == layer_id and layer_id % 2 not in slots.events

    def _land_slot(self, slots: Slots, layer_id: int, index: torch.Tensor, landing, fetch) -> None:
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

    # KV rows ------------------------------------------------------------------------------------------
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

    # indexer keys ----------------------------------------------------------------------------------------
    def _has_index(self, layer_id: int) -> bool:
        skip = getattr(self, "skip_topk_layers", None)  # layers reusing the previous top-k: no keys
        return not (skip and skip[layer_id - self.start_layer])

    def _fetch_index_prefix(self, layer_id: int) -> None:
        local = layer_id - self.start_layer
        # hazard: the owner's prefix pages may still be loading from host (indexer-ready only)
        self._stage(self._index, layer_id, self._prefix_pages, self.index_key_cache.buffer[local],
                    lambda: wait_index(self.layer_transfer_counter, local))

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
        self._count_sent("index_new", staging.nbytes)
