"""Layer-wise host -> device load with per-layer *indexer-ready* and *KV-ready* events.

On the Load Stream, for each layer ``l`` in order: copy ``l``'s indexer keys, record
``indexer_ready[l]``; copy ``l``'s KV, record ``kv_ready[l]``. The forward stream calls
``wait_indexer(l)`` before the indexer kernel and ``wait_kv(l)`` before sparse attention: stream
waits, never host syncs inside the layer loop. Loading indexer keys first lets layer ``l``'s
indexer start while its KV still streams in.

Hazards handled here:

* read-before-ready (SGLang #22811): the indexer must not read layer ``l``'s keys before they
  land -> ``wait_indexer``; attention likewise -> ``wait_kv``;
* write-after-read on re-allocated device pages (SGLang #36738): pages freed by earlier forward
  work carry a fence event; the Load Stream waits on it before overwriting them;
* host pages must not be reused while a copy still reads them: the load holds a reference on them
  until its last event completed (:meth:`LayerwiseLoader.reclaim`);
* the copies themselves are DMA on the Load Stream (:mod:`hicache.transfer`): no host-side half reads
  host pages before the fences above (an offload still writing them) are met;
* init race: the device pool was created (zero-filled) by a kernel on the compute stream, and a
  non-blocking Load Stream is not ordered after it: the constructor records an event on the
  runtime's compute stream and the Load Stream waits on it before its first op.

``unsafe_skip`` drops named safeguards ({'indexer', 'kv', 'fence', 'init'}) to reproduce the upstream
bugs in stress and sanitizer tests. Never set it in production.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hicache.device_pool import DSADevicePool
from hicache.host_pool import DSAHostPool
from hicache.runtime.streams import Event, Runtime, Stream
from hicache.transfer import PageIds, copy_layer_part, host_ids

UNSAFE_CHOICES = ("indexer", "kv", "fence", "init")


@dataclass
class LayerLoad:
    """Handle of one batch's load: the events guarding each layer's data on the device."""

    layers: tuple[int, ...]
    host_pages: list[int]
    device_pages: list[int]
    indexer_ready: dict[int, Event]
    kv_ready: dict[int, Event]
    unsafe_skip: frozenset[str] = frozenset()
    bytes_copied: int = 0  # host -> device bytes moved so far (written by the load stream)
    bytes_by_layer: dict[int, int] = field(default_factory=dict)  # the same, per layer (index keys + KV)

    def wait_indexer(self, layer: int, stream: Stream) -> None:
        """Make ``stream`` wait until ``layer``'s indexer keys are on the device."""
        if "indexer" in self.unsafe_skip:
            return  # UNSAFE: reproduces the read-before-ready bug
        if layer not in self.indexer_ready:
            raise ValueError(f"layer: expected an indexer layer of this load {sorted(self.indexer_ready)}, got {layer}")
        stream.wait_event(self.indexer_ready[layer])

    def wait_kv(self, layer: int, stream: Stream) -> None:
        """Make ``stream`` wait until ``layer``'s MLA KV is on the device."""
        if "kv" in self.unsafe_skip:
            return  # UNSAFE
        if layer not in self.kv_ready:
            raise ValueError(f"layer: expected a layer of this load {list(self.layers)}, got {layer}")
        stream.wait_event(self.kv_ready[layer])

    def done(self) -> bool:
        return self.kv_ready[self.layers[-1]].query() if self.layers else True


def compute_ready(runtime: Runtime) -> Event:
    """An event recorded on ``runtime``'s compute stream now: everything the compute stream was given
    so far (device tensors created on a host thread, their zero fill) is done when it completes."""
    event = runtime.event()
    event.record(runtime.compute_stream())
    return event


class LayerwiseLoader:
    def __init__(self, runtime: Runtime, device_pool: DSADevicePool, host_pool: DSAHostPool,
                 unsafe_skip: frozenset[str] | set[str] = frozenset()) -> None:
        bad = set(unsafe_skip) - set(UNSAFE_CHOICES)
        if bad:
            raise ValueError(f"unsafe_skip: expected a subset of {UNSAFE_CHOICES}, got {sorted(bad)}")
        missing = [layer for layer in host_pool.layers if layer not in device_pool.kv]
        if missing:
            raise ValueError(f"device pool: expected to hold the host pool's layers, missing {missing}")
        self.runtime, self.device_pool, self.host_pool = runtime, device_pool, host_pool
        self.stream = runtime.stream("load")
        self.unsafe_skip = frozenset(unsafe_skip)
        self._inflight: list[LayerLoad] = []
        if "init" not in self.unsafe_skip:  # hazard: the pools' zero fill (compute stream) comes first
            self.stream.wait_event(compute_ready(runtime))

    def start_loading(self, host_pages: list[int], device_pages: list[int], fences: list[Event] = (),
                      poison: int | None = None) -> LayerLoad:
        """Queue the layer-by-layer copy of ``host_pages`` into ``device_pages`` on the Load Stream.

        ``fences``: events the copies must follow (the allocator's fences of ``device_pages``, the
        D2H events of host pages still being written). ``poison``: fill the device pages with this
        byte first (stress tests: a read-before-ready then sees NaN, never stale-but-right data).
        """
        if len(host_pages) != len(device_pages):
            raise ValueError(f"device_pages: expected {len(host_pages)} pages (one per host page), got {len(device_pages)}")
        self.host_pool.allocator.incref(host_pages)  # hazard: host pages stay unreusable until done
        if "fence" not in self.unsafe_skip:
            for fence in fences:
                self.stream.wait_event(fence)
        ids = PageIds(self.host_pool, host_pages, self.device_pool, device_pages)
        load = LayerLoad(self.host_pool.layers, list(host_pages), list(device_pages), {}, {}, self.unsafe_skip)
        self.stream.submit(ids.stage, name="stage")  # page ids reach the device once, on this stream
        if poison is not None:
            poisoned = host_ids(device_pages, self.device_pool.device)
            self.stream.submit(lambda: self.device_pool.fill_pages(
                poisoned.to(self.device_pool.device, non_blocking=True), poison), name="poison")
        for layer in self.host_pool.layers:
            parts = ("index", "kv") if self.host_pool.spec.has_indexer(layer) else ("kv",)
            for part in parts:
                self.stream.submit(self._copy(load, ids, layer, part), name=f"{part}[{layer}]")
                event = self.runtime.event()
                event.record(self.stream)
                (load.indexer_ready if part == "index" else load.kv_ready)[layer] = event
        self._inflight.append(load)
        return load

    def _copy(self, load: LayerLoad, ids: PageIds, layer: int, part: str):
        def run() -> None:
            moved = copy_layer_part(self.host_pool, self.device_pool, ids, layer, part)
            load.bytes_copied += moved
            load.bytes_by_layer[layer] = load.bytes_by_layer.get(layer, 0) + moved
        return run

    def reclaim(self) -> int:
        """Release the host pages of finished loads; returns how many finished."""
        finished = [load for load in self._inflight if load.done()]
        for load in finished:
            self.host_pool.allocator.free(load.host_pages)
            self._inflight.remove(load)
        return len(finished)

    @property
    def inflight(self) -> int:
        return len(self._inflight)
