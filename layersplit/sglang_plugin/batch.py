"""Tell the plug-in pool which pages the forward batch reads.

A BEFORE hook on the DSA attention backend's ``init_forward_metadata(forward_batch)`` (run once per
forward, on every CP rank, before any layer) reads the batch's token locations the way the backend
itself does (``req_to_token[req_pool_indices, :seq_len]``) and hands their page ids, and those of the
new tokens (``out_cache_loc``), to ``set_forward_pages`` of the backend's ``token_to_kv_pool``, if the pool has it (the plug-in's layer-split pool); other pools
are left alone.
"""

from __future__ import annotations

import torch


def batch_pages(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                page_size: int) -> torch.Tensor:
    """Sorted unique page ids holding tokens ``[0, seq_len)`` of each request in the batch."""
    if req_pool_indices.numel() == 0:
        return torch.empty(0, dtype=torch.int64, device=req_to_token.device)
    max_len = int(seq_lens.max())
    locs = req_to_token[req_pool_indices.long(), :max_len]
    valid = torch.arange(max_len, device=locs.device)[None, :] < seq_lens.to(locs.device)[:, None]
    return torch.unique(locs[valid].long() // page_size)


def before_init_forward_metadata(backend, forward_batch, *args, **kwargs):
    """HookRegistry BEFORE hook: ``fn(*args, **kwargs)`` with the method's own arguments."""
    pool = getattr(backend, "token_to_kv_pool", None)
    if not hasattr(pool, "set_forward_pages"):
        return None
    pages = batch_pages(backend.req_to_token_pool.req_to_token, forward_batch.req_pool_indices, forward_batch.seq_lens,
                        pool.page_size)
    out = getattr(forward_batch, "out_cache_loc", None)  # where the new tokens are written
    new_pages = None if out is None else torch.unique(out.long() // pool.page_size)
    pool.set_forward_pages(pages, new_pages)
    return None


TARGET_METHOD = "init_forward_metadata"
TARGET_SIGNATURE = "(self, forward_batch: 'ForwardBatch')"
