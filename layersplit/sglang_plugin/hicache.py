"""HiCache adapter: per-layer **indexer-ready** and **KV-ready** events in SGLang's host->device load.

Upstream ``L2TransferEngine.submit_host_to_device`` copies, for each layer, the latent KV (the anchor
MLA host pool) and then the indexer keys (``DSAIndexerPoolHost``), and records one event per layer
(``LayerDoneCounter``); every reader of the layer waits for both. The lightning indexer only needs the
indexer keys, about 1/8 of the layer's bytes, so it waits for rows it does not read.

This adapter, installed as class REPLACE hooks:

* :func:`make_counter_class` -> ``SplitLayerDoneCounter``: each layer-loading event set also carries
  an indexer-ready event per layer and ``wait_index_until(layer)``; ``wait_until`` keeps meaning
  "the whole layer is loaded";
* :func:`make_engine_class` -> ``IndexFirstL2TransferEngine``: per layer it copies the indexer keys
  first and records the indexer-ready event, then the KV rows and the layer event. Without an
  indexer transfer or a split counter it runs upstream's loop unchanged.

* :func:`around_get_local_buffer`, an AROUND hook on ``IndexKeyCache.get_local_buffer``: the
  indexer's own path to its keys (it stores new keys through it, and reads through it on plain DSA
  pools) waits ``wait_index_until`` instead of the whole layer.

Readers: the indexer (above, and the plug-in pool's broadcast path in
:mod:`layersplit.sglang_plugin.pool`) waits ``wait_index_until``; latent-KV reads and broadcasts keep
upstream's ``wait_until``.
``LAYERSPLIT_SGLANG_UNSAFE_SKIP=index_wait`` drops the indexer's wait: for the stress test only.
"""

from __future__ import annotations

import importlib

import torch

from lsconfig import envs
from layersplit.sglang_plugin import compat, metrics


def _module_of(cls: type):
    return importlib.import_module(cls.__module__)


def make_counter_class(base: type | None = None, loading_base: type | None = None) -> type:
    base = base or compat.resolve("layer_done_counter")
    loading_base = loading_base or compat.resolve("layer_loading_event")
    module = _module_of(loading_base)  # its ``device_module`` is the one upstream records on

    class SplitLayerLoadingEvent(loading_base):
        def __init__(self, num_layers: int):
            super().__init__(num_layers)
            self.index_events = [module.device_module.Event() for _ in range(num_layers)]
            self._index_recorded = [False] * num_layers  # by complete_index since the layer's last complete
            self.unsafe_skip = envs.sglang_unsafe_skip()

        def complete_index(self, layer_index: int) -> None:
            """Recorded on the load stream after the layer's indexer-key copy was queued."""
            assert 0 <= layer_index < self._num_layers
            self.index_events[layer_index].record()
            self._index_recorded[layer_index] = True

        def complete(self, layer_index: int) -> None:
            """The whole layer is loaded. Where no indexer-first copy recorded the indexer-ready event
            for this load (upstream's loop ran: no indexer transfer, or a plain counter upstream), it
            is recorded here too: a wait on an event never recorded would return at once."""
            super().complete(layer_index)
            if not self._index_recorded[layer_index] and "index_fallback" not in self.unsafe_skip:
                self.index_events[layer_index].record()
            self._index_recorded[layer_index] = False

        def wait_index(self, layer_index: int) -> None:
            if "index_wait" in self.unsafe_skip:  # UNSAFE: stress tests only
                return
            module.device_module.current_stream().wait_event(self.index_events[layer_index])

    class SplitLayerDoneCounter(base):
        def __init__(self, num_layers: int):
            super().__init__(num_layers)
            self.events = [SplitLayerLoadingEvent(num_layers) for _ in range(self.num_counters)]

        def wait_index_until(self, threshold: int) -> None:
            """The current stream waits until the indexer keys of local layer ``threshold`` are loaded."""
            if self.consumer_index < 0:
                return
            event = self.events[self.consumer_index]
            metrics.shared().timed_wait("index_ready", lambda: event.wait_index(threshold))

        def wait_until(self, threshold: int) -> None:
            """Upstream's whole-layer wait (KV-ready), counted for the operator."""
            metrics.shared().timed_wait("kv_ready", lambda: super(SplitLayerDoneCounter, self).wait_until(threshold))

    return SplitLayerDoneCounter


def around_get_local_buffer(original, cache, layer_id: int):
    """HookRegistry AROUND hook on ``IndexKeyCache.get_local_buffer``, the indexer's path to its keys
    (``get_index_k_with_scale_buffer``, used to store and, on plain DSA pools, to read them): wait for
    the layer's indexer keys only, where the counter has that event; else upstream as is."""
    pool = cache.pool
    counter = pool.layer_transfer_counter
    if getattr(counter, "wait_index_until", None) is None:
        return original(cache, layer_id)
    counter.wait_index_until(layer_id - pool.start_layer)
    return cache._kernel_view(cache.buffer[layer_id - pool.start_layer])


INDEX_READ_TARGET = "get_local_buffer"


def is_indexer_transfer(transfer, indexer_host: type | None = None) -> bool:
    indexer_host = indexer_host or compat.resolve("dsa_indexer_host_pool")
    return isinstance(transfer.host_pool, indexer_host)


def make_engine_class(base: type | None = None) -> type:
    base = base or compat.resolve("l2_transfer_engine")
    module = _module_of(base)
    indexer_host = compat.resolve("dsa_indexer_host_pool")

    class IndexFirstL2TransferEngine(base):
        def submit_host_to_device(self, transfers, *, transfer_layer_id_max: int, start_event=None,
                                  on_layer_done=None):
            complete_index = getattr(getattr(on_layer_done, "__self__", None), "complete_index", None)
            if complete_index is None or not any(is_indexer_transfer(t, indexer_host) for t in transfers):
                return super().submit_host_to_device(transfers, transfer_layer_id_max=transfer_layer_id_max,
                                                     start_event=start_event, on_layer_done=on_layer_done)
            launch = getattr(module.device_module, "launch", None)  # the emulated module queues host work
            with self._submission(transfers, self.host_to_device_stream, "host_to_device", start_event) as (
                    prepared, completion):
                primary = prepared[0] if prepared else None
                phases = (([t for t in prepared if is_indexer_transfer(t, indexer_host)], complete_index),
                          ([t for t in prepared if not is_indexer_transfer(t, indexer_host)], on_layer_done))
                delay_cycles = module.envs.SGLANG_TEST_HICACHE_H2D_DELAY_CYCLES.get()
                for layer_id in range(transfer_layer_id_max):
                    if delay_cycles:
                        torch.cuda._sleep(delay_cycles)
                    for phase, done in phases:  # indexer keys, their event; then the rest, the layer event
                        for transfer in phase:
                            self._load_layer(transfer, layer_id, transfer is primary, launch)
                        done(layer_id)
            return completion

        def _load_layer(self, transfer, layer_id: int, is_primary: bool, launch) -> None:
            local = transfer.layer_mapper(layer_id) if transfer.layer_mapper is not None else layer_id
            if local is None or (not is_primary and transfer.layer_mapper is None
                                 and layer_id >= transfer.host_pool.layer_num):
                return  # upstream's skip rule, unchanged

            def copy():
                transfer.host_pool.load_to_device_per_layer_physical(
                    transfer.device_pool, transfer.host_indices, transfer.device_indices, local, self.io_backend,
                    is_draft=transfer.is_draft)

            launch(copy, f"h2d[{layer_id}]") if launch else copy()

    return IndexFirstL2TransferEngine


# Upstream names this adapter subclasses or calls, with the signatures it was written against.
UPSTREAM_CONTRACT = {
    "l2_transfer_engine": {
        "submit_host_to_device": "(self, transfers: 'list[L2Transfer]', *, transfer_layer_id_max: 'int', "
                                 "start_event=None, on_layer_done=None) -> 'TransferCompletion'",
        "_submission": "(self, transfers, stream, transfer_key, start_event=None)",
    },
    "layer_done_counter": {
        "__init__": "(self, num_layers: 'int')",
        "wait_until": "(self, threshold: 'int')",
        "set_consumer": "(self, index: 'int')",
        "update_producer": "(self)",
    },
    "layer_loading_event": {
        "__init__": "(self, num_layers: 'int')",
        "complete": "(self, layer_index: 'int')",
        "wait": "(self, layer_index: 'int')",
    },
    "index_key_cache": {
        "get_local_buffer": "(self, layer_id: 'int') -> 'torch.Tensor'",
        "_kernel_view": "(self, buffer: 'torch.Tensor') -> 'torch.Tensor'",
    },
    "dsa_indexer_host_pool": {
        "load_to_device_per_layer_physical": "(self, device_pool, host_indices, device_indices, layer_id, "
                                             "io_backend, *, is_draft: 'bool' = False) -> 'None'",
    },
}
