"""Stress test of the HiCache adapter inside SGLang's own load path, on CPU with real asynchrony.

SGLang's ``L2TransferEngine`` / ``LayerDoneCounter`` code records and waits on events of its module's
``device_module``; here that module is :class:`hicache.device_module.EmulatedDeviceModule` (one
worker thread per stream), so the load stream really runs beside the forward stream. Each iteration:

1. the device pool's indexer pages and KV rows of the batch are poisoned; the host pools hold fresh,
   iteration-specific data (the real ``DSAIndexerPoolHost`` for the indexer keys, a host KV pool for
   the latent rows);
2. our ``IndexFirstL2TransferEngine.submit_host_to_device`` queues the per-layer loads (indexer keys,
   indexer-ready event, KV rows, layer event) on the load stream, with random stalls;
3. the forward stream, layer by layer, gets the indexer keys through ``IndexKeyCache.get_local_buffer``
   with the plug-in's AROUND hook (``wait_index_until(l)``) and reads them, then waits
   ``wait_until(l)`` and reads the KV rows, as the model's indexer and attention would.

A read that sees poison or another iteration's data is a read-before-ready. With the waits: none.
With ``unsafe_skip={"index_wait"}`` the indexer's read races the load and the detector fires.
``early_index_reads`` counts indexer reads that ran before the same layer's KV rows had landed: the
overlap the split events buy (upstream's single event makes it 0).

sgl-kernel's ``transfer_kv_direct`` (a CUDA op) is replaced by its torch equivalent while this runs.

Long mode: ``python -m layersplit.sglang_plugin.stress --iterations 2000``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import threading
import time
from dataclasses import asdict, dataclass
from types import SimpleNamespace

import torch

POISON = 0xA5


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
        pages_per_iteration: int = 3, upstream: bool = False) -> StressResult:
    """``upstream=True`` runs SGLang's own counter and engine (one event per layer) for comparison."""
    from hicache.device_module import EmulatedDeviceModule
    from layersplit.sglang_plugin import compat, hicache
    from sglang.srt.mem_cache.pool_host.dsa import DSAIndexerPoolHost, make_dsa_indexer_pool_decl

    page, size = 64, 64 * 16
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    dm = EmulatedDeviceModule()
    dm.runtime.delay_hook = lambda stream, op: rng.uniform(0, max_stall_s) if op.startswith("h2d") else 0.0
    result = StressResult("upstream" if upstream else "layersplit", iterations, layers, sorted(unsafe_skip), 0, 0, 0, 0, 0, 0.0)
    lock = threading.Lock()
    start = time.perf_counter()
    import os

    previous_skip = os.environ.get("LAYERSPLIT_SGLANG_UNSAFE_SKIP")
    os.environ["LAYERSPLIT_SGLANG_UNSAFE_SKIP"] = ",".join(sorted(unsafe_skip))
    try:
        with _emulated_sglang(dm), compat.resolve("get_parallel")().override(attn_dcp_size=1, attn_dcp_rank=0):
            device = compat.resolve("dsa_pool")(
                size, page_size=page, dtype=torch.bfloat16, kv_lora_rank=512, qk_rope_head_dim=64, layer_num=layers,
                device="cpu", kv_cache_dim=576, enable_memory_saver=False, start_layer=0, end_layer=layers,
                index_head_dim=128, index_kpool=1, index_kpool_compress=False, tail_extra_slots=0,
                max_running_requests=8)
            anchor = SimpleNamespace(page_size=page, layout="layer_first", size=size, page_num=size // page)
            host_index = DSAIndexerPoolHost(make_dsa_indexer_pool_decl(device), anchor, pin_memory=False)
            host_kv = HostKV(layers, size, 576, torch.bfloat16)
            if upstream:
                counter = compat.resolve("layer_done_counter")(layers)
                engine = compat.resolve("l2_transfer_engine")("direct")
            else:
                counter = hicache.make_counter_class()(layers)
                engine = hicache.make_engine_class()("direct")
            device.register_layer_transfer_counter(counter)  # as SGLang's pool assembler does
            get_local_buffer = compat.resolve("index_key_cache").get_local_buffer
            L2Transfer = __import__("sglang.srt.mem_cache.l2_transfer", fromlist=["L2Transfer"]).L2Transfer
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
                submit = engine.submit_host_to_device if not upstream else _queued(engine, dm)
                submit(transfers, transfer_layer_id_max=layers, start_event=ev.start_event,
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
        if previous_skip is None:
            os.environ.pop("LAYERSPLIT_SGLANG_UNSAFE_SKIP", None)
        else:
            os.environ["LAYERSPLIT_SGLANG_UNSAFE_SKIP"] = previous_skip
        dm.close()
    result.seconds = time.perf_counter() - start
    return result


def _queued(engine, dm):
    """Upstream's loop calls the host pools directly; queue those calls on the load stream, as CUDA
    queues the kernels they launch."""

    def submit(transfers, **kwargs):
        queued = []
        for t in transfers:
            pool = t.host_pool
            call = pool.load_to_device_per_layer_physical

            class Queued:
                layer_num = pool.layer_num
                shared_allocation_domain = None

                def prepare_transfer_indices(self, h, d, io, pool=pool):
                    return pool.prepare_transfer_indices(h, d, io)

                def load_to_device_per_layer_physical(self, *args, call=call, **kw):
                    dm.launch(lambda: call(*args, **kw), "h2d")

            queued.append(t._replace(host_pool=Queued()))
        return engine.submit_host_to_device(queued, **kwargs)

    return submit


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m layersplit.sglang_plugin.stress", description=__doc__.split("\n")[0])
    parser.add_argument("--iterations", type=int, default=2000)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--upstream", action="store_true", help="SGLang's own counter and engine, for comparison")
    parser.add_argument("--unsafe-skip", default="", help="index_wait: UNSAFE, shows the detector firing")
    args = parser.parse_args(argv)
    skip = tuple(s for s in args.unsafe_skip.split(",") if s)
    result = run(args.iterations, args.layers, args.seed, skip, upstream=args.upstream)
    print(json.dumps(asdict(result)))
    return 0 if (result.stale_index_reads + result.stale_kv_reads == 0) == (not skip) else 1


if __name__ == "__main__":
    raise SystemExit(main())
