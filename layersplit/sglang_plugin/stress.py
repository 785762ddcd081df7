"""Stress tests of the plug-in inside SGLang's own code, on CPU with real asynchrony.

SGLang's stream code records and waits on events of a module-level ``device_module``; here it is
:class:`hicache.runtime.device_module.EmulatedDeviceModule` (one worker thread per stream), so the load or
broadcast stream really runs beside the forward stream. Two harnesses, each with a documented unsafe
switch that must make its detector fire:

**hicache** (:func:`run`): SGLang's ``L2TransferEngine`` / ``LayerDoneCounter`` with our subclasses.

1. the device pool's indexer pages and KV rows of the batch are poisoned; the host pools hold fresh,
   iteration-specific data (the real ``DSAIndexerPoolHost`` for the indexer keys, a host KV pool for
   the latent rows);
2. our ``IndexFirstL2TransferEngine.submit_host_to_device`` queues the per-layer loads (indexer keys,
   indexer-ready event, KV rows, layer event) on the load stream, with random stalls;
3. the forward stream, layer by layer, gets the indexer keys through ``IndexKeyCache.get_local_buffer``
   with the plug-in's AROUND hook (``wait_index_until(l)``) and reads them, then waits
   ``wait_until(l)`` and reads the KV rows, as the model's indexer and attention would.

A read that sees poison or another iteration's data is a read-before-ready. ``early_index_reads``
counts indexer reads that ran before the same layer's KV rows had landed: the overlap the split events
buy (upstream's single event makes it 0). Unsafe: ``index_wait``. sgl-kernel's ``transfer_kv_direct``
(a CUDA op) is replaced by its torch equivalent while this runs.

**pool** (:func:`run_pool`): two CP rank processes (gloo) run the plug-in pool in the model's order
for several batches; the staged KV and prefix indexer-key broadcasts run on an emulated broadcast
stream over a dedicated gloo group (upstream uses a dedicated NCCL communicator), while each owner's
prefix pages are poisoned and reloaded from host memory on an emulated load stream (our split
counter's events), both with random stalls; every layer each rank reads is compared with a
single-process upstream ``DSATokenToKVPool`` given the same writes. Unsafe: ``slot_wait`` (a staging
slot is used without waiting for its broadcast), ``load_wait`` (a layer is broadcast without waiting
for its HiCache load).

Command line: ``layersplit stress sglang-hicache`` and ``layersplit stress sglang-pool``.
"""

from __future__ import annotations

import contextlib
import os
import random
import threading
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from hicache import sanitizer

POISON = 0xA5
# a small GLM-5-geometry pool: 5 layers, 512 tokens of 64-token pages (latent 512 + rope 64 in bf16,
# indexer keys 128 fp8 + 1 fp32 scale per token)
LAYERS, SIZE, PAGE = 5, 512, 64
PREFIX_PAGES, NEW_PAGES = [1, 2, 5], [5, 6]  # the batch: a cached prefix, then new tokens (page 5 shared)


KV_CACHE_DIM = {"bf16": 576, "fp8": 656}  # what SGLang's calculate_mla_kv_cache_dim gives GLM-5 (store elements)


def dsa_pool_kwargs(layers: int = LAYERS, page: int = PAGE, kv_dtype: str = "bf16") -> dict:
    """The keyword arguments SGLang's ``_build_dsa_kv_pool`` passes (GLM-5 cache geometry, CPU);
    ``kv_dtype="fp8"``: SGLang's fp8 DSA layout (``--kv-cache-dtype fp8_e4m3``)."""
    dtype = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}[kv_dtype]
    return dict(page_size=page, dtype=dtype, kv_lora_rank=512, qk_rope_head_dim=64, layer_num=layers,
                device="cpu", kv_cache_dim=KV_CACHE_DIM[kv_dtype], enable_memory_saver=False, start_layer=0,
                end_layer=layers,
                index_head_dim=128, index_kpool=1, index_kpool_compress=False, tail_extra_slots=0,
                max_running_requests=8)


def published(world: int = 1, group=None):
    """What SGLang's launcher would have published: no decode-CP, a CP group of ``world`` ranks."""
    from layersplit.sglang_plugin import compat

    cp = SimpleNamespace(world_size=world, pynccl_comm=None, cpu_group=group, rank_in_group=0, device=None)
    return compat.resolve("get_parallel")().override(attn_dcp_size=1, attn_dcp_rank=0, attn_cp_group=cp)


def _layer(i: int):
    return SimpleNamespace(layer_id=i)


def write_prefix(pool, layers: int = LAYERS, seed: int = 1) -> None:
    """The cached prefix: KV rows and indexer keys of ``PREFIX_PAGES`` (the last page partly), every layer."""
    g = torch.Generator().manual_seed(seed)
    loc = torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE) for p in PREFIX_PAGES])[:-24]
    for i in range(layers):
        pool.set_mla_kv_buffer(_layer(i), loc, torch.randn(loc.numel(), 1, 512, generator=g).to(torch.bfloat16),
                               torch.randn(loc.numel(), 1, 64, generator=g).to(torch.bfloat16))
        keys = torch.randint(0, 255, (loc.numel(), 128), dtype=torch.uint8, generator=g).view(torch.float8_e4m3fn)
        pool.set_index_k_scale_buffer(i, loc, keys, torch.rand(loc.numel(), 1, generator=g))


def _index_store_target(pool, layer: int, loc: torch.Tensor) -> list:
    """Where upstream's index-key store kernel writes: the pages of ``loc`` in the layer's buffer (on
    the owner; a layer-split non-owner stores nothing). For the sanitizer: under the Triton
    interpreter the kernel copies the whole buffer in and out, on a GPU it writes these pages."""
    cache = getattr(pool, "index_key_cache", None)
    if cache is None or not getattr(pool, "_is_layer_owned", lambda _: True)(layer):
        return []
    return [(cache.buffer[layer - getattr(pool, "start_layer", 0)], sorted(set((loc // PAGE).tolist())))]


def forward_layers(pool, seed: int, launch=None, layers: int = LAYERS) -> list[list]:
    """The model's order on one CP rank: per layer, store + read the new indexer keys, write + read the
    new KV rows, prefetch the next layer. Returns what each layer read ([index buffer, KV buffer]);
    with ``launch`` the reads are queued on the current stream, like the indexer and attention kernels."""
    g = torch.Generator().manual_seed(seed)
    loc = torch.cat([torch.arange(5 * PAGE + 40, 6 * PAGE), torch.arange(6 * PAGE, 6 * PAGE + 10)])  # pages 5, 6
    reads: list[list] = []

    def take(i: int, j: int, buf: torch.Tensor, name: str) -> None:
        if launch is None:
            reads[i][j] = buf.clone()
        else:
            launch(lambda: reads[i].__setitem__(j, buf.clone()), name)

    for i in range(layers):
        reads.append([None, None])
        keys = torch.randint(0, 255, (loc.numel(), 128), dtype=torch.uint8, generator=g).view(torch.float8_e4m3fn)
        scales = torch.rand(loc.numel(), 1, generator=g)
        with sanitizer.opaque("SetKAndS (Triton)", reads=[(keys, None), (scales, None)],
                              writes=_index_store_target(pool, i, loc)):
            pool.set_index_k_scale_buffer(i, loc, keys, scales)
        read_index = getattr(pool, "get_broadcastable_index_k_with_scale_buffer", pool.get_index_k_with_scale_buffer)
        take(i, 0, read_index(i), "indexer")
        pool.set_mla_kv_buffer(_layer(i), loc, torch.randn(loc.numel(), 1, 512, generator=g).to(torch.bfloat16),
                               torch.randn(loc.numel(), 1, 64, generator=g).to(torch.bfloat16))
        take(i, 1, pool.get_key_buffer(i), "attention")
        if i + 1 < layers and hasattr(pool, "prefetch_kv_buffer"):
            pool.prefetch_kv_buffer(i + 1)  # issued under layer i, as the model does before its MLP
    return reads


@dataclass
class StressResult:
    engine: str
    iterations: int
    layers: int
    unsafe_skip: list[str]
    index_reads: int
    kv_reads: int
    stale_index_reads: int
    stale_kv_reads: int
    early_index_reads: int
    seconds: float
    sanitizer_hazards: int | None = None  # distinct stream-ordering hazards (None: not sanitized)
    sanitizer_hazard_list: list[str] = field(default_factory=list)


def _direct_copy(src_layers, dst_layers, src_indices, dst_indices, page_size=1):
    """torch stand-in for sgl-kernel's ``transfer_kv_direct`` (rows of ``page_size`` tokens)."""
    src_indices, dst_indices = src_indices.long(), dst_indices.long()
    for src, dst in zip(src_layers, dst_layers):
        dst[dst_indices] = src[src_indices].to(dst.device)


class HostKV:
    """Host tier of the latent KV rows (what the anchor MLA host pool holds), one tensor per layer."""

    shared_allocation_domain = None

    def __init__(self, layers: int, rows: int, dim: int, dtype) -> None:
        self.layer_num = layers
        self.kv = torch.zeros((layers, rows, 1, dim), dtype=dtype)
        self.landed: list[float] = [0.0] * layers

    def prepare_transfer_indices(self, host_indices, device_indices, io_backend):
        return host_indices, device_indices

    def load_to_device_per_layer_physical(self, device_pool, host_indices, device_indices, layer_id, io_backend,
                                          *, is_draft=False):
        device_pool.kv_buffer[layer_id][device_indices.long()] = self.kv[layer_id][host_indices.long()]
        self.landed[layer_id] = time.perf_counter()


@contextlib.contextmanager
def _unsafe_skip_env(unsafe_skip):
    """``LAYERSPLIT_SGLANG_UNSAFE_SKIP`` set to ``unsafe_skip`` for the block; the caller's value after."""
    previous = os.environ.get("LAYERSPLIT_SGLANG_UNSAFE_SKIP")
    os.environ["LAYERSPLIT_SGLANG_UNSAFE_SKIP"] = ",".join(sorted(unsafe_skip))
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("LAYERSPLIT_SGLANG_UNSAFE_SKIP", None)
        else:
            os.environ["LAYERSPLIT_SGLANG_UNSAFE_SKIP"] = previous


@contextlib.contextmanager
def _emulated_sglang(device_module):
    """Point SGLang's cache controller and L2 transfer modules at ``device_module``; restore after."""
    import sglang.srt.managers.cache_controller as cc
    import sglang.srt.mem_cache.l2_transfer as l2
    import sglang.srt.mem_cache.pool_host.dsa as dsa

    saved = (cc.device_module, l2.device_module, getattr(dsa, "transfer_kv_direct", None))
    cc.device_module = l2.device_module = device_module
    dsa.transfer_kv_direct = _direct_copy
    try:
        yield
    finally:
        cc.device_module, l2.device_module = saved[0], saved[1]
        if saved[2] is None:
            del dsa.transfer_kv_direct
        else:
            dsa.transfer_kv_direct = saved[2]


def run(iterations: int = 40, layers: int = 4, seed: int = 0, unsafe_skip=(), max_stall_s: float = 0.002,
        pages_per_iteration: int = 3, upstream: bool = False, fallback: bool = False,
        sanitize: bool = False) -> StressResult:
    """``upstream=True`` runs SGLang's own counter and engine (one event per layer) for comparison;
    ``fallback=True`` our counter with upstream's engine loop (what runs when the indexer-first copy
    does not apply): the indexer's wait must then still follow the layer's load. ``sanitize``: under
    the stream-ordering sanitizer (:mod:`hicache.sanitizer`), the result lists what it found."""
    if sanitize:
        from hicache import sanitizer

        with sanitizer.sanitized() as san:
            result = run(iterations, layers, seed, unsafe_skip, max_stall_s, pages_per_iteration, upstream, fallback)
        result.sanitizer_hazards = len(san.hazards)
        result.sanitizer_hazard_list = [str(h) for h in san.hazards]
        return result
    from hicache.runtime.device_module import EmulatedDeviceModule
    from layersplit.sglang_plugin import compat, hicache
    from sglang.srt.mem_cache.l2_transfer import L2Transfer
    from sglang.srt.mem_cache.pool_host.dsa import DSAIndexerPoolHost, make_dsa_indexer_pool_decl

    page, size = 64, 64 * 16
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    dm = EmulatedDeviceModule()
    dm.runtime.delay_hook = lambda stream, op: rng.uniform(0, max_stall_s) if op.startswith("h2d") else 0.0
    result = StressResult("upstream" if upstream else "fallback" if fallback else "layersplit", iterations, layers, sorted(unsafe_skip), 0, 0, 0, 0, 0, 0.0)
    lock = threading.Lock()
    start = time.perf_counter()
    try:
        with (_unsafe_skip_env(unsafe_skip), _emulated_sglang(dm),
              compat.resolve("get_parallel")().override(attn_dcp_size=1, attn_dcp_rank=0)):
            device = compat.resolve("dsa_pool")(size, **dsa_pool_kwargs(layers, page))
            anchor = SimpleNamespace(page_size=page, layout="layer_first", size=size, page_num=size // page)
            host_index = DSAIndexerPoolHost(make_dsa_indexer_pool_decl(device), anchor, pin_memory=False)
            host_kv = HostKV(layers, size, 576, torch.bfloat16)
            counter = (compat.resolve("layer_done_counter") if upstream else hicache.make_counter_class())(layers)
            engine = (compat.resolve("l2_transfer_engine") if upstream or fallback else hicache.make_engine_class())("direct")
            device.register_layer_transfer_counter(counter)  # as SGLang's pool assembler does
            get_local_buffer = compat.resolve("index_key_cache").get_local_buffer
            forward = dm.current_stream()
            for it in range(iterations):
                host_pages = torch.tensor(rng.sample(range(size // page), pages_per_iteration))
                dev_pages = torch.tensor(rng.sample(range(1, size // page), pages_per_iteration))
                host_rows = (host_pages[:, None] * page + torch.arange(page)).flatten()
                dev_rows = (dev_pages[:, None] * page + torch.arange(page)).flatten()
                # fresh host data, poisoned device rows (no load is in flight: the last iteration synchronized)
                for l in range(layers):
                    host_index.index_k_with_scale_buffer[l][host_pages] = torch.randint(
                        0, 255, (pages_per_iteration, host_index.index_k_with_scale_buffer.shape[-1]),
                        dtype=torch.uint8, generator=gen)
                    host_kv.kv[l][host_rows] = torch.randn((host_rows.numel(), 1, 576), generator=gen).to(torch.bfloat16)
                    device.index_k_with_scale_buffer[l][dev_pages] = POISON
                    device.kv_buffer[l].view(torch.uint8)[dev_rows] = POISON
                want_index = [host_index.index_k_with_scale_buffer[l][host_pages].clone() for l in range(layers)]
                want_kv = [host_kv.kv[l][host_rows].clone() for l in range(layers)]
                host_kv.landed = [0.0] * layers

                producer = counter.update_producer()
                counter.set_consumer(producer)
                ev = counter.events[producer]
                ev.start_event.record()
                transfers = [L2Transfer(host_kv, device, host_rows, dev_rows),
                             L2Transfer(host_index, device, host_rows, dev_rows)]
                if upstream or fallback:  # its loop calls the host pools directly: queue them on the load stream
                    transfers = [t._replace(host_pool=_QueuedHostPool(t.host_pool, dm)) for t in transfers]
                engine.submit_host_to_device(transfers, transfer_layer_id_max=layers, start_event=ev.start_event,
                                             on_layer_done=ev.complete)
                for l in range(layers):
                    # the indexer's path to its keys: IndexKeyCache.get_local_buffer, with our hook
                    cache = device.index_key_cache
                    keys = (get_local_buffer(cache, l) if upstream
                            else hicache.around_get_local_buffer(get_local_buffer, cache, l))

                    def read_index(l=l, keys=keys):
                        ok = torch.equal(keys[dev_pages], want_index[l])
                        early = host_kv.landed[l] == 0.0
                        with lock:
                            result.index_reads += 1
                            result.stale_index_reads += not ok
                            result.early_index_reads += ok and early

                    dm.launch(read_index, "indexer")
                    counter.wait_until(l)  # attention: the whole layer

                    def read_kv(l=l):
                        ok = torch.equal(device.kv_buffer[l][dev_rows].view(torch.uint8), want_kv[l].view(torch.uint8))
                        with lock:
                            result.kv_reads += 1
                            result.stale_kv_reads += not ok

                    dm.launch(read_kv, "attention")
                forward.synchronize()
                engine.host_to_device_stream.synchronize()
    finally:
        dm.close()
    result.seconds = time.perf_counter() - start
    return result


class _QueuedHostPool:
    """A host pool whose per-layer loads are queued on the current (load) stream, as CUDA queues the
    kernels they launch; for running upstream's engine loop, which calls host pools directly."""

    shared_allocation_domain = None

    def __init__(self, pool, dm) -> None:
        self.pool, self.dm, self.layer_num = pool, dm, pool.layer_num

    def prepare_transfer_indices(self, host_indices, device_indices, io_backend):
        return self.pool.prepare_transfer_indices(host_indices, device_indices, io_backend)

    def load_to_device_per_layer_physical(self, *args, **kwargs):
        self.dm.launch(lambda: self.pool.load_to_device_per_layer_physical(*args, **kwargs), "h2d")


@dataclass
class PoolStressResult:
    iterations: int
    layers: int
    unsafe_skip: list[str]
    layer_reads: int  # (index keys + KV rows) of one layer on one rank
    stale_reads: int
    stale_by_rank: list[int]
    seconds: float
    sanitizer_hazards: int | None = None  # distinct stream-ordering hazards over both ranks (None: not sanitized)
    sanitizer_hazard_list: list[str] = field(default_factory=list)


class _HostLoader:
    """HiCache for the pool stress: each batch the owner's copies of the prefix-only pages (KV rows and
    indexer keys) are poisoned and loaded back from a host snapshot on an emulated load stream, layer
    by layer with random stalls, recording the split counter's indexer-ready and layer events."""

    def __init__(self, ref, pool, dm) -> None:
        self.pool, self.dm, self.load = pool, dm, dm.Stream()
        self.pages = torch.tensor([p for p in PREFIX_PAGES if p not in NEW_PAGES])
        self.rows = (self.pages[:, None] * PAGE + torch.arange(PAGE)).flatten()
        self.owned = [i for i in range(LAYERS) if pool._is_layer_owned(i)]
        self.host_kv = {i: ref.kv_buffer[i][self.rows].clone() for i in self.owned}
        self.host_index = {i: ref.index_k_with_scale_buffer[i][self.pages].clone() for i in self.owned}

    def reload(self, counter) -> None:
        pool, dm = self.pool, self.dm
        producer = counter.update_producer()
        counter.set_consumer(producer)
        loading = counter.events[producer]
        for i in self.owned:  # nothing is in flight: the last batch synchronized every stream
            pool.kv_buffer[i].view(torch.uint8)[self.rows] = POISON
            pool.index_key_cache.buffer[i][self.pages] = POISON
        loading.start_event.record()  # the poison above runs on the forward stream: the load follows it
        with dm.stream(self.load):
            self.load.wait_event(loading.start_event)
            for i in range(LAYERS):
                if i in self.owned:
                    dm.launch(lambda i=i: pool.index_key_cache.buffer[i].index_copy_(0, self.pages, self.host_index[i]),
                              "h2d")
                loading.complete_index(i)
                if i in self.owned:
                    dm.launch(lambda i=i: pool.kv_buffer[i].index_copy_(0, self.rows, self.host_kv[i]), "h2d")
                loading.complete(i)


class _GlooComm:
    """The shape of upstream's dedicated NCCL broadcast communicator, over a gloo group."""

    def __init__(self, group) -> None:
        self.group = group

    def change_state(self, enable: bool = True):
        return contextlib.nullcontext()

    def broadcast(self, tensor, src: int) -> None:
        import torch.distributed as dist

        dist.broadcast(tensor, src, group=self.group)


def _pool_worker(rank: int, port: int, unsafe: str, iterations: int, seed: int, max_stall_s: float, queue,
                 sanitize: bool = False) -> None:
    if not torch.cuda.is_available():  # upstream stores indexer keys with a Triton kernel: interpret it on CPU
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch.distributed as dist

    from hicache import sanitizer
    from hicache.runtime.device_module import EmulatedDeviceModule
    from layersplit.sglang_plugin import compat, hicache
    from layersplit.sglang_plugin.pool import make_pool_class

    os.environ["LAYERSPLIT_SGLANG_UNSAFE_SKIP"] = unsafe  # this process only
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    kv_group = dist.new_group([0, 1], backend="gloo")  # staged broadcasts: their own stream and communicator
    dm = EmulatedDeviceModule()
    rng = random.Random(seed * 2 + rank)
    # host->device loads stall up to 10x longer than broadcasts: a layer must still be loading when
    # the model prefetches it, one layer ahead
    dm.runtime.delay_hook = lambda stream, op: rng.uniform(0, {"broadcast": max_stall_s, "h2d": 10 * max_stall_s}
                                                           .get(op, 0.0))
    try:
        with published():
            ref = compat.resolve("dsa_pool")(SIZE, **dsa_pool_kwargs())
            write_prefix(ref)
        with published(world=2, group=dist.group.WORLD), _emulated_sglang(dm):
            pool = make_pool_class()(SIZE, **dsa_pool_kwargs(), layer_shard_rank=rank, layer_shard_size=2)
            write_prefix(pool)
            pool.device_module, pool.kv_broadcast_stream = dm, dm.Stream()
            pool.layer_broadcast_comm = _GlooComm(kv_group)
            counter = hicache.make_counter_class()(LAYERS)  # its events live on the emulated streams
            pool.register_layer_transfer_counter(counter)
        loader = _HostLoader(ref, pool, dm)
        pages = torch.tensor(sorted(set(PREFIX_PAGES + NEW_PAGES)))
        prefix_pages = torch.tensor(sorted(set(PREFIX_PAGES) - set(NEW_PAGES)))
        new_pages = torch.tensor(sorted(set(NEW_PAGES)))
        rows = (pages[:, None] * PAGE + torch.arange(PAGE)).flatten()
        stale = checked = 0
        san = sanitizer.enable() if sanitize else None
        for it in range(iterations):
            with published():
                want = forward_layers(ref, seed=seed * 100_003 + it)
            with published(world=2, group=dist.group.WORLD), _emulated_sglang(dm):
                loader.reload(counter)  # the prefix comes back from host memory while the forward runs
                # what the metadata hook passes (no host read of the ids: the validated
                # set_forward_pages would read them on the host, which the sanitizer reports)
                pool.set_batch_pages(prefix_pages, new_pages)
                got = forward_layers(pool, seed=seed * 100_003 + it, launch=dm.launch)
                dm.synchronize()
            for layer_id, ((index, kv), (ref_index, ref_kv)) in enumerate(zip(got, want)):
                checked += 1
                # batch landing: a non-owned layer was read from a slot, where the remapped tables point
                remapped = pool.reads_remapped(layer_id)
                at_pages, at_rows = (pool.remap_pages(pages), pool.remap_locs(rows)) if remapped else (pages, rows)
                stale += not (torch.equal(kv[at_rows].view(torch.uint8), ref_kv[rows].view(torch.uint8))
                              and torch.equal(index[at_pages], ref_index[pages]))
        hazards = [str(h) for h in sanitizer.disable().hazards] if san is not None else None
        queue.put((rank, (checked, stale, hazards), None))
    except Exception:
        import traceback

        queue.put((rank, None, traceback.format_exc()))
    finally:
        dm.close()
        dist.destroy_process_group()


def run_pool(iterations: int = 6, unsafe_skip=(), seed: int = 0, max_stall_s: float = 0.003,
             timeout_s: float = 600.0, sanitize: bool = False) -> PoolStressResult:
    """Two rank processes over gloo; see the module docstring. ``sanitize``: each rank's forward
    under the stream-ordering sanitizer."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    unsafe = ",".join(sorted(unsafe_skip))
    start = time.perf_counter()
    procs = [ctx.Process(target=_pool_worker, args=(r, port, unsafe, iterations, seed, max_stall_s, queue, sanitize))
             for r in range(2)]
    for p in procs:
        p.start()
    try:
        results = sorted(queue.get(timeout=timeout_s) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    errors = [err for _, _, err in results if err]
    if errors:
        raise RuntimeError("pool stress: a rank failed:\n" + errors[0])
    counts = [c for _, c, _ in results]
    hazards = sorted({h for _, _, found in counts for h in found or []})
    return PoolStressResult(iterations, LAYERS, sorted(unsafe_skip), sum(c for c, _, _ in counts),
                            sum(s for _, s, _ in counts), [s for _, s, _ in counts], time.perf_counter() - start,
                            len(hazards) if sanitize else None, hazards)
