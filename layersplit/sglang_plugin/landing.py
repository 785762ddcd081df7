"""Batch-sized landing: the DSA backend reads non-owned layers from the pool's staging slots.

With ``batch`` landing (:mod:`layersplit.sglang_plugin.pool`) a non-owned layer's rows sit in a
staging slot in the order of the batch's pages: pool page ``p`` is slot page ``slot_of_page[p]``. The
backend builds its page tables once per forward (``init_forward_metadata``) in pool addresses; this
module hands it, for each non-owned layer only, a copy of that metadata with every pool address
remapped, built once per forward on the device (no host sync) and cached on the pool:

* token locations (page size 1): ``page_table_1``, ``page_table_1_flattened`` (the ragged gather of
  prefix KV) -> ``slot_of_page[loc // 64] * 64 + loc % 64``;
* page ids: ``real_page_table`` (what the lightning indexer reads keys by),
  ``indexer_logical_page_table`` -> ``slot_of_page[page]``; negative (padding) entries stay.

Two AROUND hooks swap ``backend.forward_metadata`` for the remapped copy for the duration of one
call and put it back: ``forward_extend`` / ``forward_decode`` (attention, and its KV write, which
the pool remaps itself) and ``get_indexer_metadata`` (the indexer's per-layer view of the same
tables; a fused top-k kernel turns its top-k into slot rows through it). Top-k positions in the
ragged layout are offsets into the gathered rows, not pool addresses, and need nothing.

Under prefill CP (``--cp-strategy interleave``) the backend keeps pool addresses in these tables and
only selects each rank's rows (``page_table[bs_idx]``), and all-gathers the new latent rows before the
write, so the remap applies unchanged. Covered (``COVERED_IMPLS``): DSA prefill kernels that address the KV cache through those tables —
``flashmla_sparse`` (SGLang's default on Hopper with bf16 KV, the prefill-CP configuration),
``flashmla_kv`` (its default on Hopper with fp8 KV), ``flashmla_sparse_q8``, ``triton_sparse_mla``,
``flashinfer_sparse_mla``, ``fa3``, ``tilelang``, ``triton``. Not covered, each with its logged reason
(decided at start-up, :mod:`.startup`: such a worker keeps upstream's pool-sized landing layer, counted
in the KV budget, or is refused): ``trtllm`` (its own paged layout and metadata), ``aiter``/``intel_xpu``,
HiSparse (its own device translation; refused), index k-pools > 1 (pooled page tables). A DSA
KV-sharded pool never meets layer split: SGLang refuses the pair.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging

log = logging.getLogger(__name__)

from layersplit.sglang_plugin.startup import COVERED_IMPLS  # noqa: E402 (one list: start-up and per forward)

LOC_FIELDS = ("page_table_1", "page_table_1_flattened")
PAGE_FIELDS = ("real_page_table", "indexer_logical_page_table")


def backend_impl(backend, forward_batch) -> str | None:
    """The DSA kernel ``backend`` runs for this batch (prefill, or decode for verify/draft-extend)."""
    mode = getattr(forward_batch, "forward_mode", None)
    decode_like = mode is not None and (mode.is_target_verify() or mode.is_draft_extend_v2() or mode.is_decode())
    return getattr(backend, "dsa_decode_impl" if decode_like else "dsa_prefill_impl", None)


def unsupported_reason(backend, forward_batch) -> str | None:
    """Why this forward cannot read non-owned layers through remapped tables (None: it can)."""
    impl = backend_impl(backend, forward_batch)
    if impl not in COVERED_IMPLS:
        return f"DSA kernel {impl!r} is not covered by the page-table remap (covered: {', '.join(COVERED_IMPLS)})"
    if getattr(backend, "hisparse_coordinator", None) is not None:
        return "HiSparse translates page tables itself"
    if getattr(backend, "dsa_index_kpool", 1) > 1:
        return "index k-pool > 1 reads pooled page tables"
    if getattr(backend, "_kv_shard_pool", None) is not None:
        return "a DSA KV-sharded pool addresses its own scratch"
    return None


def remap_metadata(metadata, pool):
    """A copy of the backend's metadata with every pool address turned into a slot address."""
    changes = {}
    for name in LOC_FIELDS:
        table = getattr(metadata, name, None)
        if table is not None:
            changes[name] = pool.remap_locs(table)
    for name in PAGE_FIELDS:
        table = getattr(metadata, name, None)
        if table is not None:
            changes[name] = pool.remap_pages(table)
    return dataclasses.replace(metadata, **changes)


def remapped(backend, pool):
    """This forward's remapped metadata, built on first use and cached on the pool (its batch state
    drops it on the next forward)."""
    metadata = backend.forward_metadata
    cached = pool.remapped_metadata
    if cached is None or cached[0] is not metadata:
        cached = (metadata, remap_metadata(metadata, pool))
        pool.remapped_metadata = cached
    return cached[1]


@contextlib.contextmanager
def reading(backend, layer_id: int):
    """``backend.forward_metadata`` is the remapped copy inside the block where ``layer_id`` is read
    from a slot; unchanged otherwise (owned layers, other pools, pool landing)."""
    pool = getattr(backend, "token_to_kv_pool", None)
    if not getattr(pool, "reads_remapped", lambda _: False)(layer_id):
        yield
        return
    saved = backend.forward_metadata
    backend.forward_metadata = remapped(backend, pool)
    try:
        yield
    finally:
        backend.forward_metadata = saved


def _layer_id(args, kwargs) -> int:
    layer = kwargs["layer"] if "layer" in kwargs else args[3]  # (q, k, v, layer, forward_batch, ...)
    return layer.layer_id


def around_forward(original, backend, *args, **kwargs):
    """HookRegistry AROUND hook on the backend's ``forward_extend`` and ``forward_decode``."""
    with reading(backend, _layer_id(args, kwargs)):
        return original(backend, *args, **kwargs)


def around_get_indexer_metadata(original, backend, layer_id: int, forward_batch):
    """HookRegistry AROUND hook on the backend's ``get_indexer_metadata(layer_id, forward_batch)``."""
    with reading(backend, layer_id):
        return original(backend, layer_id, forward_batch)


FORWARD_TARGETS = ("forward_extend", "forward_decode")
INDEXER_TARGET = "get_indexer_metadata"
INDEXER_TARGET_SIGNATURE = "(self, layer_id: 'int', forward_batch: 'ForwardBatch') -> 'DSAIndexerMetadata'"
