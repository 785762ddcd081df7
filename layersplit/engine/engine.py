"""One CP rank's prefill of a batch whose cached prefixes are already in the pools.

Per layer ``l`` (``layersplit`` mode; ``redundant`` skips every broadcast and scratch step):

1. project the rank's new tokens; pack their cache rows as the caches store them (MLA row in
   ``kv_dtype``, e4m3 index key) and all-gather every rank's as bytes (:mod:`layersplit.engine.new_rows`);
2. owner of ``l``: copies the new rows into its pool and reads the pool. Non-owner: waits for the
   all-gather and the **indexer-key broadcast** of ``l`` (issued one layer earlier), copies the new
   index keys into the scratch slot and runs the indexer + top-k; only then waits for the **KV
   broadcast** of ``l``, copies the new KV rows in and runs sparse attention;
3. output projection; then **layer l+1's broadcasts are issued before layer l's MLP**;
4. MLP.

**The overlap, and why it really happens** (``schedule="overlapped"``, the default). The KV broadcast
runs on its own stream with its own communicator (:mod:`layersplit.engine.comm`, channel ``kv``); the
all-gather and the index-key broadcast on the other (``main``). So ``bcast_kv[l]``, issued before
MLP(l-1), travels under MLP(l-1), layer l's projections, its all-gather, index-key write and indexer:
only the small index-key broadcast and the new rows' all-gather are on the indexer's critical path.
On one FIFO stream (``schedule="legacy"``) layer l's all-gather would queue behind ``bcast_kv[l]`` and the
indexer, which waits for the all-gather, would wait for the KV too — whatever the issue order says.
``RankResult.kv_order`` proves it from the happens-before order of the rank's issued program
(:mod:`hicache.runtime.happens_before`): per non-owned layer, the indexer does not happen after the KV
broadcast's completion and attention does. (Within one rank: edges through another rank's progress,
a collective waiting for a peer that waits for its own broadcasts, are not in it; the KV broadcast
of layer l is ordered, through them, only after layers l-2 and earlier.) A second stream and communicator, rather than a
finer-grained split on one, because a communicator runs its collectives in issue order (NCCL on its
own internal stream, gloo per group): separating the streams without separating the communicators
would serialize them again. Both communicators see their collectives in the same order on every rank.

**fp8 KV** (``kv_dtype="fp8"``): every MLA cache row is the uint8 row of :mod:`dsa_kernels.layout` (e4m3
latent, fp32 tile scales, bf16 rope: 656 B for GLM-5 against 1152 B in bf16) in the pools, the scratch
slots, the host tier, the KV broadcast (page views as bytes, for either dtype) and the new rows'
all-gather: a token's own rank packs its row (``pack_mla_kv``, step 1) and every rank copies those
bytes in (step 2). What holds, and where:

* **within one CP run, every rank stores the same bytes for a new row**: the bytes its own rank
  packed, moved and copied (data movement; on every device);
* **against the single-process reference** (which packs all new rows in one call), a row's bytes are
  a deterministic function of its bf16 latent and rope on one backend (one scale per 128-element tile
  of that row; IEEE divisions in the Triton kernel), so the two store the same bytes *where they
  project the token to the same bf16 row*. On a CPU the projections give a row the same fp32 values
  whatever else is in the batch (to the last bits of a thread split), and the CP tests hold the output
  to 1e-4 of its scale. On a GPU they need not: a rank multiplies only its own rows, the GEMM kernel
  depends on the row count, a row's last bits can change, and one flipped bf16 or e4m3 rounding (or
  top-k choice) follows. So no check compares a GPU run's cache bytes with the reference's; the GPU
  check holds the CP output within ``FLOOR_FACTOR`` x the row-split floor of the reference of the same
  ``kv_dtype``, measured on that device (:mod:`layersplit.gpu_check.agreement`).

Sparse attention dequantizes the rows it reads. The index keys travel quantized for both dtypes (exact
ue8m0 scales: the same bytes as quantizing where they land, see :mod:`layersplit.engine.new_rows`).

Layers without an indexer reuse the last top-k (positions, mapped through this layer's table).
The owner gathers only the batch's prefix pages (``plan.bcast_pages``) and, when its prefix rows of
``l`` are still loading from its host tier, waits for that layer's load events first.

Stream edges (the compute stream is ``rt.compute_stream()``; every one is removable for the
sanitizer's teeth tests through ``FaultInjection.unsafe_skip_edges``):

* every collective waits for the compute work queued before its issue (:mod:`layersplit.engine.comm`), and
  its buffers are ``record_stream``-ed on its stream;
* a scratch slot is refilled only after the compute stream recorded its *released* event, after the
  last read of the layer it held (the issue-time wait also orders it);
* the host-tier reload waits for the poison fill recorded on the compute stream;
* the new rows' send buffer is packed on compute before the all-gather's issue (the issue-time wait
  orders the comm stream's read after it); the rows are copied out of the all-gather's receive buffer
  only after compute waited for its event (``allgather_new[l]``);
* the owner's new rows of ``l`` land after its sends of ``l`` read them: the index-key send precedes
  ``l``'s all-gather on the main channel, which compute waits for first; the KV send runs on the
  other stream, so compute waits for its ``source_read`` event (``kv_send_packed[l]``: the send buffer
  was packed) before copying the new KV rows in.

Kernels get contiguous operands (the new rows are packed from contiguous bf16 copies into contiguous
views of the send buffer); the dispatch layer checks that contract on every backend, so a CPU run on
the torch reference refuses what Triton would.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from dsa_kernels import gather_pages, indexer_topk, positions_to_slots, query_block_extents, sparse_mla_prefill
from dsa_kernels.layout import PAGE_SIZE
from hicache.host_pool import DSAHostPool
from hicache.load_pipeline import LayerwiseLoader
from hicache import sanitizer
from hicache.runtime.happens_before import HBRuntime
from hicache.runtime.streams import Event, Runtime
from layersplit.engine.batch_plan import BatchPlan, Request, plan_batch
from layersplit.engine.comm import CPComm, Sent
from layersplit.plan.config import ModelConfig
from layersplit.plan.capacity import scratch_pages_for
from layersplit.engine.cp_pool import CPPool, ReadBuffers, cache_spec
from layersplit.engine.model import Projections, TinyDSA
from layersplit.engine.new_rows import NewRows
from layersplit.plan.ownership import plan_ownership
from layersplit.engine.trace import Tracer

POISON = 0xFF
# stream edges the teeth tests remove: the comm stream's wait for compute at issue, record_stream of
# collective buffers, the scratch slot's release event (the issue-time wait also covers it: the
# teeth test removes both), and the load stream's wait for the poison fill
UNSAFE_EDGES = ("compute_wait", "record_stream", "slot_release", "poison_fence", "allgather_wait")
# ``overlapped``: the KV broadcast on its own stream and communicator (only sparse attention waits for
# it); ``legacy``: every collective on one FIFO stream, where the all-gather the indexer waits for
# queues behind the KV broadcast (kept to show the difference: the overlap test's teeth, the benchmark)
from layersplit.plan.choices import ENGINE_KV_DTYPES, SCHEDULES  # noqa: E402 - re-exported


@dataclass(frozen=True)
class FaultInjection:
    """Test and benchmark knobs, never set when serving: stalls that open race windows or size the
    overlap, and UNSAFE switches that drop a safeguard (the teeth tests: each must then be detected)."""

    hicache_delay_s: float = 0.0  # > 0: prefix rows reload from the host tier with random stalls
    bcast_kv_delay_s: float = 0.0  # > 0: every KV broadcast stalls this long first (the overlap benchmark)
    unsafe_skip_coherence: bool = False  # UNSAFE: broadcast without waiting for the HiCache load
    unsafe_skip_edges: frozenset[str] = frozenset()  # UNSAFE: drop stream edges by name (see UNSAFE_EDGES)

    def __post_init__(self) -> None:
        bad = set(self.unsafe_skip_edges) - set(UNSAFE_EDGES)
        if bad:
            raise ValueError(f"unsafe_skip_edges: expected a subset of {UNSAFE_EDGES}, got {sorted(bad)}")


@dataclass(frozen=True)
class EngineConfig:
    mode: str = "layersplit"
    schedule: str = "overlapped"  # see SCHEDULES
    cp: int = 1
    ownership: str = "contiguous"
    split: str = "zigzag"
    pool_pages: int = 256  # pool capacity (pages of 64 tokens per held layer)
    max_batch_tokens: int = 16384  # sizes each scratch slot
    max_requests: int = 8
    kv_dtype: str = "bf16"  # the MLA cache rows: bf16, or fp8 (uint8 rows, see the module docstring)
    weight_seed: int = 0
    prefix_seed: int = 1
    trace: bool = True
    faults: FaultInjection = FaultInjection()  # tests and benchmarks only

    def __post_init__(self) -> None:
        # checked where the config is made (the parent), before any rank process starts
        if self.kv_dtype not in ENGINE_KV_DTYPES:
            raise ValueError(f"kv_dtype: expected one of {ENGINE_KV_DTYPES}, got {self.kv_dtype!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule: expected one of {SCHEDULES}, got {self.schedule!r}")
        if not isinstance(self.faults, FaultInjection):
            raise TypeError(f"faults: expected a FaultInjection, got {type(self.faults).__name__}")


@dataclass
class RankResult:
    rank: int
    hidden: torch.Tensor  # [n_local, hidden] (on the engine's device; ``host()`` copies it back)
    local: torch.Tensor  # global new-token indices of ``hidden``'s rows
    seconds: float
    kv_bytes: dict[str, int]
    bcast_bytes: dict[int, int] = field(default_factory=dict)  # layer -> bytes this rank sent or received
    bcast_kv_bytes: dict[int, int] = field(default_factory=dict)  # layer -> the KV part of them (rows in kv_dtype)
    # layer -> bytes of the new rows' all-gather this rank received from the other ranks ((cp - 1) x the padded
    # send buffer of :mod:`layersplit.engine.new_rows`; empty at cp 1), and the KV part of them (rows in kv_dtype)
    allgather_bytes: dict[int, int] = field(default_factory=dict)
    allgather_kv_bytes: dict[int, int] = field(default_factory=dict)
    trace: list[dict] = field(default_factory=list)
    reload_bytes: int = 0  # host-tier bytes this rank copied to its device pool (measured)
    bcast_wait_s: float = 0.0  # compute time spent waiting for broadcasts (exposed communication)
    comm_wait_s: float = 0.0  # ... for any collective: broadcasts, the all-gathers, the owner's send packing
    hazards: list[str] | None = None  # stream-ordering hazards (None: not sanitized)
    hazard_kinds: dict[str, int] = field(default_factory=dict)
    # non-owned layer -> {"indexer": .., "attention": ..}: whether that op happens after the layer's KV
    # broadcast completed, in the issued program's happens-before order (same on every run and device)
    kv_order: dict[int, dict[str, bool]] = field(default_factory=dict)
    # ``reload_bytes`` per layer, in layer order: how much this rank's one PCIe link must move before each
    # layer's turn is the running sum (contiguous ownership front-loads it; round-robin spreads it)
    reload_bytes_by_layer: dict[int, int] = field(default_factory=dict)

    def host(self) -> "RankResult":
        """This result with its tensors copied to the host (after the forward, outside it)."""
        self.hidden, self.local = self.hidden.cpu(), self.local.cpu()
        return self


@dataclass
class RankTokens:
    """This rank's new tokens on their way through the layers: hidden states, each token's position
    and request (per-token device tensors, from the batch plan), and the last indexer layer's top-k
    positions, which the layers without an indexer reuse."""

    h: torch.Tensor  # [n_local, hidden]
    pos: torch.Tensor  # [n_local]
    req: torch.Tensor  # [n_local] request index into the batch plan
    top: torch.Tensor | None = None  # [n_local, topk] context positions, -1 padded


class HostReload(NamedTuple):
    """The host-tier reload of this rank's prefix pages: the loader (its host pool holds the rows),
    the pages, and the events the copies follow (the pages' poison fill)."""

    loader: LayerwiseLoader
    pages: list[int]
    fences: list[Event]


def prefix_rows(spec, request_id: int, layer: int, n: int, seed: int) -> tuple[torch.Tensor, ...]:
    """Deterministic cached-prefix contents of one request and layer: (kv_c, k_pe, index_k)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + request_id * 1009 + layer)
    return (torch.randn(n, spec.kv_lora_rank, generator=g), torch.randn(n, spec.rope_dim, generator=g),
            torch.randn(n, spec.index_head_dim, generator=g))


def fill_prefix(buffers, layers, plan: BatchPlan, seed: int, only: list[int] | None = None) -> None:
    """Write the cached prefix rows of ``layers`` of the requests ``only`` (default all) into
    ``buffers`` at their pool page ids."""
    for b, req in enumerate(plan.requests):
        if req.prefix_len == 0 or (only is not None and b not in only):
            continue
        pos = torch.arange(req.prefix_len, device=plan.pool_table.device)
        slots = (plan.pool_table[b, pos // PAGE_SIZE].long() * PAGE_SIZE + pos % PAGE_SIZE).to(buffers.device)
        for layer in layers:
            kv_c, k_pe, index_k = (x.to(buffers.device) for x in prefix_rows(buffers.spec, b, layer, req.prefix_len, seed))
            buffers.set_mla_kv_buffer(layer, slots, kv_c, k_pe)
            if buffers.spec.has_indexer(layer):
                buffers.set_index_k_buffer(layer, slots, index_k)


class RankEngine:
    def __init__(self, model_cfg: ModelConfig, cfg: EngineConfig, rank: int, runtime: Runtime, transport=None) -> None:
        """``transport``: the collectives' (:mod:`layersplit.engine.comm`); None: ``torch.distributed``."""
        # every stream op, record and wait also feeds the happens-before order (``RankResult.kv_order``)
        self.cfg, self.rank, self.rt = cfg, rank, HBRuntime(runtime)
        self.model = TinyDSA(model_cfg, cfg.weight_seed, runtime.device)
        self.spec = cache_spec(model_cfg, cfg.kv_dtype)
        self.topk = model_cfg.index_topk
        self.own = plan_ownership(model_cfg.num_layers, cfg.cp, cfg.ownership)
        self.pool = CPPool(cfg.mode, self.spec, cfg.pool_pages, rank, self.own,
                           scratch_pages_for(cfg.max_batch_tokens, cfg.max_requests), runtime.device)
        self.faults = cfg.faults
        self.unsafe = frozenset(cfg.faults.unsafe_skip_edges)
        self.tracer = Tracer(rank, cfg.trace, self.rt)
        self.comm = CPComm(self.rt, rank, cfg.cp, self.tracer, self.unsafe & {"compute_wait", "record_stream"},
                           channels=2 if cfg.schedule == "overlapped" else 1, transport=transport)
        self.compute = self.rt.compute_stream()
        self._released = {}  # scratch slot -> event recorded on compute after the slot's last read
        self._waits: list[tuple[str, Event, Event]] = []  # (name, start, end) timing events on compute

    # waits: the compute stream waits, the host does not (emulated: the host thread is that stream) --
    def _wait(self, name: str, event: Event | None, layer: int) -> None:
        """The compute stream waits for ``event``; timed with events on the compute stream (CUDA:
        GPU time the stream stood still; emulated: the host thread's blocking time)."""
        if event is None:
            return
        start, end = self.rt.event(enable_timing=True), self.rt.event(enable_timing=True)
        with self.tracer.span(f"wait {name}", stream=self.compute, layer=layer):
            start.record(self.compute)
            self.compute.wait_event(event)
            end.record(self.compute)
        self._waits.append((name, start, end))

    def _annotate_waits(self) -> None:
        """Trace wait spans are host time (about 0 on CUDA, where the host only queues the wait): each
        gets the compute stream's own stall, measured with its timing events."""
        stalls = {f"wait {name}": s.elapsed_time(e) for name, s, e in self._waits}
        for event in self.tracer.events:
            if event["name"] in stalls:
                event["args"]["stream_stall_ms"] = stalls[event["name"]]

    # HiCache: prefix rows reload from this rank's (layer-split) host tier ---------------------------
    def _host_requests(self, plan: BatchPlan) -> list[int]:
        everything = self.faults.hicache_delay_s > 0  # the coherence test reloads every prefix
        return [b for b, r in enumerate(plan.requests) if r.prefix_len and (r.from_host or everything)]

    def _prepare_host(self, plan: BatchPlan, host_reqs: list[int]) -> HostReload:
        """The reload of this rank's layers of the host-tier prefixes, its device pages poisoned."""
        host = DSAHostPool(self.spec, self.cfg.pool_pages, layers=self.pool.pool.layers)
        host.allocator.alloc(self.cfg.pool_pages)  # page ids mirror the device pool's
        with sanitizer.host_work():  # the host tier is written by the host
            fill_prefix(host, host.layers, plan, self.cfg.prefix_seed, only=host_reqs)
        # made before the poison fill: its load stream waits for the compute work so far (the pools'
        # zero fill), so the poison below is ordered by its own fence only (the poison_fence teeth)
        loader = LayerwiseLoader(self.rt, self.pool.pool, host)
        pages = sorted({p for b in host_reqs for p in plan.pool_pages[b][: -(-plan.requests[b].prefix_len // PAGE_SIZE)]})
        page_ids = torch.tensor(pages, dtype=torch.int64, pin_memory=self.rt.pin_memory)  # host: no sync to build
        self.pool.pool.fill_pages(page_ids.to(self.rt.device, non_blocking=True), POISON)
        poisoned = self.rt.event()  # hazard: the load stream overwrites these pages after the poison
        poisoned.record(self.compute)
        return HostReload(loader, pages, [] if "poison_fence" in self.unsafe else [poisoned])

    def _install_delays(self) -> None:
        """The runtime's delay hook: random stalls before host-tier copies (``hicache_delay_s``, the
        coherence test) and a fixed stall before every KV broadcast (``bcast_kv_delay_s``)."""
        lim, kv_delay = self.faults.hicache_delay_s, self.faults.bcast_kv_delay_s
        rng = torch.Generator().manual_seed(self.cfg.prefix_seed + self.rank)

        def hook(stream: str, op: str) -> float:
            if lim > 0 and stream == "load" and op[0] in "ik":
                return float(torch.rand(1, generator=rng)) * lim
            return kv_delay if op.startswith("bcast_kv[") else 0.0
        self.rt.delay_hook = hook if lim > 0 or kv_delay > 0 else None

    # broadcasts --------------------------------------------------------------------------------------
    def _issue_bcast(self, layer: int, plan: BatchPlan, load) -> dict[str, Sent]:
        if self.cfg.mode != "layersplit" or plan.n_bcast == 0 or self.cfg.cp == 1:
            return {}
        owner = self.own.owner[layer]
        events = {}
        for part in ("index", "kv") if self.spec.has_indexer(layer) else ("kv",):
            src_pages = (self.pool.pool.index.get(layer) if part == "index" else
                         self.pool.pool.kv_pages(layer) if self.pool.holds(layer) else None)
            recv = None if owner == self.rank else self.pool.slot_pages(layer, part)[: plan.n_bcast]
            after = []
            released = self._released.pop((self.pool.slot_of.get(layer), part), None)
            if released is not None and "slot_release" not in self.unsafe:
                after.append(released)  # hazard: the slot's previous layer may still be read
            if load is not None and owner == self.rank and not self.faults.unsafe_skip_coherence:
                # hazard: never broadcast rows still loading from host
                after = [(load.indexer_ready if part == "index" else load.kv_ready)[layer]]
            # the index keys travel with the all-gather (the indexer waits for both); the KV on its own
            # channel, so that only sparse attention waits for it (see the module docstring)
            events[part] = self.comm.broadcast(
                f"bcast_{part}[{layer}]", owner, lambda s=src_pages: gather_pages(s, plan.bcast_pages), recv,
                after, channel="kv" if part == "kv" else "main", layer=layer)
            self._count_bcast(layer, part, plan.n_bcast * (src_pages if recv is None else recv).shape[1])
        return events

    def _count_bcast(self, layer: int, part: str, nbytes: int) -> None:
        """Bytes a broadcast moves (pages x the page width of the buffer it sends or receives)."""
        self._bcast_bytes[layer] = self._bcast_bytes.get(layer, 0) + nbytes
        if part == "kv":
            self._bcast_kv_bytes[layer] = nbytes

    # one layer -----------------------------------------------------------------------------------
    def _gather_new_rows(self, layer: int, p: Projections) -> tuple[Event, torch.Tensor]:
        """Pack this rank's new rows as the caches store them and all-gather the bytes; returns the
        all-gather's event and the ``[cp, nbytes]`` buffer it fills (:mod:`layersplit.engine.new_rows`)."""
        local = self._new_rows.pack(layer, p.kv_c, p.k_pe, p.index_k)  # hazard: read by comm after the issue-time wait
        gathered = self._new_rows.receive_buffer(layer, local.device)
        if self.cfg.cp > 1:
            layout = self._new_rows.layout(layer)
            self._allgather_bytes[layer] = (self.cfg.cp - 1) * layout.nbytes  # received from the other ranks
            self._allgather_kv_bytes[layer] = (self.cfg.cp - 1) * layout.kv_bytes
        return self.comm.all_gather(f"allgather_new[{layer}]", local, list(gathered.unbind(0)), layer=layer), gathered

    def _layer(self, layer: int, x: RankTokens, plan: BatchPlan, bcast: dict[str, Sent], load) -> torch.Tensor:
        """Steps 1-3 of the module docstring for layer ``layer`` (the caller issues layer l+1's
        broadcasts, then runs step 4, the MLP). Each wait is named after the edge it is."""
        owner_here = self.pool.holds(layer)
        loading = owner_here and load is not None  # this rank's prefix rows of the layer come from host
        # 1. project this rank's new tokens; pack their rows as stored and all-gather every rank's
        p = self.model.project(layer, x.h, x.pos)
        done, gathered = self._gather_new_rows(layer, p)
        rb: ReadBuffers = self.pool.read_buffers(layer, plan)
        if "allgather_wait" not in self.unsafe:  # hazard: the landings below read what the all-gather writes
            self._wait(f"allgather_new[{layer}]", done, layer)
        # 2a. the indexer: its keys landed (host reload or the owner's broadcast), the new keys, top-k
        if self.spec.has_indexer(layer):
            self._wait_index_keys(layer, owner_here, loading, bcast, load)
            self._new_rows.land_index(layer, gathered, rb.index, rb.new_slots)
            x.top = self._indexer(layer, p, rb, x, plan)
        # 2b. sparse attention: its KV landed (host reload, broadcast, or the owner's send packed), the new rows
        self._wait_kv(layer, owner_here, loading, bcast, load)
        self._new_rows.land_kv(layer, gathered, rb.kv, rb.new_slots)
        out_lat = self._attention(layer, p, rb, x)
        self._release_slot(layer, owner_here, bcast)
        # 3. output projection
        return self.model.attention_out(layer, x.h, out_lat)

    def _wait_index_keys(self, layer: int, owner_here: bool, loading: bool, bcast: dict[str, Sent], load) -> None:
        if loading:  # the load writes whole pages: the new keys go in after it, the indexer reads both
            self._wait(f"hicache_index[{layer}]", load.indexer_ready[layer], layer)
        elif not owner_here and "index" in bcast:
            # (the owner's new keys land in a page its index broadcast also sends: that send precedes
            # this layer's all-gather on the main channel, which compute waited for in step 1)
            self._wait(f"bcast_index[{layer}]", bcast["index"].done, layer)

    def _wait_kv(self, layer: int, owner_here: bool, loading: bool, bcast: dict[str, Sent], load) -> None:
        if loading:  # KV kept landing under the indexer
            self._wait(f"hicache_kv[{layer}]", load.kv_ready[layer], layer)
        if not owner_here and "kv" in bcast:
            self._wait(f"bcast_kv[{layer}]", bcast["kv"].done, layer)
        elif "kv" in bcast:  # hazard: the new rows go into the last prefix page, which this rank's KV
            # broadcast sends from its own stream: write only after the send buffer was packed
            self._wait(f"kv_send_packed[{layer}]", bcast["kv"].source_read, layer)

    def _indexer(self, layer: int, p: Projections, rb: ReadBuffers, x: RankTokens, plan: BatchPlan) -> torch.Tensor:
        self.rt.mark(f"indexer[{layer}]", self.compute)
        with self.tracer.span(f"indexer[{layer}]", stream=self.compute, layer=layer):
            # chunked: peak memory bounded by a block of context, not by new tokens x context
            return indexer_topk(p.q_index, p.index_weights, rb.index, rb.table, x.req, x.pos, plan.max_ctx,
                                self.topk, block_extents=self._extents)

    def _attention(self, layer: int, p: Projections, rb: ReadBuffers, x: RankTokens) -> torch.Tensor:
        self.rt.mark(f"attention[{layer}]", self.compute)
        with self.tracer.span(f"attention[{layer}]", stream=self.compute, layer=layer):
            slots = positions_to_slots(x.top, rb.table, x.req)
            return sparse_mla_prefill(p.q_attn, rb.kv, slots, self.model.sm_scale, self.spec.kv_lora_rank)[0]

    def _release_slot(self, layer: int, owner_here: bool, bcast: dict[str, Sent]) -> None:
        """The slot's last reader is queued: a later layer may refill it after this event."""
        if owner_here or not self.pool.scratch:
            return
        for part in bcast:
            released = self.rt.event()
            released.record(self.compute)
            self._released[(self.pool.slot_of[layer], part)] = released

    def prefill(self, requests: list[Request]) -> RankResult:
        """Prefill ``requests`` (prefixes cached) and return this rank's new-token hidden states."""
        plan = plan_batch(requests, self.pool.pool.allocator.alloc, self.cfg.cp, self.cfg.split)
        self.pool.check_fits(plan)
        # the indexer's per-block context extents, from the host plan (no device read per layer)
        self._extents = query_block_extents(plan.new_pos[plan.local[self.rank]], plan.max_ctx)
        with self.compute.active():  # the host's tensor work below is the compute stream's
            return self._prefill(requests, plan.to(self.rt.device, pin_memory=self.rt.pin_memory))

    def _prefill(self, requests: list[Request], plan: BatchPlan) -> RankResult:
        self._bcast_bytes: dict[int, int] = {}
        self._bcast_kv_bytes: dict[int, int] = {}
        self._allgather_bytes: dict[int, int] = {}
        self._allgather_kv_bytes: dict[int, int] = {}
        self._new_rows = NewRows(self.spec, plan.local, self.rank, self.rt.device)  # once per batch
        self._waits, self._released = [], {}
        self._install_delays()
        self.tracer.start(self.compute)
        host_reqs = self._host_requests(plan)
        device_reqs = [b for b in range(len(requests)) if b not in host_reqs]
        fill_prefix(self.pool.pool, self.pool.pool.layers, plan, self.cfg.prefix_seed, only=device_reqs)
        host = self._prepare_host(plan, host_reqs) if host_reqs else None
        loc = plan.local[self.rank]
        start, end = self.rt.event(enable_timing=True), self.rt.event(enable_timing=True)
        start.record(self.compute)  # timed from here on the compute stream: host-tier reloads included
        load = host.loader.start_loading(host.pages, host.pages, host.fences) if host else None
        x = RankTokens(self.model.embed_tokens(plan.new_tokens[loc]), plan.new_pos[loc], plan.new_req[loc])
        bcast = self._issue_bcast(0, plan, load)
        for layer in range(self.spec.num_layers):
            x.h = self._layer(layer, x, plan, bcast, load)  # steps 1-3
            if layer + 1 < self.spec.num_layers:
                bcast = self._issue_bcast(layer + 1, plan, load)  # prefetch before this layer's MLP
            with self.tracer.span(f"mlp[{layer}]", stream=self.compute, layer=layer):
                x.h = self.model.mlp(layer, x.h)  # 4.
        h = self.model.final_norm(x.h)
        end.record(self.compute)
        self.comm.synchronize()
        if load is not None:
            load.kv_ready[self.pool.pool.layers[-1]].synchronize()
        end.synchronize()
        seconds = start.elapsed_time(end) / 1e3
        self.tracer.resolve()
        self._annotate_waits()
        for b in range(len(requests)):
            self.pool.pool.allocator.free(plan.pool_pages[b])
        waits = sum(s.elapsed_time(e) for name, s, e in self._waits if name.startswith("bcast")) / 1e3
        comm_waits = sum(s.elapsed_time(e) for name, s, e in self._waits if not name.startswith("hicache")) / 1e3
        # device tensors: the caller copies them to the host after the forward (the launcher does)
        return RankResult(rank=self.rank, hidden=h, local=loc, seconds=seconds, kv_bytes=self.pool.kv_bytes(),
                          bcast_bytes=dict(self._bcast_bytes), bcast_kv_bytes=dict(self._bcast_kv_bytes),
                          allgather_bytes=dict(self._allgather_bytes),
                          allgather_kv_bytes=dict(self._allgather_kv_bytes),
                          trace=list(self.tracer.events),
                          reload_bytes=load.bytes_copied if load else 0, bcast_wait_s=waits, comm_wait_s=comm_waits,
                          kv_order=self._kv_order(), reload_bytes_by_layer=dict(load.bytes_by_layer) if load else {})

    def _kv_order(self) -> dict[int, dict[str, bool]]:
        """Per non-owned layer: does its indexer / sparse attention happen after its KV broadcast
        completed? (The overlap: indexer False, attention True.)"""
        out = {}
        for layer in range(self.spec.num_layers):
            done = f"complete bcast_kv[{layer}]"
            if self.pool.holds(layer) or done not in self.rt.hb.marks:
                continue
            ops = ("indexer", "attention") if self.spec.has_indexer(layer) else ("attention",)
            out[layer] = {op: self.rt.ordered(done, f"{op}[{layer}]") for op in ops}
        return out
