"""What the plug-in pool will allocate and how it will read non-owned layers, decided once at start-up.

Nothing is allocated in a forward: the staging slots, the page remap table and (where a configuration
needs it) upstream's pool-sized landing layer are sized here from the resolved server arguments,
charged to the KV budget SGLang sizes at start-up (:mod:`.budget`), and allocated when the pool is
built, inside ``custom_mem_pool`` and the memory-saver region.

Each forward path the batch-sized landing cannot serve is decided here, from the flag that causes
it (:func:`decide`):

* a DSA prefill kernel the page-table remap does not cover (``--dsa-prefill-backend trtllm``, the
  Blackwell fp8 default; ``aiter``, ``intel_xpu``), an index k-pool > 1 (the model's config), or a
  CUDA graph backend (graph replays do not run the metadata hook): ``pool`` landing, upstream's
  pool-sized landing layer **counted** in the budget (upstream's ``ceil(L/N) + 1`` layers per token);
* ``--enable-hisparse`` (its own page-table translation, and SGLang sizes every layer under it):
  **refused**, one line naming the flag.

Slots: each holds ``slot_tokens`` = max(``LAYERSPLIT_SGLANG_SCRATCH_TOKENS``, context length + a
page) rows, so the longest request alone always fits (a chunked prefill's whole prefix included);
batches of several requests are admitted only while their de-duplicated pages fit
(:mod:`.admission`).
"""

from __future__ import annotations

import dataclasses

from layersplit.plan import sizing

# DSA prefill kernels whose KV reads go through the page tables the remap rewrites (see landing.py)
COVERED_IMPLS = ("flashmla_sparse", "flashmla_kv", "flashmla_sparse_q8", "triton_sparse_mla",
                 "flashinfer_sparse_mla", "fa3", "tilelang", "triton")
# ``flashmla_auto`` is resolved per batch by SGLang's set_dsa_prefill_impl to one of these two
AUTO_IMPLS = {"flashmla_auto": ("flashmla_sparse", "flashmla_kv")}


class StartupRefused(ValueError):
    """A server configuration the plug-in refuses before any allocation."""


@dataclasses.dataclass(frozen=True)
class Plan:
    """The start-up decision: ``landing`` (``batch``: slots read through remapped tables; ``pool``:
    upstream's landing layer kept and counted), why (``reasons``, one line each), and the bytes."""

    landing: str
    reasons: tuple[str, ...]
    slot_pages: int
    page_size: int
    kv_row_bytes: int
    index_page_bytes: int

    @property
    def slot_tokens(self) -> int:
        return self.slot_pages * self.page_size

    @property
    def staging_bytes(self) -> int:
        """Both slots, KV rows and indexer-key pages (allocated once, at start-up)."""
        return sizing.staging_bytes(self.slot_pages, self.page_size, self.kv_row_bytes, self.index_page_bytes)

    def remap_bytes(self, pool_tokens: int) -> int:
        """The page remap table (``batch`` landing only): one int64 per pool page, plus one."""
        return 0 if self.landing == "pool" else sizing.remap_pages(pool_tokens, self.page_size) * 8

    def landing_bytes(self, pool_tokens: int) -> int:
        """Upstream's pool-sized landing layer (``pool`` landing only): KV rows and index pages."""
        if self.landing != "pool":
            return 0
        rows = pool_tokens + self.page_size
        return rows * self.kv_row_bytes + ((pool_tokens + self.page_size + 1) // self.page_size) * self.index_page_bytes


def slot_pages(scratch_tokens: int, context_len: int, page_size: int) -> int:
    """Pages of one slot: at least one whole request (its context length plus a partial page)."""
    return -(-max(scratch_tokens, context_len + page_size) // page_size)


def decide(*, prefill_impl: str, graphs: bool, hisparse: bool, index_kpool: int, configured: str = "batch",
           ) -> tuple[str, tuple[str, ...]]:
    """``(landing, reasons)`` for these resolved settings; raises :class:`StartupRefused` (one line,
    naming the flag) for a configuration the plug-in cannot serve within the budget."""
    if hisparse:
        raise StartupRefused("layersplit: --enable-hisparse is refused with the plug-in (HiSparse translates "
                             "page tables itself, and SGLang sizes every layer under it); remove the flag or "
                             "run without --layersplit")
    reasons = []
    impls = AUTO_IMPLS.get(prefill_impl, (prefill_impl,))
    if any(impl not in COVERED_IMPLS for impl in impls):
        reasons.append(f"--dsa-prefill-backend {prefill_impl}: not covered by the page-table remap "
                       f"(covered: {', '.join(COVERED_IMPLS)})")
    if index_kpool > 1:
        reasons.append(f"index k-pool {index_kpool} (model config): pooled page tables are not remapped")
    if graphs:
        reasons.append("CUDA graphs on this worker (--cuda-graph-backend-prefill / decode not disabled): a "
                       "replay does not run the metadata hook, so it reads upstream's landing layer")
    if configured == "pool":
        reasons.append("LAYERSPLIT_SGLANG_LANDING=pool")
    return ("pool" if reasons else "batch"), tuple(reasons)


def graphs_enabled(cuda_graph_config) -> bool:
    """Whether SGLang's resolved ``cuda_graph_config`` leaves a graph backend on for any phase."""
    if cuda_graph_config is None:
        return False
    for phase in ("prefill", "decode"):
        entry = (cuda_graph_config.get(phase) if isinstance(cuda_graph_config, dict)
                 else getattr(cuda_graph_config, phase, None))
        backend = entry.get("backend") if isinstance(entry, dict) else getattr(entry, "backend", None)
        if backend is not None and str(getattr(backend, "value", backend)).lower() not in ("disabled", "none"):
            return True
    return False


_current: dict = {}


def publish(plan: Plan) -> None:
    """Record this process's start-up plan (the budget hook makes it; the pool allocates by it)."""
    _current["plan"] = plan


def current() -> Plan | None:
    return _current.get("plan")


def forget() -> None:
    _current.clear()
