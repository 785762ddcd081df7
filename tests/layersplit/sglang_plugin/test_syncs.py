"""The plug-in's per-forward path (forward-pages hook + pool, every layer) reads no device value on
the host, and its CUDA-graph fallback; against the real sglang package, on CPU.

A synchronization cannot be observed on CPU, so :class:`layersplit.sglang_plugin.sync_guard.SyncCounter`
flags the operations that would synchronize on a GPU, applied to the tensors SGLang keeps on the
device. The detector is shown to fire on the previous hook (``int(max)``, ``unique``, boolean mask)
and on the validated public entry point, which reads page ids on the host by design.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from types import SimpleNamespace

import pytest
import torch

if os.environ.get("CI"):
    import sglang  # noqa: F401
else:
    pytest.importorskip("sglang")

from layersplit.sglang_plugin import batch as batch_hook  # noqa: E402
from layersplit.sglang_plugin.pool import make_pool_class  # noqa: E402
from layersplit.sglang_plugin.stress import (  # noqa: E402
    LAYERS, PAGE, SIZE, dsa_pool_kwargs, forward_layers, published, write_prefix)
from layersplit.sglang_plugin.sync_guard import SyncCounter  # noqa: E402


@dataclasses.dataclass
class _Metadata:
    """The page-table fields of SGLang's DSAMetadata the remap rewrites."""

    page_table_1: torch.Tensor
    page_table_1_flattened: torch.Tensor
    real_page_table: torch.Tensor
    indexer_logical_page_table: torch.Tensor | None = None


def _previous_batch_pages(req_to_token, req_pool_indices, seq_lens, page_size):
    """The hook before this change (kept here as the detector's positive control)."""
    max_len = int(seq_lens.max())
    locs = req_to_token[req_pool_indices.long(), :max_len]
    valid = torch.arange(max_len)[None, :] < seq_lens[:, None]
    return torch.unique(locs[valid].long() // page_size)


def _no_collective(tensor, layer_id, src_tensor=None, use_layer_broadcast_comm=False):
    """One process stands for both ranks: the broadcast (gloo/NCCL, not the plug-in's code) is left out."""
    return tensor


def _setup():
    req_to_token_pool = __import__("sglang.srt.mem_cache.memory_pool", fromlist=["x"]).ReqToTokenPool(
        size=4, max_context_len=300, device="cpu", enable_memory_saver=False)
    table = req_to_token_pool.req_to_token
    table[1, :PAGE * 2] = torch.arange(1 * PAGE, 3 * PAGE)  # cached pages 1, 2
    table[1, PAGE * 2:170] = torch.arange(5 * PAGE, 5 * PAGE + 42)  # new tokens in page 5
    table[3, :PAGE] = torch.arange(4 * PAGE, 5 * PAGE)  # cached page 4
    table[3, PAGE:PAGE + 10] = torch.arange(6 * PAGE, 6 * PAGE + 10)  # new tokens in page 6
    with published(world=2):
        pool = make_pool_class()(SIZE, **dsa_pool_kwargs(), layer_shard_rank=1, layer_shard_size=2)
        write_prefix(pool)
    pool._broadcast_tensor_from_owner = _no_collective
    backend = SimpleNamespace(token_to_kv_pool=pool, req_to_token_pool=req_to_token_pool,
                              dsa_prefill_impl="flashmla_sparse")
    forward_batch = SimpleNamespace(req_pool_indices=torch.tensor([1, 3]), seq_lens=torch.tensor([170, 74]),
                                    seq_lens_cpu=torch.tensor([170, 74]), extend_prefix_lens_cpu=[128, 64],
                                    out_cache_loc=torch.cat([torch.arange(5 * PAGE, 5 * PAGE + 42),
                                                             torch.arange(6 * PAGE, 6 * PAGE + 10)]))
    device_side = [req_to_token_pool.req_to_token, forward_batch.req_pool_indices, forward_batch.seq_lens,
                   forward_batch.out_cache_loc, *pool.kv_buffer, *pool.index_key_cache.buffer,
                   *pool.kv_staging, *pool._index.buffers, pool._slot_of_page]
    return pool, backend, forward_batch, device_side


def _gpu_write_path(monkeypatch) -> None:
    """SGLang's latent-row scatter as on a GPU (its Triton kernel, interpreted), not the torch
    stand-in it picks on platforms without Triton (``set_mla_kv_buffer_naive``, which masks)."""
    import msgspec
    from sglang.srt.platforms import current_platform

    caps = current_platform.capabilities
    monkeypatch.setattr(current_platform, "capabilities", msgspec.structs.replace(caps, supports_triton=True))


def test_one_forward_has_no_host_syncs(monkeypatch):
    """Hook + pool over every layer of one forward (index store and read, KV write and read, the
    one-layer-ahead prefetch, the landing remap of a non-owned layer's tables): no synchronizing op
    touches a device tensor."""
    from layersplit.sglang_plugin import landing

    _gpu_write_path(monkeypatch)

    pool, backend, forward_batch, device_side = _setup()
    table = backend.req_to_token_pool.req_to_token[forward_batch.req_pool_indices, :170]
    metadata = _Metadata(page_table_1=table, page_table_1_flattened=table[0], real_page_table=table[:, ::PAGE] // PAGE)
    with published(world=2), SyncCounter() as guard:
        guard.device(*device_side, table)
        batch_hook.give_batch_pages(backend, forward_batch)
        reads = forward_layers(pool, seed=4)
        remapped = landing.remap_metadata(metadata, pool)
    assert guard.syncs == [], list(zip(guard.syncs, guard.where))
    assert pool.forward_pages.tolist() == [1, 2, 4, 5, 6] and pool._new_pages.tolist() == [5, 6]
    assert len(reads) == LAYERS and remapped.real_page_table.tolist() == [[0, 1, 3], [2, 4, 0]]


def test_detector_fires_on_the_previous_hook_and_the_validated_entry():
    pool, backend, forward_batch, device_side = _setup()
    with published(world=2), SyncCounter() as guard:
        guard.device(*device_side)
        _previous_batch_pages(backend.req_to_token_pool.req_to_token, forward_batch.req_pool_indices,
                              forward_batch.seq_lens, PAGE)
    assert {"aten._local_scalar_dense.default", "aten._unique2.default", "aten.index.Tensor"} <= set(guard.syncs)
    with published(world=2), SyncCounter() as guard:
        guard.device(*device_side)
        pages = backend.req_to_token_pool.req_to_token[1, :PAGE * 3:PAGE] // PAGE
        pool.set_forward_pages(pages, new_pages=pages[-1:])  # validates: reads the ids on the host
    assert "aten._unique2.default" in guard.syncs and "tolist" in guard.syncs


def test_cuda_graph_capture_and_replay_take_upstreams_path(monkeypatch, caplog):
    """A capturing stream, and the graph metadata path (capture and replay, where the eager hook does
    not run), switch the pool to upstream's whole-buffer path, logged once per reason."""
    pool, backend, forward_batch, _ = _setup()
    batch_hook._logged.clear()
    caplog.set_level(logging.INFO, logger=batch_hook.__name__)
    with published(world=2):
        batch_hook.give_batch_pages(backend, forward_batch)
        assert pool.forward_pages is not None
        monkeypatch.setattr(batch_hook, "stream_capturing", lambda: True)
        batch_hook.give_batch_pages(backend, forward_batch)
        batch_hook.give_batch_pages(backend, forward_batch)
        assert pool.forward_pages is None
        assert sum("capturing a CUDA graph" in r.getMessage() for r in caplog.records) == 1
        monkeypatch.setattr(batch_hook, "stream_capturing", lambda: False)
        batch_hook.give_batch_pages(backend, forward_batch)
        assert pool.forward_pages is not None
        batch_hook.before_out_graph_metadata(backend, forward_batch, in_capture=False)  # a replay
        assert pool.forward_pages is None
        assert any("CUDA-graph capture or replay" in r.getMessage() for r in caplog.records)
    assert not torch.cuda.is_available() or batch_hook.stream_capturing() is False
