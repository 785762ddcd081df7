"""Read-before-ready stress harness for the layer-wise HiCache load.

Each iteration builds a batch of requests whose prefixes live in the host pool (random contents,
random lengths), allocates device pages, and queues the load with a random delay before every
layer's copies and with the device pages poisoned (0xFF bytes: NaN in bf16, e4m3 and fp32) first.
The forward stream then runs, per layer, the real lightning indexer + top-k + sparse MLA from
``dsa_kernels``, waiting on ``indexer_ready[l]`` / ``kv_ready[l]``. Every layer's output is compared
with a reference computed on the host copy. Device pages are freed right after the forward work is
queued, fenced by an event, so the next batch's load reuses them while the forward may still run.

With all waits in place the harness must see 0 corrupted outputs. ``unsafe_skip`` drops a wait
('indexer', 'kv', both) or the reuse fence ('fence'); the harness must then detect corruption.
"""

from __future__ import annotations

import math
import random
import time
from collections import deque
from dataclasses import asdict, dataclass, field

import torch

from dsa_kernels import indexer_scores, positions_to_slots, sparse_mla_prefill, topk_indices
from dsa_kernels.layout import PAGE_SIZE
from hicache import sanitizer
from hicache.allocator import OutOfPages
from hicache.device_pool import DSADevicePool
from hicache.host_pool import DSAHostPool
from hicache.load_pipeline import LayerLoad, LayerwiseLoader
from hicache.paged_buffers import DSACacheSpec
from hicache.streams import get_runtime

POISON = 0xFF


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
    """One batch: its inputs, reference outputs and (filled by the forward stream) outputs."""

    req_idx: torch.Tensor
    positions: torch.Tensor
    q_index: torch.Tensor
    weights: torch.Tensor
    q_attn: torch.Tensor
    max_ctx: int
    reference: dict[int, tuple[torch.Tensor, torch.Tensor]]
    outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    poison_flags: list = field(default_factory=list)  # per layer, a device bool: NaN seen (no host sync)
    slots: torch.Tensor | None = None
    page_table: torch.Tensor | None = None  # device pages, set on the forward stream
    done: object = None  # event recorded after the batch's forward work


def _indexer_layer(b: _Batch, index_buf: torch.Tensor, page_table: torch.Tensor, topk: int, track_poison: bool) -> None:
    """Lightning indexer + top-k of one layer; leaves the selected cache slots in ``b.slots``."""
    scores = indexer_scores(b.q_index, b.weights, index_buf, page_table, b.req_idx, b.positions, b.max_ctx)
    if track_poison:  # stays on the device: a host sync here would hide the very race under test
        b.poison_flags.append(torch.isnan(scores).any())
    b.slots = positions_to_slots(topk_indices(scores, topk), page_table, b.req_idx)


def _attention_layer(b: _Batch, kv_buf: torch.Tensor, kv_lora_rank: int, sm_scale: float,
                     track_poison: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA over ``b.slots`` (the last indexer layer's top-k on layers without an indexer)."""
    out, lse = sparse_mla_prefill(b.q_attn, kv_buf, b.slots, sm_scale, kv_lora_rank)
    if track_poison:
        b.poison_flags.append(torch.isnan(out).any())
    return out, lse


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
        self.sm_scale = 1.0 / math.sqrt(spec.kv_lora_rank + spec.rope_dim)
        self.report = StressReport(self.rt.kind, sorted(cfg.unsafe_skip), config=asdict(cfg) | {"unsafe_skip": sorted(cfg.unsafe_skip)})

    # 1. a batch: host pages with random contents, and its reference outputs ---------------------
    def _host_pages(self, n: int) -> list[int]:
        while True:
            self.loader.reclaim()
            try:
                return self.host.allocator.alloc(n)
            except OutOfPages:
                time.sleep(0.0002)  # the oldest loads still read their host pages

    def _make_batch(self) -> tuple[_Batch, list[int], torch.Tensor]:
        cfg, spec, g = self.cfg, self.spec, self.gen
        prefix = [self.rng.randint(1, cfg.max_prefix_pages * PAGE_SIZE) for _ in range(self.rng.randint(1, cfg.max_requests))]
        n_pages = [-(-p // PAGE_SIZE) for p in prefix]
        host_pages = self._host_pages(sum(n_pages))
        table = torch.zeros(len(prefix), max(n_pages), dtype=torch.int32)
        used = 0
        for b, n in enumerate(n_pages):
            table[b, :n] = torch.tensor(host_pages[used:used + n], dtype=torch.int32)
            used += n
        slots = table.long().repeat_interleave(PAGE_SIZE, 1) * PAGE_SIZE + torch.arange(max(n_pages) * PAGE_SIZE) % PAGE_SIZE
        all_slots = torch.cat([slots[b, :p] for b, p in enumerate(prefix)])
        for layer in range(spec.num_layers):
            n = len(all_slots)
            self.host.set_mla_kv_buffer(layer, all_slots, torch.randn(n, spec.kv_lora_rank, generator=g),
                                        torch.randn(n, spec.rope_dim, generator=g))
            if spec.has_indexer(layer):
                self.host.set_index_k_buffer(layer, all_slots, torch.randn(n, spec.index_head_dim, generator=g))
        req_idx = torch.cat([torch.full((cfg.queries_per_request,), b, dtype=torch.int32) for b in range(len(prefix))])
        positions = torch.cat([torch.randint(0, p, (cfg.queries_per_request,), generator=g) for p in prefix])
        t = len(positions)
        batch = _Batch(req_idx, positions,
                       torch.randn(t, cfg.index_heads, spec.index_head_dim, generator=g).to(torch.bfloat16),
                       torch.rand(t, cfg.index_heads, generator=g),
                       torch.randn(t, cfg.attn_heads, spec.kv_lora_rank + spec.rope_dim, generator=g).to(torch.bfloat16),
                       max(prefix), {})
        for layer in range(spec.num_layers):
            if spec.has_indexer(layer):
                _indexer_layer(batch, self.host.index[layer], table, cfg.topk, track_poison=False)
            batch.reference[layer] = _attention_layer(batch, self.host.kv[layer], spec.kv_lora_rank, self.sm_scale,
                                                      track_poison=False)
        batch.slots = None
        self.report.requests += len(prefix)
        return batch, host_pages, table

    # 2. load + forward on the streams ------------------------------------------------------------
    def _launch(self, batch: _Batch, host_pages: list[int], host_table: torch.Tensor) -> _Batch:
        dev_pages = self.device.allocator.alloc(len(host_pages))
        fences = self.device.allocator.fences(dev_pages)
        load = self.loader.start_loading(host_pages, dev_pages, fences, poison=POISON)
        self.host.allocator.free(host_pages)  # the load holds its own reference until it completes
        remap = dict(zip(host_pages, dev_pages))
        host_view = host_table.clone().apply_(lambda p: remap.get(p, DSADevicePool.PADDING_PAGE))
        moved = _Batch(batch.req_idx, batch.positions, batch.q_index, batch.weights, batch.q_attn, batch.max_ctx,
                       batch.reference)

        staged = self._pinned(batch.req_idx, batch.positions, batch.q_index, batch.weights, batch.q_attn, host_view)

        def stage() -> None:  # inputs reach the device on the forward stream that reads them
            # asynchronous copies from pinned memory: no host sync, so the host keeps queueing ahead and
            # the race windows under test stay open; the pinned buffers' reuse is fenced by CUDA's
            # host allocator (it records the copying stream), emulated by this closure holding them.
            # copy=True: emulated, the device is the CPU, and the forward must read device memory,
            # not the staging buffers (host memory, whose ops the sanitizer runs at submit time)
            dev = self.device.device
            (moved.req_idx, moved.positions, moved.q_index, moved.weights, moved.q_attn,
             moved.page_table) = (x.to(dev, non_blocking=True, copy=True) for x in staged)
        self.fwd.submit(stage, name="stage")
        self._queue_forward(moved, load)
        done = self.rt.event()
        done.record(self.fwd)
        moved.done = done
        self.device.allocator.free(dev_pages, fence=done)  # reuse waits for this batch's forward
        return moved

    def _pinned(self, *tensors: torch.Tensor) -> list[torch.Tensor]:
        """Host copies of ``tensors`` in staging memory, pinned where the runtime can pin (one choice:
        ``Runtime.pin_memory``), declared host memory for the sanitizer; written by the host before
        the stage op that reads them is submitted."""
        out = [torch.empty(t.shape, dtype=t.dtype, pin_memory=self.rt.pin_memory).copy_(t) for t in tensors]
        sanitizer.mark_host_memory(*out)
        return out

    def _queue_forward(self, b: _Batch, load: LayerLoad) -> None:
        spec, dev, cfg = self.spec, self.device, self.cfg
        for layer in range(spec.num_layers):
            if spec.has_indexer(layer):
                load.wait_indexer(layer, self.fwd)  # hazard: the indexer reads this layer's keys

                def indexer(layer: int = layer) -> None:
                    _indexer_layer(b, dev.index[layer], b.page_table, cfg.topk, track_poison=True)
                self.fwd.submit(indexer, name=f"indexer[{layer}]")
            load.wait_kv(layer, self.fwd)  # hazard: attention reads this layer's KV

            def attention(layer: int = layer) -> None:
                b.outputs[layer] = _attention_layer(b, dev.kv[layer], spec.kv_lora_rank, self.sm_scale, track_poison=True)
            self.fwd.submit(attention, name=f"attention[{layer}]")

    # 3. checking ---------------------------------------------------------------------------------
    def _check(self, b: _Batch) -> None:
        b.done.synchronize()
        bad_layers, bad_reqs = 0, set()
        for layer, (ref_out, ref_lse) in b.reference.items():
            out, lse = (x.cpu() for x in b.outputs[layer])
            ok_out = torch.allclose(out.float(), ref_out.float(), rtol=1e-2, atol=1e-2, equal_nan=False)
            same_inf = torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
            finite = torch.isfinite(ref_lse)
            ok_lse = same_inf and torch.allclose(lse[finite], ref_lse[finite], rtol=1e-4, atol=1e-4)
            if not (ok_out and ok_lse):
                bad_layers += 1
                rows = ((out.float() - ref_out.float()).abs().amax(dim=(1, 2)) > 1e-2) | torch.isnan(out).any(2).any(1)
                bad_reqs |= set(b.req_idx.cpu()[rows].tolist())
        self.report.outputs_checked += len(b.reference)
        self.report.corrupted_outputs += bad_layers
        self.report.corrupted_requests += len(bad_reqs)
        self.report.poisoned_reads += int(sum(int(f) for f in b.poison_flags))

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
    ``cfg.sanitize``: under the stream-ordering sanitizer; the report lists what it found."""
    if not cfg.sanitize:
        return _Harness(spec, cfg).run(progress)
    with sanitizer.sanitized() as san:
        report = _Harness(spec, cfg).run(progress)
    report.sanitizer_hazards = len(san.hazards)
    report.sanitizer_hazard_kinds = san.by_kind()
    report.sanitizer_hazard_list = [str(h) for h in san.hazards]
    return report
