"""LayerSplit pool for SGLang: :class:`LayerSplitPoolMixin` over SGLang's ``LayerSplitDSATokenToKVPool``.

What it changes against upstream's pool (row-only broadcasts, two staging slots, batch-sized landing,
prefix index keys off the critical path, fp8 rows, reads in place): see
docs/sglang-plugin.md#the-pool-compared-with-upstreams.

Invariants and hazards:

* every broadcast waits for HiCache's load of its layer first: the KV broadcast on the layer's KV-ready
  event, the indexer-key broadcast only on its indexer-ready event
  (:class:`layersplit.sglang_plugin.hicache.SplitLayerDoneCounter`); the broadcast stream waits, never the
  forward stream;
* nothing is allocated after start-up: the two staging slots are sized once (a whole context each;
  admission keeps a batch's de-duplicated pages within one, :mod:`.sharing`), and a ``batch`` pool refuses
  upstream's whole-buffer path rather than allocate its pool-sized landing layer;
* the per-forward path reads no device value on the host (no ``.item()``, ``unique``, boolean masks): sizes
  come from the host lists the hook builds, and the page ids it hands over are trusted, not validated;
* every CP rank is handed the same pages; ownership stays upstream's contiguous split (SGLang's PD transfer
  labels a rank's layers as one range ``[layer_shard_start, ...)`` and its HiCache host pools assume it);
* without batch pages (a CUDA-graph replay, a batch without host lengths) the pool runs upstream's
  whole-buffer path into upstream's landing layer, which exists only where the start-up plan chose
  ``pool`` landing — and still waits for HiCache's layer counter, where upstream's prefetch without a
  broadcast communicator does not (a read before the layer is loaded).

:class:`LayerSplitPoolMixin` holds the methods; :func:`make_pool_class` combines it with SGLang's class
when the plug-in loads, so ``import layersplit`` needs no sglang.
"""

from __future__ import annotations

import logging

import torch

from lsconfig import envs
from layersplit.sglang_plugin import compat, metrics, startup
from layersplit.sglang_plugin.index_cache import make_index_cache_class
from layersplit.sglang_plugin.pool_buffers import PoolBuffersMixin
from layersplit.sglang_plugin.staging import Slots, StagedBroadcastMixin

log = logging.getLogger(__name__)


class LayerSplitPoolMixin(PoolBuffersMixin, StagedBroadcastMixin):
    """Overrides of SGLang's ``LayerSplitDSATokenToKVPool`` (see docs/sglang-plugin.md); combined with it
    by :func:`make_pool_class`, which also sets ``index_cache_cls``."""

    index_cache_cls: type  # the indexer-key cache class, set by make_pool_class

    def __init__(self, *args, layer_shard_rank: int, layer_shard_size: int, **kwargs):
        self._init_config()
        self._init_forward_state()
        super().__init__(*args, layer_shard_rank=layer_shard_rank, layer_shard_size=layer_shard_size, **kwargs)
        self._allocate_index_slots()
        self._check_counted()
        self.publish_capacity()
        log.info("layersplit: %s landing; staging 2 x %d KV rows + 2 x %d index pages = %.3f GB",
                 self.landing, self._kv.buffers[0].shape[0], self._slot_pages(), self.staging_bytes() / 1e9)

    def _init_config(self) -> None:
        """Landing, start-up plan, metrics: read before upstream's constructor allocates."""
        self.landing = envs.sglang_landing()  # configured: "batch" or "pool"
        self.startup_plan = startup.current()  # made by the budget hook; None outside a server
        if self.startup_plan is not None:
            self.landing = self.startup_plan.landing
        self.landing_now = self.landing  # this forward's ("pool" where the remap does not apply)
        self.metrics = metrics.shared()
        self._unsafe_skip = envs.sglang_unsafe_skip()

    def _init_forward_state(self) -> None:
        self.forward_pages: torch.Tensor | None = None  # prefix pages, then new pages (device)
        self._forward_rows: torch.Tensor | None = None  # their token rows
        self._prefix_pages: torch.Tensor | None = None  # batch pages without new tokens
        self._new_pages: torch.Tensor | None = None  # batch pages with new tokens
        self._slot_of_page: torch.Tensor | None = None  # batch landing: pool page -> slot page
        self.remapped_metadata = None  # (backend metadata, its remapped copy) of this forward
        self._kv = Slots("kv")
        self._index = Slots("index")  # [prefix pages | new pages] of a layer
        # bytes this rank entered into broadcasts: KV rows, prefix index pages (off the critical
        # path when prefetched), new-token index pages (on it)
        self.broadcast_bytes = {"kv": 0, "index_prefix": 0, "index_new": 0}

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

    # what SGLang calls --------------------------------------------------------------------
    def prefetch_kv_buffer(self, layer_id: int, layer_transfer_counter=None, layer_transfer_idx=None) -> None:
        if self.forward_pages is None:  # a batch the hook did not see: upstream's whole buffer
            self._prefetch_whole_layer(layer_id, layer_transfer_counter, layer_transfer_idx)
            return
        # the indexer reads first: its prefix pages go first on the broadcast stream
        if self._prefix_pages.numel() and self._has_index(layer_id) and not self._has(self._index, layer_id) \
                and self.index_key_cache.remote_layer_id != layer_id:
            self._fetch_index_prefix(layer_id)
        if not self._has(self._kv, layer_id):
            self._fetch(layer_id, layer_transfer_counter, layer_transfer_idx)

    def _prefetch_whole_layer(self, layer_id: int, counter, counter_idx) -> None:
        """Upstream's prefetch of the whole buffer into its landing layer (``pool`` landing only)."""
        self.require_pool_landing()
        if self.layer_broadcast_comm is None and counter is not None and counter_idx is not None \
                and "load_wait" not in self._unsafe_skip:
            # hazard: upstream's synchronous prefetch broadcasts the owner's layer before HiCache
            # finished loading it (read-before-ready); wait for the layer first
            counter.wait_until(counter_idx)
        super().prefetch_kv_buffer(layer_id, counter, counter_idx)

    def _get_broadcastable_kv_buffer(self, layer_id: int):
        if self.forward_pages is None:  # a batch the hook did not see: upstream's whole buffer
            self.require_pool_landing()
            return super()._get_broadcastable_kv_buffer(layer_id)
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
        if self.forward_pages is None and self.remote_kv_buffer is not None:
            return super().set_mla_kv_buffer(layer, loc_info, cache_k_nope, cache_k_rope)

        def write(buf, at):
            self._write_mla_kv_buffer(buf, at, cache_k_nope, cache_k_rope)

        self._write_layer(layer.layer_id, loc_info, write)

    def set_kv_buffer(self, layer, loc_info, cache_k, cache_v):
        """The combined-row write. Upstream asserts a bf16 pool here; with fp8 KV the row is split
        into its latent and rope parts and stored through SGLang's fp8 DSA quantizer, like
        ``set_mla_kv_buffer``."""
        if self.dsa_kv_cache_store_fp8:
            nope, rope = cache_k[..., : self.kv_lora_rank], cache_k[..., self.kv_lora_rank:]
            return self.set_mla_kv_buffer(layer, loc_info, nope, rope)
        if self.forward_pages is None and self.remote_kv_buffer is not None:
            return super().set_kv_buffer(layer, loc_info, cache_k, cache_v)
        if cache_k.dtype != self.dtype:
            cache_k = cache_k.to(self.dtype)
        rows = cache_k.view(self.store_dtype) if self.store_dtype != self.dtype else cache_k

        def write(buf, at):
            buf[at] = rows

        self._write_layer(layer.layer_id, loc_info, write)

    def _write_layer(self, layer_id: int, loc_info, write) -> None:
        """Apply ``write(buffer, loc)`` where this forward keeps ``layer_id``'s rows (:meth:`_write_rows`);
        without batch pages and without a landing buffer to keep current, to the owner's rows only."""
        from sglang.srt.mem_cache.memory_pool import unwrap_write_loc

        loc, _, _ = unwrap_write_loc(loc_info)
        if self.forward_pages is not None:
            self._write_rows(layer_id, loc, write)
        elif self._is_layer_owned(layer_id):
            write(self.kv_buffer[layer_id - self.start_layer], loc)

    def move_kv_cache(self, tgt_loc, src_loc):
        super().move_kv_cache(tgt_loc, src_loc)
        if self.forward_pages is not None:  # moved rows: staged and landed copies are stale
            self.set_batch_pages(self._prefix_pages, self._new_pages, self.landing_now)


def make_pool_class(base: type | None = None, index_cache_base: type | None = None) -> type:
    """:class:`LayerSplitPoolMixin` over ``base`` (default: the installed ``LayerSplitDSATokenToKVPool``),
    its indexer-key cache over ``index_cache_base`` (default: the installed ``LayerSplitIndexKeyCache``)."""
    base = base or compat.resolve("layer_split_pool")
    namespace = {"__module__": __name__, "index_cache_cls": make_index_cache_class(index_cache_base)}
    return type("LayerSplitPlusDSATokenToKVPool", (LayerSplitPoolMixin, base), namespace)


# The upstream methods this adapter overrides or calls, with the signatures it was written against.
# tests/layersplit/sglang_plugin/test_plugin.py fails if any of them disappears or changes signature.
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
