"""Bytes the plug-in pool allocates beside the owned layers (pure arithmetic, no sglang import).

:mod:`layersplit.sglang_plugin.pool` allocates with these functions and ``layersplit plan``
(:mod:`layersplit.plan.capacity`) counts with them, so the capacity it prints is the pool's.

* staging: two slots (layer l uses slot l % 2), each ``slot_pages`` pages of latent rows
  (``page_size * kv_row_bytes``) and as many indexer-key pages (``index_page_bytes``);
* ``batch`` landing: the slots are where non-owned layers are read, plus a page remap table of
  ``REMAP_BYTES_PER_PAGE`` per pool page (pool page -> slot page, int64);
* ``pool`` landing: upstream's pool-sized landing layer (KV rows and indexer pages of every pool
  token) on top: one layer's bytes per pool token.
"""

from __future__ import annotations

REMAP_BYTES_PER_PAGE = 8  # int64 slot index per pool page


def slot_pages(scratch_tokens: int, pool_tokens: int, page_size: int) -> int:
    """Pages of each staging slot: ``scratch_tokens`` in whole pages, at most the pool's."""
    return -(-min(scratch_tokens, pool_tokens + page_size) // page_size)


def remap_pages(pool_tokens: int, page_size: int) -> int:
    """Entries of the page remap table: every page of the pool (``size + page_size`` token slots,
    SGLang's padded layout), plus one."""
    return (pool_tokens + page_size) // page_size + 1


def staging_bytes(pages: int, page_size: int, kv_row_bytes: int, index_page_bytes: int) -> int:
    """Both slots: latent rows and indexer-key pages."""
    return 2 * pages * (page_size * kv_row_bytes + index_page_bytes)
