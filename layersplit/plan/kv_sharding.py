"""SGLang's page-level KV sharding under prefill CP (``--enable-kv-cache-sharding``, PR #37615), the
peer LayerSplit is measured against: its bytes per rank, its scratch and its gate, as sizes.

Read in SGLang 0.5.23's source (``mem_cache/page_interleave.py``, ``mem_cache/page_interleave_pool.py``,
``mem_cache/pool_host/page_interleave.py``, ``arg_groups/kv_shard_hook.py``):

* placement: a logical page is N physical pages, one per CP rank, so rank ``r`` keeps page ``p`` of
  *every* layer when ``p % N == r``: each rank holds 1/N of every layer's rows (KV and indexer keys);
* per batch, the prefix pages are all-gathered into a double-buffered scratch slot
  ``[prefix | chunk | trash page]`` one layer ahead, on a dedicated stream and communicator; acquiring
  layer ``l``'s slot for reading (its indexer read) kicks layer ``l+1``'s gather; the gather stream
  first waits for the compute stream and for HiCache's layer counter of that layer;
* each rank's send block is padded to ``sum_i ceil(K_i / N)`` pages (``K_i`` the prefix pages of
  request ``i``), so the gathered span is ``N`` times that;
* the host tier (HiCache) is striped the same way: each rank backs up and loads back only its own
  pages, all ranks in parallel; ``--hicache-storage-backend`` (L3) is refused, the host tier is not;
* as shipped, the scratch prefix region holds 8 full contexts (``8 * ceil_align(context_len, N * 64)``
  tokens) plus the batch's chunk (``ceil_align(chunked_prefill_size, 64)``) and a trash page, per slot,
  two slots, at ``kv_bytes + 128 + 4`` bytes a row (the indexer row exists on every layer);
* the gate for DSA models: CUDA, interleave prefill CP > 1, PP 1, TRTLLM prefill and decode backends,
  ``fp8_e4m3`` KV, page size 64, mooncake transfer, no DSA layer split, index_kpool 1, a PD prefill worker.

Why it does not run on Hopper (read in SGLang 0.5.23 and FlashInfer 0.7.2, the version 0.5.23 pins):

* ``srt/arg_groups/kv_shard_hook.py:45-54``: ``dsa_prefill_backend != "trtllm" or dsa_decode_backend !=
  "trtllm" or kv_cache_dtype != "fp8_e4m3" or page_size != 64`` raises "DSA KV sharding requires TRTLLM
  prefill/decode with fp8_e4m3 KV and page size 64." (``:36-44`` also requires ``device == "cuda"``);
* ``srt/arg_groups/overrides.py:715-720``: "Blackwell FP8 defaults to trtllm; Hopper FP8 to flashmla_kv."
  ``default = "trtllm" if major >= 10 else "flashmla_kv"`` (``:566``: "flashmla_kv on Hopper, trtllm on
  Blackwell"; ``:533-535``: DSA's ``auto`` KV dtype is fp8_e4m3 only where ``major >= 10``);
* naming trtllm by hand does not help: ``srt/layers/attention/dsa_backend.py:2210, 2567`` send the
  trtllm impl to ``_forward_trtllm``, which calls ``flashinfer.decode.trtllm_batch_decode_with_kv_cache_mla
  (..., backend="trtllm-gen")`` (``:3982, 4005``); in FlashInfer 0.7.2 that backend runs
  ``TrtllmGenMlaDecodeRunner`` (``flashinfer/mla/_core.py:4724-4727, 3444``), whose C++ runner
  ``TllmGenFmhaRunner`` checks ``mSM == kSM_100 || mSM == kSM_103 || mSM == kSM_107``, "Unsupported
  architecture" (``flashinfer/data/include/flashinfer/trtllm/fmha/fmhaRunner.cuh:37-38``; reached from
  ``data/csrc/trtllm_fmha_kernel_launcher.cu:194-195``).

So the shipped layout needs SM major 10 (:data:`SHIPPED_SM_MAJORS`); upstream's layer split has no SM gate
(``srt/arg_groups/model_hook.py:366-408``: PD prefill, interleave CP, mooncake, PP 1).

Assumed (not in the source): as *designed* (``kv-sharding``) the scratch is sized for the batch like
LayerSplit's (context pages + N - 1 padding pages per request + a trash page), and any KV dtype is
allowed; the all-gather moves ``(N - 1) / N`` of the gathered span into each rank at the NVLink rate
the cost model uses for every collective.
"""

from __future__ import annotations

from dsa_kernels.layout import PAGE_SIZE

SHIPPED_PREFIX_CONTEXTS = 8  # SGLang: _KV_SHARD_SCRATCH_PREFIX_CONTEXTS
SHIPPED_KV_DTYPE = "fp8"  # the gate requires --kv-cache-dtype fp8_e4m3 for DSA models
SHIPPED_SM_MAJORS = (10,)  # trtllm DSA backends: FlashInfer's trtllm-gen runner takes SM 10.0 / 10.3 / 10.7 only
SHIPPED_REQUIREMENTS = ("--enable-prefill-cp --cp-strategy interleave (CP > 1, PP 1)",
                        "--dsa-prefill-backend trtllm --dsa-decode-backend trtllm",
                        "--kv-cache-dtype fp8_e4m3 --page-size 64", "--disaggregation-mode prefill (mooncake)",
                        "no --enable-dsa-cache-layer-split, no --hicache-storage-backend")


def _align(n: int, granule: int) -> int:
    return -(-n // granule) * granule


def stripe_bytes_per_token(bytes_all_layers: int, cp: int) -> int:
    """Device (or host) bytes a rank spends on one cached token: 1/N of every layer's rows."""
    return -(-bytes_all_layers // cp)


def gathered_pages(prefix_pages: list[int], cp: int) -> int:
    """Pages the batch's all-gather assembles: ``N * sum_i ceil(K_i / N)`` (each rank's block padded)."""
    return cp * sum(-(-k // cp) for k in prefix_pages)


def designed_scratch_bytes(cp: int, max_batch_context: int, max_requests: int, row_bytes: int) -> int:
    """Two batch-sized slots (assumed design): the batch's context pages, N - 1 padding pages per
    request, a trash page."""
    pages = -(-max_batch_context // PAGE_SIZE) + max_requests * (cp - 1) + 1
    return 2 * pages * PAGE_SIZE * row_bytes if cp > 1 else 0


def shipped_scratch_bytes(cp: int, context_len: int, chunked_prefill_size: int, kv_row_bytes: int,
                          index_head_dim: int) -> int:
    """SGLang 0.5.23's two slots: 8 full contexts + the chunk + a trash page, each row KV + indexer key
    (``index_head_dim`` fp8 bytes + one fp32 scale per 128)."""
    if cp <= 1:
        return 0
    rows = (SHIPPED_PREFIX_CONTEXTS * _align(context_len, cp * PAGE_SIZE) + _align(chunked_prefill_size, PAGE_SIZE)
            + PAGE_SIZE)
    return 2 * rows * (kv_row_bytes + index_head_dim + index_head_dim // 128 * 4)
