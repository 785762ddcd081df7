"""Read-before-ready stress harness for the layer-wise HiCache load.

Each iteration builds a batch of requests whose prefixes live in the host pool (random contents,
random lengths), allocates device pages, and queues the load with a random delay before every
layer's copies and with the device pages poisoned (0xFF bytes: NaN in bf16, e4m3 and fp32) first.
The forward stream then runs, per layer, the real lightning indexer + top-k + sparse MLA from
``dsa_kernels``, waiting on ``indexer_ready[l]`` / ``kv_ready[l]``. Every layer's output is compared
with a reference computed on the host copy. Device pages are freed right after the forward work is
queued, fenced by an event, so the next batch's load reuses them while the forward may still run.

The check is right on any backend (:func:`check_topk`, :func:`_rows_differ`): the forward keeps the
cache slots it chose per layer; an indexer layer's choice must be *a* valid top-k of the reference
scores (any choice among ties at the boundary: FlashInfer's radix top-k breaks exact ties in thread
order, and ReLU makes exact 0 ties common), within the indexer backend's tolerance
(:func:`score_tolerance`); attention is compared with the reference sparse MLA over the positions the
forward chose, on a snapshot of the batch's host rows (its host pages are reused before it is checked).

With all waits in place the harness must see 0 corrupted outputs. ``unsafe_skip`` drops a wait
('indexer', 'kv', both), the reuse fence ('fence') or the load stream's wait for the pool's zero fill
('init', a sanitizer teeth switch: the race is in the first op only); the harness must then detect
corruption (or, sanitized, the missing edge).
"""

from __future__ import annotations

import math
import random
import time
from collections import deque
from dataclasses import asdict, dataclass, field

import torch

from dsa_kernels import dispatch, indexer_scores, positions_to_slots, sparse_mla_prefill, topk_indices
from dsa_kernels.layout import PAGE_SIZE
from hicache.sanitizer import csan
from hicache import sanitizer
from hicache.allocator import OutOfPages
from hicache.device_pool import DSADevicePool
from hicache.host_pool import DSAHostPool
from hicache.load_pipeline import LayerLoad, LayerwiseLoader, compute_ready
from hicache.paged_buffers import DSACacheSpec
from hicache.runtime.streams import get_runtime

POISON = 0xFF
# indexer scores off the torch reference (Triton on a GPU: fp8 values as exact bf16 operands, fp32
# accumulation in another order) differ from the host reference's in the last bits: a relative error
# of about D * 2^-24 (< 1e-5 for D = 128); boundary positions closer than this fraction of the row's
# max |score| count as tied. Random keys' scores are O(max) apart, so corruption stays visible.
SCORE_REL_TOL = 1e-3
# sparse MLA output in bf16: ~2.5 units of bf16 roundoff (2^-8); lse is fp32 from bf16 products
OUT_TOL, LSE_TOL = 1e-2, 1e-3


@dataclass(frozen=True)
class StressConfig:
    layer_loads: int = 2000  # stop after this many layers were loaded
    seed: int = 0
    unsafe_skip: frozenset[str] = frozenset()
    runtime: str = "auto"
    max_requests: int = 3
    max_prefix_pages: int = 4
    queries_per_request: int = 6
    max_delay_s: float = 0.001  # random stall before each load-stream copy of indexer keys
    # KV copies stall longer, in proportion to their bytes: 1152 vs 132 B/token (GLM-5 bf16 KV vs fp8
    # indexer keys). At 3.0 the KV window was so narrow that --unsafe-skip-wait kv went undetected in
    # most 2,000-load runs (0-1 of 2,000 outputs corrupted); at this ratio 30-78 of 2,000 (3 seeds and 3 reruns)
    kv_delay_factor: float = 1152 / 132
    max_forward_delay_s: float = 0.001  # and before each forward op (widens the page-reuse window)
    index_heads: int = 4
    attn_heads: int = 4
    topk: int = 64
    pipeline_depth: int = 2  # batches in flight before the oldest is checked
    # each load also waits for the previous batch's forward: for CUDA's sanitizer, which tracks a tensor
    # by its pointer, so a load into pages no forward reads still conflicts with a forward reading other
    # pages of the same layer buffer. The reuse fence stays the edge under test ('fence' drops this too)
    fence_previous_forward: bool = False
    sanitize: bool = False  # run under the stream-ordering sanitizer (hicache.sanitizer)


@dataclass
class StressReport:
    runtime: str
    unsafe_skip: list[str]
    layers_loaded: int = 0
    batches: int = 0
    requests: int = 0
    outputs_checked: int = 0
    corrupted_outputs: int = 0
    corrupted_requests: int = 0
    poisoned_reads: int = 0
    seconds: float = 0.0
    corruption_rate: float = 0.0
    topk_rows_checked: int = 0  # indexer rows (query x indexer layer) whose top-k was checked
    topk_tie_rows: int = 0  # of those, rows with a tie at the k-th score: more than one valid top-k
    topk_invalid_rows: int = 0  # rows whose top-k was not a valid top-k of the reference scores
    score_rel_tol: float = 0.0  # the tolerance used (:func:`score_tolerance`)
    config: dict = field(default_factory=dict)
    sanitizer_hazards: int | None = None  # distinct stream-ordering hazards (None: not sanitized)
    sanitizer_hazard_kinds: dict = field(default_factory=dict)
    sanitizer_hazard_list: list = field(default_factory=list)

    @property
    def detected(self) -> bool:
        """Corruption seen, or (sanitized) a missing stream edge reported."""
        return bool(self.corrupted_outputs or self.sanitizer_hazards)


@dataclass
class _Batch:
    """One batch on the host: its inputs and the reference data to check the forward against. The
    host pages are freed (and reused) before the check, so the batch keeps a snapshot of its rows."""

    req_idx: torch.Tensor
    positions: torch.Tensor
    q_index: torch.Tensor
    weights: torch.Tensor
    q_attn: torch.Tensor
    max_ctx: int
    page_counts: list[int]  # pages of each request
    ref_scores: dict[int, torch.Tensor]  # indexer layer -> [T, max_ctx] fp32 reference scores (-inf: masked)
    ref_kv: dict[int, torch.Tensor]  # layer -> [B * width, row] bf16: request b's position p at row b * width + p
    width: int  # positions per request in ``ref_kv`` (max pages x 64)
    device_pages: list[int] = field(default_factory=list)  # the requests' device pages, in order
    fwd: "_Forward | None" = None


@dataclass
class _Forward:
    """The forward stream's copy of a batch and what it produced (device tensors, no host sync)."""

    req_idx: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    q_index: torch.Tensor | None = None
    weights: torch.Tensor | None = None
    q_attn: torch.Tensor | None = None
    page_table: torch.Tensor | None = None
    max_ctx: int = 0
    slots: torch.Tensor | None = None  # the last indexer layer's top-k, as cache slots [T, k]
    used: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> the slots its attention read
    nan_rows: dict[int, torch.Tensor] = field(default_factory=dict)  # indexer layer -> [T] bool: NaN score
    outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    poison_flags: list = field(default_factory=list)  # per layer, a device bool: NaN seen
    done: object = None  # event recorded after the batch's forward work


def _indexer_layer(f: _Forward, layer: int, index_buf: torch.Tensor, topk: int) -> None:
    """Lightning indexer + top-k of one layer; leaves the selected cache slots in ``f.slots``."""
    scores = indexer_scores(f.q_index, f.weights, index_buf, f.page_table, f.req_idx, f.positions, f.max_ctx)
    f.nan_rows[layer] = nan = torch.isnan(scores).any(1)  # on the device: a host sync would hide the race
    f.poison_flags.append(nan.any())
    f.slots = positions_to_slots(topk_indices(scores, topk), f.page_table, f.req_idx)


def _attention_layer(f: _Forward, layer: int, kv_buf: torch.Tensor, kv_lora_rank: int, sm_scale: float) -> None:
    """Sparse MLA over ``f.slots`` (the last indexer layer's top-k on layers without an indexer)."""
    f.used[layer] = f.slots
    out, lse = sparse_mla_prefill(f.q_attn, kv_buf, f.slots, sm_scale, kv_lora_rank)
    f.poison_flags.append(torch.isnan(out).any())
    f.outputs[layer] = out, lse


# checks that hold on every backend ---------------------------------------------------------------
def score_tolerance(device: torch.device) -> float:
    """Relative tolerance of the forward's indexer scores against the host reference: 0 where the
    forward runs the torch reference itself (the same fp32 ops), else :data:`SCORE_REL_TOL`."""
    return 0.0 if dispatch.resolve("indexer_scores", device)[0] == "torch" else SCORE_REL_TOL


def check_topk(ref: torch.Tensor, chosen: torch.Tensor, k: int, rel_tol: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(valid [T], tie [T])`` bool: is ``chosen [T, k]`` (positions; -1 none, -2 not the query's
    request) *a* top-k of the reference scores ``ref [T, C]`` (fp32, -inf masked)?

    Valid: ``min(k, visible)`` distinct visible positions; each chosen score >= the k-th reference
    score - tol, each unchosen visible one <= the k-th + tol (tol = ``rel_tol`` x the row's max
    |score|). Any choice among (near-)ties at the boundary is valid; ``tie`` marks those rows.
    Example: scores [3, 0, 0], k=2: {0, 1} and {0, 2} are valid (tie), {1, 2} is not.
    """
    t_count, n = ref.shape
    vis = torch.isfinite(ref)
    need = vis.sum(1).clamp(max=k)
    real = chosen >= 0
    picked = torch.zeros(t_count, n + 1, dtype=torch.bool)
    picked.scatter_(1, torch.where(real & (chosen < n), chosen, n).long(), True)
    picked = picked[:, :n]  # duplicates and out-of-range positions fall out of the count below
    count_ok = (picked.sum(1) == need) & (real.sum(1) == need) & ((chosen == -1) | real).all(1)
    kth = ref.sort(1, descending=True).values.gather(1, (need - 1).clamp(min=0)[:, None])[:, 0]
    tol = rel_tol * ref.masked_fill(~vis, 0).abs().amax(1)
    low_ok = ref.masked_fill(~(picked & vis), float("inf")).amin(1) >= kth - tol
    high_ok = ref.masked_fill(~(vis & ~picked), float("-inf")).amax(1) <= kth + tol
    valid = count_ok & ~(picked & ~vis).any(1) & low_ok & high_ok & ~torch.isnan(ref).any(1)  # NaN: poisoned
    tie = (need > 0) & ((vis & (ref >= (kth - tol)[:, None])).sum(1) > need)
    return valid, tie


def page_owners(device_pages: list[int], page_counts: list[int], num_pages: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(owner, index) [num_pages]``: the request each device page belongs to (-1: none) and its
    place in that request's pages (``device_pages``: the requests' pages in order, ``page_counts``)."""
    owner = torch.full((num_pages,), -1, dtype=torch.long)
    index = torch.zeros(num_pages, dtype=torch.long)
    pages = torch.tensor(device_pages, dtype=torch.long)
    owner[pages] = torch.repeat_interleave(torch.arange(len(page_counts)), torch.tensor(page_counts))
    index[pages] = torch.cat([torch.arange(n) for n in page_counts])
    return owner, index


def slots_to_positions(slots: torch.Tensor, owner: torch.Tensor, index: torch.Tensor, req_idx: torch.Tensor) -> torch.Tensor:
    """Cache slots ``[T, k]`` (-1 none) back to positions in each query's request (:func:`page_owners`);
    -2 where a slot is not in the query's request's pages."""
    s = slots.long()
    page = (s // PAGE_SIZE).clamp(0, len(owner) - 1)
    mine = (s >= 0) & (s < len(owner) * PAGE_SIZE) & (owner[page] == req_idx.long()[:, None])
    return torch.where(s == -1, -1, torch.where(mine, index[page] * PAGE_SIZE + s % PAGE_SIZE, -2))


def _rows_differ(out: torch.Tensor, lse: torch.Tensor, ref_out: torch.Tensor, ref_lse: torch.Tensor) -> torch.Tensor:
    """``[T]`` bool: NaN, a different -inf (empty row) pattern, or values off by more than the bf16
    tolerances. Non-finite positions are checked first: allclose alone would pass a NaN row."""
    bad = torch.isnan(out).flatten(1).any(1) | torch.isnan(lse).any(1)
    bad |= (torch.isinf(lse) != torch.isinf(ref_lse)).any(1)
    finite = torch.isfinite(ref_lse) & torch.isfinite(lse)
    lse_off = torch.where(finite, (lse - ref_lse).abs() > LSE_TOL * (1 + ref_lse.abs()), False)
    out_off = (out - ref_out).abs() > OUT_TOL * (1 + ref_out.abs())
    return bad | lse_off.any(1) | out_off.nan_to_num(True).flatten(1).any(1)


class _Harness:
    def __init__(self, spec: DSACacheSpec, cfg: StressConfig) -> None:
        if spec.kv_dtype != "bf16":
            raise ValueError(f"spec.kv_dtype: expected 'bf16' (sparse MLA reads a bf16 cache), got {spec.kv_dtype!r}")
        self.spec, self.cfg = spec, cfg
        self.rng = random.Random(cfg.seed)
        self.gen = torch.Generator().manual_seed(cfg.seed)
        delay_rng = random.Random(cfg.seed + 1)
        self.rt = get_runtime(cfg.runtime)
        # each batch draws which streams stall (none, load, forward, both), so both orders of
        # load-vs-forward progress occur: loads lagging (read-before-ready) and forwards lagging
        # (a reused page overwritten under a running forward)
        self.limits = {"load": cfg.max_delay_s, "forward": cfg.max_forward_delay_s}
        def delay(stream: str, op: str) -> float:
            if op in ("poison", "wait_event", "record"):
                return 0.0
            scale = cfg.kv_delay_factor if op.startswith("kv[") else 1.0
            return delay_rng.uniform(0, self.limits.get(stream, 0.0) * scale)
        self.rt.delay_hook = delay
        batch_pages = cfg.max_requests * cfg.max_prefix_pages
        # page 0 is the padding page: padded page-table entries and masked top-k slots read it, so
        # they never read a page that another batch in flight is loading
        self.device = DSADevicePool(spec, batch_pages + 1, self.rt.device, padding_page=True)
        self.host = DSAHostPool(spec, batch_pages * (cfg.pipeline_depth + 2))
        self.loader = LayerwiseLoader(self.rt, self.device, self.host, cfg.unsafe_skip)
        self.fwd = self.rt.stream("forward")
        self._last_done = None  # the latest batch's forward-done event (``fence_previous_forward``)
        # hazard: the forward reads the padding page, which only the compute stream's zero fill wrote
        self.fwd.wait_event(compute_ready(self.rt))
        self.sm_scale = 1.0 / math.sqrt(spec.kv_lora_rank + spec.rope_dim)
        self.score_tol = score_tolerance(self.rt.device)
        self.report = StressReport(self.rt.kind, sorted(cfg.unsafe_skip), score_rel_tol=self.score_tol,
                                   config=asdict(cfg) | {"unsafe_skip": sorted(cfg.unsafe_skip)})

    # 1. a batch: host pages with random contents, and its reference outputs ---------------------
    def _host_pages(self, n: int) -> list[int]:
        while True:
            self.loader.reclaim()
            try:
                return self.host.allocator.alloc(n)
            except OutOfPages:
                time.sleep(0.0002)  # the oldest loads still read their host pages

    def _make_batch(self) -> tuple[_Batch, list[int], torch.Tensor]:
        cfg, g = self.cfg, self.gen
        prefix = [self.rng.randint(1, cfg.max_prefix_pages * PAGE_SIZE) for _ in range(self.rng.randint(1, cfg.max_requests))]
        n_pages = [-(-p // PAGE_SIZE) for p in prefix]
        host_pages = self._host_pages(sum(n_pages))
        table = torch.zeros(len(prefix), max(n_pages), dtype=torch.int32)
        used = 0
        for b, n in enumerate(n_pages):
            table[b, :n] = torch.tensor(host_pages[used:used + n], dtype=torch.int32)
            used += n
        slots = table.long().repeat_interleave(PAGE_SIZE, 1) * PAGE_SIZE + torch.arange(max(n_pages) * PAGE_SIZE) % PAGE_SIZE
        self._fill_host(torch.cat([slots[b, :p] for b, p in enumerate(prefix)]))
        req_idx = torch.cat([torch.full((cfg.queries_per_request,), b, dtype=torch.int32) for b in range(len(prefix))])
        positions = torch.cat([torch.randint(0, p, (cfg.queries_per_request,), generator=g) for p in prefix])
        t, width = len(positions), slots.shape[1]
        batch = _Batch(req_idx, positions,
                       torch.randn(t, cfg.index_heads, self.spec.index_head_dim, generator=g).to(torch.bfloat16),
                       torch.rand(t, cfg.index_heads, generator=g),
                       torch.randn(t, cfg.attn_heads, self.spec.kv_lora_rank + self.spec.rope_dim, generator=g).to(torch.bfloat16),
                       max(prefix), n_pages, {}, {}, width)
        self._reference(batch, table, slots.flatten())
        self.report.requests += len(prefix)
        return batch, host_pages, table

    def _fill_host(self, all_slots: torch.Tensor) -> None:
        """Random contents for every layer of the batch's host rows."""
        spec, g, n = self.spec, self.gen, len(all_slots)
        for layer in range(spec.num_layers):
            self.host.set_mla_kv_buffer(layer, all_slots, torch.randn(n, spec.kv_lora_rank, generator=g),
                                        torch.randn(n, spec.rope_dim, generator=g))
            if spec.has_indexer(layer):
                self.host.set_index_k_buffer(layer, all_slots, torch.randn(n, spec.index_head_dim, generator=g))

    def _reference(self, b: _Batch, table: torch.Tensor, slots: torch.Tensor) -> None:
        """Reference scores of every indexer layer, and a snapshot of every layer's KV rows (request
        ``r``'s position ``p`` at row ``r * width + p``), from the host copy."""
        for layer in range(self.spec.num_layers):
            if self.spec.has_indexer(layer):
                b.ref_scores[layer] = indexer_scores(b.q_index, b.weights, self.host.index[layer], table,
                                                     b.req_idx, b.positions, b.max_ctx)
            b.ref_kv[layer] = self.host.kv[layer][slots]

    # 2. load + forward on the streams ------------------------------------------------------------
    def _launch(self, batch: _Batch, host_pages: list[int], host_table: torch.Tensor) -> _Batch:
        """Queue the batch's load and forward; ``batch.fwd`` receives the forward's results."""
        dev_pages = self.device.allocator.alloc(len(host_pages))
        fences = self.device.allocator.fences(dev_pages)
        if self.cfg.fence_previous_forward and self._last_done is not None:
            fences = [*fences, self._last_done]  # whole-buffer ordering (see StressConfig)
        load = self.loader.start_loading(host_pages, dev_pages, fences, poison=POISON)
        self.host.allocator.free(host_pages)  # the load holds its own reference until it completes
        remap = dict(zip(host_pages, dev_pages))
        host_view = host_table.clone().apply_(lambda p: remap.get(p, DSADevicePool.PADDING_PAGE))
        batch.device_pages = list(dev_pages)
        batch.fwd = fwd = _Forward(max_ctx=batch.max_ctx)

        staged = self._pinned(batch.req_idx, batch.positions, batch.q_index, batch.weights, batch.q_attn, host_view)

        def stage() -> None:  # inputs reach the device on the forward stream that reads them
            # asynchronous copies from pinned memory: no host sync, so the host keeps queueing ahead and
            # the race windows under test stay open; the pinned buffers' reuse is fenced by CUDA's
            # host allocator (it records the copying stream), emulated by this closure holding them.
            # copy=True: emulated, the device is the CPU, and the forward must read device memory,
            # not the staging buffers (host memory, whose ops the sanitizer runs at submit time)
            dev = self.device.device
            (fwd.req_idx, fwd.positions, fwd.q_index, fwd.weights, fwd.q_attn,
             fwd.page_table) = (x.to(dev, non_blocking=True, copy=True) for x in staged)
        self.fwd.submit(stage, name="stage")
        self._queue_forward(fwd, load)
        done = self.rt.event()
        done.record(self.fwd)
        fwd.done = self._last_done = done
        self.device.allocator.free(dev_pages, fence=done)  # reuse waits for this batch's forward
        return batch

    def _pinned(self, *tensors: torch.Tensor) -> list[torch.Tensor]:
        """Host copies of ``tensors`` in staging memory, pinned where the runtime can pin (one choice:
        ``Runtime.pin_memory``), declared host memory for the sanitizer; written by the host before
        the stage op that reads them is submitted."""
        with sanitizer.host_work():  # host memory, made and filled by the host
            out = [torch.empty(t.shape, dtype=t.dtype, pin_memory=self.rt.pin_memory).copy_(t) for t in tensors]
        sanitizer.mark_host_memory(*out)
        return out

    def _queue_forward(self, f: _Forward, load: LayerLoad) -> None:
        spec, dev, cfg = self.spec, self.device, self.cfg
        for layer in range(spec.num_layers):
            if spec.has_indexer(layer):
                load.wait_indexer(layer, self.fwd)  # hazard: the indexer reads this layer's keys
                self.fwd.submit(lambda layer=layer: _indexer_layer(f, layer, dev.index[layer], cfg.topk),
                                name=f"indexer[{layer}]")
            load.wait_kv(layer, self.fwd)  # hazard: attention reads this layer's KV
            self.fwd.submit(lambda layer=layer: _attention_layer(f, layer, dev.kv[layer], spec.kv_lora_rank, self.sm_scale),
                            name=f"attention[{layer}]")

    # 3. checking: against the reference, whatever order the top-k broke ties in ------------------
    def _check(self, b: _Batch) -> None:
        f = b.fwd
        f.done.synchronize()
        bad_rows = torch.zeros(len(b.req_idx), dtype=torch.bool)
        owner, index = page_owners(b.device_pages, b.page_counts, self.device.num_pages)
        positions, last = None, None
        for layer in range(self.spec.num_layers):
            if f.used[layer] is not last:  # layers without an indexer reuse the last top-k
                last = f.used[layer]
                positions = slots_to_positions(last.cpu(), owner, index, b.req_idx)
            bad = self._check_attention(b, layer, positions)
            if layer in b.ref_scores:
                bad |= self._check_topk(b, layer, positions)
            self.report.corrupted_outputs += int(bad.any())
            bad_rows |= bad
        self.report.outputs_checked += self.spec.num_layers
        self.report.corrupted_requests += len(set(b.req_idx[bad_rows].tolist()))
        self.report.poisoned_reads += int(sum(int(x) for x in f.poison_flags))

    def _check_topk(self, b: _Batch, layer: int, positions: torch.Tensor) -> torch.Tensor:
        """``[T]`` bool: the layer's choice is not a valid top-k of the reference, or read NaN."""
        valid, tie = check_topk(b.ref_scores[layer], positions, self.cfg.topk, self.score_tol)
        bad = ~valid | b.fwd.nan_rows[layer].cpu()
        r = self.report
        r.topk_rows_checked += len(valid)
        r.topk_tie_rows += int(tie.sum())
        r.topk_invalid_rows += int(bad.sum())
        return bad

    def _check_attention(self, b: _Batch, layer: int, positions: torch.Tensor) -> torch.Tensor:
        """``[T]`` bool: the forward's attention differs from the reference over the same positions."""
        rows = torch.where(positions >= 0, b.req_idx.long()[:, None] * b.width + positions, -1).to(torch.int32)
        ref_out, ref_lse = sparse_mla_prefill(b.q_attn, b.ref_kv[layer], rows, self.sm_scale, self.spec.kv_lora_rank)
        out, lse = (x.cpu().float() for x in b.fwd.outputs[layer])
        return _rows_differ(out, lse, ref_out.float(), ref_lse.float()) | (positions == -2).any(1)

    def run(self, progress=None) -> StressReport:
        start = time.perf_counter()
        pending: deque[_Batch] = deque()
        try:
            while self.report.layers_loaded < self.cfg.layer_loads:
                batch, host_pages, table = self._make_batch()
                stall = self.rng.choice([(), ("load",), ("forward",), ("load", "forward")])
                self.limits = {"load": self.cfg.max_delay_s * ("load" in stall),
                               "forward": self.cfg.max_forward_delay_s * ("forward" in stall)}
                pending.append(self._launch(batch, host_pages, table))
                self.report.batches += 1
                self.report.layers_loaded += len(self.host.layers)
                if progress:
                    progress(len(self.host.layers))
                while len(pending) > self.cfg.pipeline_depth:
                    self._check(pending.popleft())
            while pending:
                self._check(pending.popleft())
            self.fwd.synchronize()
            self.rt.stream("load").synchronize()
        finally:
            self.rt.close()
        r = self.report
        r.seconds = time.perf_counter() - start
        r.corruption_rate = r.corrupted_outputs / r.outputs_checked if r.outputs_checked else 0.0
        return r


def run_stress(spec: DSACacheSpec, cfg: StressConfig, progress=None) -> StressReport:
    """Run the harness; see the module docstring. ``progress(n)`` is called with layers loaded.
    ``cfg.sanitize``: under the stream-ordering sanitizer; the report lists what it found. Under CUDA's
    sanitizer (``TORCH_CUDA_SANITIZER=1``) the report lists every hazard CSAN found (:mod:`hicache.sanitizer.csan`)."""
    if not cfg.sanitize and csan.active():
        with csan.collecting() as found:
            report = _Harness(spec, cfg).run(progress)
        report.sanitizer_hazards, report.sanitizer_hazard_list = len(found), list(found)
        return report
    if not cfg.sanitize:
        return _Harness(spec, cfg).run(progress)
    with sanitizer.sanitized() as san:
        report = _Harness(spec, cfg).run(progress)
    report.sanitizer_hazards = len(san.hazards)
    report.sanitizer_hazard_kinds = san.by_kind()
    report.sanitizer_hazard_list = [str(h) for h in san.hazards]
    return report
