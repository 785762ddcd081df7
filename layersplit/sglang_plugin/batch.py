"""Tell the plug-in pool which pages the forward batch reads, without a host synchronization.

An AFTER hook on the DSA attention backend's ``init_forward_metadata(forward_batch)`` (run once per
eager forward, on every CP rank, before any layer) hands ``set_batch_pages`` of the backend's
``token_to_kv_pool`` (if it has it: the plug-in's layer-split pool) the batch's page ids, split into
*prefix* pages (only cached tokens) and *new* pages (holding at least one token this forward writes).
AFTER, because upstream decides this batch's DSA kernel inside that method (``set_dsa_prefill_impl``:
``flashmla_auto`` resolves there), and the landing check reads that decision.

Sizes come from the host metadata SGLang already holds (``extend_prefix_lens_cpu``, and
``seq_lens_cpu`` or else prefix + ``extend_seq_lens_cpu``), so the host never reads a device tensor:
request i covers pages ``[0, ceil(seq_len_i / 64))`` of its row in ``req_to_token``; those below
``prefix_len_i // 64`` are prefix pages, the rest new. One gather on the device reads the page ids:
``req_to_token[req_pool_indices[i], column * 64] // 64`` (SGLang allocates whole pages, so a page's
first slot names it). A prefix page shared with an earlier request of the batch is gathered only
there: each request starts at its first unshared column (:mod:`.sharing`, measured on the host in
the scheduler's radix tree), so each prefix page is staged and broadcast once per batch.

CUDA graphs: a graph replay does not run this hook (the backend's ``init_forward_metadata_out_graph``
prepares replays), so the pages of an earlier batch would be stale. :func:`before_out_graph_metadata`
(a BEFORE hook on that method) and a capturing stream both switch the pool to upstream's path
(whole-buffer broadcasts into the landing layer, which the start-up plan allocates and counts for a
worker with graphs: :mod:`.startup`).
"""

from __future__ import annotations

import logging

import torch

from layersplit.sglang_plugin import landing, sharing

log = logging.getLogger(__name__)
_logged: set[str] = set()


def _log_once(reason: str) -> None:
    if reason not in _logged:
        _logged.add(reason)
        log.info("layersplit: %s", reason)


def stream_capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (False without CUDA)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def page_columns(seq_lens_cpu: list[int], prefix_lens_cpu: list[int] | None, page_size: int,
                 shared_cpu: list[int] | None = None):
    """Host index lists ``(request, first token column)`` of the batch's prefix pages and new pages;
    request i's first ``shared_cpu[i]`` tokens (whole pages) are an earlier request's, not listed."""
    prefix_rows, prefix_cols, new_rows, new_cols = [], [], [], []
    for i, seq_len in enumerate(seq_lens_cpu):
        first_new = 0 if prefix_lens_cpu is None else prefix_lens_cpu[i] // page_size
        first_own = 0 if shared_cpu is None else min(shared_cpu[i] // page_size, first_new)
        n_pages = -(-seq_len // page_size)
        prefix_rows += [i] * (first_new - first_own)
        prefix_cols += [p * page_size for p in range(first_own, first_new)]
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
                prefix_lens_cpu=None, shared_cpu=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(prefix_pages, new_pages)`` of the batch as device int64 tensors (request order; a prefix
    page shared with an earlier request, per ``shared_cpu``, appears once)."""
    seq_lens = seq_lens_cpu.tolist() if isinstance(seq_lens_cpu, torch.Tensor) else list(seq_lens_cpu)
    prefix_lens = None if prefix_lens_cpu is None else list(prefix_lens_cpu)
    (p_rows, p_cols), (n_rows, n_cols) = page_columns(seq_lens, prefix_lens, page_size, shared_cpu)
    return (gather_pages(req_to_token, req_pool_indices, p_rows, p_cols, page_size),
            gather_pages(req_to_token, req_pool_indices, n_rows, n_cols, page_size))


def host_seq_lens(forward_batch) -> list[int] | None:
    """Sequence lengths on the host: ``seq_lens_cpu``, else prefix + extend lengths (both host lists
    of every extend batch); None where neither is there."""
    seq_lens_cpu = getattr(forward_batch, "seq_lens_cpu", None)
    if seq_lens_cpu is not None:
        return seq_lens_cpu.tolist() if isinstance(seq_lens_cpu, torch.Tensor) else list(seq_lens_cpu)
    prefix, extend = (getattr(forward_batch, n, None) for n in ("extend_prefix_lens_cpu", "extend_seq_lens_cpu"))
    if prefix is None or extend is None:
        return None
    return [int(p) + int(e) for p, e in zip(prefix, extend)]


def give_batch_pages(backend, forward_batch) -> None:
    """Hand the backend's pool (if it is the plug-in's) this forward's pages."""
    pool = getattr(backend, "token_to_kv_pool", None)
    if not hasattr(pool, "set_batch_pages"):
        return
    seq_lens = host_seq_lens(forward_batch)
    if stream_capturing():
        _log_once("upstream layer-split path: the stream is capturing a CUDA graph (a replay would not tell "
                  "the pool its pages)")
        pool.set_forward_pages(None)
        return
    if seq_lens is None:
        # no host lengths: not an extend batch (a prefill worker runs extend batches); upstream's path,
        # which the start-up plan provides for only where graphs are on (else the pool refuses it)
        pool.set_forward_pages(None)
        return
    prefix_lens = getattr(forward_batch, "extend_prefix_lens_cpu", None)
    shared = None if prefix_lens is None else sharing.lookup(getattr(forward_batch, "rids", None), list(prefix_lens))
    prefix, new = batch_pages(backend.req_to_token_pool.req_to_token, forward_batch.req_pool_indices,
                              seq_lens, pool.page_size, prefix_lens, shared)
    reason = landing.unsupported_reason(backend, forward_batch) if pool.landing == "batch" else None
    pool.set_batch_pages(prefix, new, "pool" if reason else None, reason=reason)


def after_init_forward_metadata(result, backend, forward_batch, *args, **kwargs):
    """HookRegistry AFTER hook: ``fn(result, *args, **kwargs)``; runs once upstream has chosen this
    batch's kernel (``set_dsa_prefill_impl`` inside ``init_forward_metadata``)."""
    give_batch_pages(backend, forward_batch)
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
