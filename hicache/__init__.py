"""DSA HiCache: the cache tiers and their layer-wise load, on a device runtime with its own sanitizer.

Three rooms, arrows pointing down:

- the cache tiers (this package): :mod:`.allocator` — page allocator; :mod:`.paged_buffers` — per-layer
  paged KV + indexer-key buffers; :mod:`.device_pool`, :mod:`.host_pool` — the device and host tiers;
  :mod:`.transfer` — page copies between tiers; :mod:`.radix` — the prefix radix tree;
  :mod:`.load_pipeline` — the layer-wise load on a Load Stream, with the indexer-ready and KV-ready
  events the forward waits on; :mod:`.stress` — its read-before-ready stress harness;
- :mod:`hicache.runtime` — streams and events (CUDA or emulated), the device module, happens-before
  clocks, the host-sync counter;
- :mod:`hicache.sanitizer` — the stream-ordering sanitizer (GPU races found on a CPU) and CSAN's hazards.

Depends on ``dsa_kernels`` (compute) and ``lsconfig`` only.
"""
