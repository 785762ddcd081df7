"""Count host synchronizations in the plug-in's per-forward path: :class:`hicache.runtime.syncs.SyncCounter`.

The counter lives in :mod:`hicache.runtime.syncs` so that the engine's and the kernels' tests use the same
mechanism (``layersplit`` and the plug-in may import ``hicache``; ``hicache`` may not import them).

Which tensors count as *device* tensors here: those passed to :meth:`SyncCounter.device` (what SGLang
keeps on the device: ``req_to_token``, ``req_pool_indices``, ``seq_lens``, ``out_cache_loc``, the
pool buffers) and every result computed from one. Host metadata SGLang already holds
(``seq_lens_cpu``, ``extend_prefix_lens_cpu``) and tensors built from it are free to read.

Example::

    with SyncCounter() as guard:
        guard.device(forward_batch.seq_lens, req_to_token)
        hook(backend, forward_batch)
    assert guard.syncs == [], guard.sites()
"""

from __future__ import annotations

from hicache.runtime.syncs import SyncCounter

__all__ = ["SyncCounter"]
