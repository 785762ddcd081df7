"""DSA HiCache: the device runtime and the cache tiers under the CP engine and the SGLang plug-in.

- :mod:`.streams` — CUDA or emulated streams and events, the compute stream, ``record_stream``;
  :mod:`.device_module` — a ``torch.cuda``-shaped facade over them;
- :mod:`.sanitizer` / :mod:`.sanitizer_access` — the stream-ordering sanitizer (GPU races found on a CPU);
- :mod:`.allocator` — page allocator; :mod:`.paged_buffers` — per-layer paged KV + indexer-key buffers;
  :mod:`.device_pool`, :mod:`.host_pool` — the device and host tiers;
- :mod:`.transfer` — page copies between tiers; :mod:`.radix` — the prefix radix tree;
- :mod:`.load_pipeline` — the layer-wise load on a Load Stream, with the indexer-ready and KV-ready
  events the forward waits on; :mod:`.stress` — its read-before-ready stress harness.

Depends on ``dsa_kernels`` (compute) and ``lsconfig`` only.
"""
