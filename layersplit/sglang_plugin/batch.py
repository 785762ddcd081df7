"""Tell the plug-in pool which pages the forward batch reads, without a host synchronization.

A BEFORE hook on the DSA attention backend's ``init_forward_metadata(forward_batch)`` (run once per
eager forward, on every CP rank, before any layer) hands ``set_batch_pages`` of the backend's
``token_to_kv_pool`` (if it has it: the plug-in's layer-split pool) the batch's page ids, split into
*prefix* pages (only cached tokens) and *new* pages (holding at least one token this forward writes).

Sizes come from the host metadata SGLang already holds (``seq_lens_cpu``, ``extend_prefix_lens_cpu``),
so the host never reads a device tensor: request i covers pages ``[0, ceil(seq_len_i / 64))`` of its
row in ``req_to_token``; those below ``prefix_len_i // 64`` are prefix pages, the rest new. One
gather on the device reads the page ids: ``req_to_token[req_pool_indices[i], column * 64] // 64``
(SGLang allocates whole pages, so a page's first slot names it). A prefix page two requests share
appears twice: harmless (the same rows broadcast twice), and deduplicating would need a sync.

CUDA graphs: a graph replay does not run this hook (the backend's ``init_forward_metadata_out_graph``
prepares replays), so the pages of an earlier batch would be stale. :func:`before_out_graph_metadata`
(a BEFORE hook on that method) and a capturing stream both switch the pool to upstream's path
(whole-buffer broadcasts), logged once.
"""

from __future__ import annotations

import logging

import torch

from layersplit.sglang_plugin import landing

log = logging.getLogger(__name__)
_logged: set[str] = set()


def _log_once(reason: str) -> None:
    if reason not in _logged:
        _logged.add(reason)
        log.info("layersplit: %s", reason)


def stream_capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (False without CUDA)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def page_columns(seq_lens_cpu: list[int], prefix_lens_cpu: list[int] | None, page_size: int):
    """Host index lists ``(request, first token column)`` of the batch's prefix pages and new pages."""
    prefix_rows, prefix_cols, new_rows, new_cols = [], [], [], []
    for i, seq_len in enumerate(seq_lens_cpu):
        first_new = 0 if prefix_lens_cpu is None else prefix_lens_cpu[i] // page_size
        n_pages = -(-seq_len // page_size)
        prefix_rows += [i] * first_new
        prefix_cols += [p * page_size for p in range(first_new)]
        new_rows += [i] * (n_pages - first_new)
        new_cols += [p * page_size for p in range(first_new, n_pages)]
    return (prefix_rows, prefix_cols), (new_rows, new_cols)


def gather_pages(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, rows: list[int], cols: list[int],
                 page_size: int) -> torch.Tensor:
    """Page ids at ``req_to_token[req_pool_indices[rows], cols]``: host lists copied to the device
    without waiting (pinned memory on CUDA), one gather there."""
    device = req_to_token.device
    host = torch.tensor([rows, cols], dtype=torch.int64)
    if device.type == "cuda":
        host = host.pin_memory()
    idx = host.to(device, non_blocking=True)
    return req_to_token[req_pool_indices.long()[idx[0]], idx[1]].long() // page_size


def batch_pages(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens_cpu, page_size: int,
                prefix_lens_cpu=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(prefix_pages, new_pages)`` of the batch as device int64 tensors (request order; a page
    shared by two requests' prefixes appears once per request)."""
    seq_lens = seq_lens_cpu.tolist() if isinstance(seq_lens_cpu, torch.Tensor) else list(seq_lens_cpu)
    prefix_lens = None if prefix_lens_cpu is None else list(prefix_lens_cpu)
    (p_rows, p_cols), (n_rows, n_cols) = page_columns(seq_lens, prefix_lens, page_size)
    return (gather_pages(req_to_token, req_pool_indices, p_rows, p_cols, page_size),
            gather_pages(req_to_token, req_pool_indices, n_rows, n_cols, page_size))


def before_init_forward_metadata(backend, forward_batch, *args, **kwargs):
    """HookRegistry BEFORE hook: ``fn(*args, **kwargs)`` with the method's own arguments."""
    pool = getattr(backend, "token_to_kv_pool", None)
    if not hasattr(pool, "set_batch_pages"):
        return None
    seq_lens_cpu = getattr(forward_batch, "seq_lens_cpu", None)
    if stream_capturing():
        _log_once("upstream layer-split path: the stream is capturing a CUDA graph (a replay would not tell "
                  "the pool its pages)")
        pool.set_forward_pages(None)
    elif seq_lens_cpu is None:
        _log_once("upstream layer-split path: the forward batch has no seq_lens_cpu (reading the device "
                  "seq_lens would sync)")
        pool.set_forward_pages(None)
    else:
        prefix, new = batch_pages(backend.req_to_token_pool.req_to_token, forward_batch.req_pool_indices,
                                  seq_lens_cpu, pool.page_size, getattr(forward_batch, "extend_prefix_lens_cpu", None))
        reason = landing.unsupported_reason(backend, forward_batch) if pool.landing == "batch" else None
        if reason:
            _log_once(f"pool-sized landing buffer for this forward: {reason}")
        pool.set_batch_pages(prefix, new, "pool" if reason else None)
    return None


def before_out_graph_metadata(backend, *args, **kwargs):
    """HookRegistry BEFORE hook on ``init_forward_metadata_out_graph`` (CUDA-graph capture and
    replay): the pool takes upstream's path, which reads no per-batch pages."""
    pool = getattr(backend, "token_to_kv_pool", None)
    if hasattr(pool, "set_batch_pages"):
        _log_once("upstream layer-split path: CUDA-graph capture or replay (the eager metadata hook does "
                  "not run on replay)")
        pool.set_forward_pages(None)
    return None


TARGET_METHOD = "init_forward_metadata"
TARGET_SIGNATURE = "(self, forward_batch: 'ForwardBatch')"
GRAPH_TARGET_METHOD = "init_forward_metadata_out_graph"
GRAPH_TARGET_SIGNATURE = "(self, forward_batch: 'ForwardBatch', in_capture: 'bool' = False)"
