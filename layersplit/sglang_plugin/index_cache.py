"""The indexer-key cache of the plug-in pool (:mod:`layersplit.sglang_plugin.pool`): prefix pages
staged one layer ahead, new pages broadcast at read time, indexer-ready waits; with ``batch``
landing no pool-sized remote buffer.

:class:`LayerSplitIndexCacheMixin` holds the methods; :func:`make_index_cache_class` combines it with
SGLang's ``LayerSplitIndexKeyCache`` when the plug-in loads (sglang stays a lazy import).
"""

from __future__ import annotations

import torch

from layersplit.sglang_plugin import compat
from layersplit.sglang_plugin.staging import wait_index


class LayerSplitIndexCacheMixin:
    """Overrides of SGLang's ``LayerSplitIndexKeyCache``; ``self.pool`` is the plug-in pool."""

    def __init__(self, pool, index_buf_size: int):
        if pool.landing == "pool":
            super().__init__(pool, index_buf_size)
            return
        # upstream's owned-only per-layer buffers (IndexKeyCache), without the pool-sized remote
        # buffer LayerSplitIndexKeyCache adds; a forward that needs it is refused (require_pool_landing)
        compat.resolve("index_key_cache").__init__(self, pool, index_buf_size)
        self.remote_buffer = None
        self.remote_layer_id = None

    def move(self, tgt_loc: torch.Tensor, src_loc: torch.Tensor) -> None:
        """Token locations -> the tokens' bytes inside their pages (keys, then scales), owned
        layers only: SGLang's ``IndexKeyCache.move``. Upstream's layer-split override indexes page
        rows by token location (an ``IndexError`` past the page count, wrong rows below it)."""
        compat.resolve("index_key_cache").move(self, tgt_loc, src_loc)

    def get_buffer(self, layer_id: int) -> torch.Tensor:
        wait_index(self.pool.layer_transfer_counter, layer_id - self.pool.start_layer)
        return self.get_broadcastable_buffer(layer_id)

    def get_broadcastable_buffer(self, layer_id: int) -> torch.Tensor:
        pool = self.pool
        if pool.forward_pages is None:  # a batch the hook did not see: upstream's whole buffer
            pool.require_pool_landing()
            return super().get_broadcastable_buffer(layer_id)
        local = layer_id - pool.start_layer
        if self.remote_layer_id != layer_id:
            pool._land_index_prefix(layer_id)
            if pool._new_pages.numel():
                pool._send_new_index_pages(layer_id, self.buffer[local])
            self.remote_layer_id = layer_id
        if pool._is_layer_owned(layer_id):
            return self.buffer[local]  # upstream's raw layout, read in place
        return self.remote_buffer if pool.landing_now == "pool" else pool._index.buffers[layer_id % 2]


def make_index_cache_class(base: type | None = None) -> type:
    """:class:`LayerSplitIndexCacheMixin` over ``base`` (default: the installed ``LayerSplitIndexKeyCache``)."""
    base = base or compat.resolve("layer_split_index_cache")
    return type("LayerSplitPlusIndexKeyCache", (LayerSplitIndexCacheMixin, base), {"__module__": __name__})
