"""HiCache overlap benchmark: layer-wise load pipelined under the DSA forward vs serial (load all, then compute).

For L layers of GLM-5-sized caches (latent 512 + rope 64 bf16, indexer keys 128 fp8) and a batch
whose context sits in the host pool, it measures (median of --repeats after one warm-up):

* load:      host -> device copies of every layer on the Load Stream, alone;
* compute:   the forward alone (indexer + top-k + sparse MLA per layer) on resident data;
* serial:    load everything, synchronize, then compute;
* pipelined: the forward waits per layer on ``indexer_ready[l]`` / ``kv_ready[l]``.

and prints ``pipelined / max(load, compute)`` (1.0 = perfect overlap) next to ``serial / max``.
On a CPU the streams are emulated worker threads (2 cores here: copies and compute share them).

    python benchmarks/hicache_overlap.py [--layers 8] [--pages 256] [--queries 2] [--threads 1] [--json]
"""

from __future__ import annotations

import argparse
import sys
import json
import math
import statistics
import time

import torch

from dsa_kernels import indexer_scores, positions_to_slots, sparse_mla_prefill, topk_indices
from hicache.device_pool import DSADevicePool
from hicache.host_pool import DSAHostPool
from hicache.load_pipeline import LayerwiseLoader, compute_ready
from hicache.paged_buffers import DSACacheSpec
from hicache.runtime.streams import get_runtime


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rt = get_runtime(args.runtime)
        dev = self.rt.device
        self.spec = DSACacheSpec(args.layers, 512, 64, 128, tuple(range(args.layers)))
        self.host = DSAHostPool(self.spec, args.pages)
        self.device = DSADevicePool(self.spec, args.pages, dev)
        self.host_pages = self.host.allocator.alloc(args.pages)
        g = torch.Generator().manual_seed(0)
        for layer in range(args.layers):  # random bytes: copies do not care, compute sees finite bf16 / fp8
            self.host.kv[layer].copy_(torch.randn(self.host.kv[layer].shape, generator=g).to(torch.bfloat16))
            keys = torch.randn(args.pages * 64, 128, generator=g)
            self.host.set_index_k_buffer(layer, torch.arange(args.pages * 64), keys)
        ctx, t = args.pages * 64, args.queries
        self.table = torch.arange(args.pages, dtype=torch.int32, device=dev)[None]
        self.req = torch.zeros(t, dtype=torch.int32, device=dev)
        self.pos = torch.arange(ctx - t, ctx, device=dev)
        self.q_i = torch.randn(t, args.index_heads, 128, generator=g).to(torch.bfloat16).to(dev)
        self.w = torch.rand(t, args.index_heads, generator=g).to(dev)
        self.q = torch.randn(t, args.heads, 576, generator=g).to(torch.bfloat16).to(dev)
        self.ctx = ctx
        self.loader = LayerwiseLoader(self.rt, self.device, self.host)  # its load stream waits for the setup
        self.fwd = self.rt.stream("forward")
        # hazard: the forward stream reads the inputs and the pool made above by kernels on the compute
        # stream (a non-blocking stream is not ordered after them): it waits for them once
        self.fwd.wait_event(compute_ready(self.rt))

    def _forward(self, load) -> None:
        state: dict = {}
        for layer in range(self.args.layers):
            if load is not None:
                load.wait_indexer(layer, self.fwd)
            self.fwd.submit(lambda layer=layer: self._indexer_only(layer, state))
            if load is not None:
                load.wait_kv(layer, self.fwd)
            self.fwd.submit(lambda layer=layer: self._attention_only(layer, state))

    def _indexer_only(self, layer: int, state: dict) -> None:
        scores = indexer_scores(self.q_i, self.w, self.device.index[layer], self.table, self.req, self.pos, self.ctx)
        state["slots"] = positions_to_slots(topk_indices(scores, 2048), self.table, self.req)

    def _attention_only(self, layer: int, state: dict) -> None:
        sparse_mla_prefill(self.q, self.device.kv[layer], state["slots"], 1 / math.sqrt(192), 512)

    def _load(self):
        dev_pages = self.device.allocator.alloc(self.args.pages)
        load = self.loader.start_loading(self.host_pages, dev_pages)
        return load, dev_pages

    def _finish(self, load, dev_pages) -> None:
        load.kv_ready[self.args.layers - 1].synchronize()
        self.fwd.synchronize()
        self.loader.reclaim()
        self.device.allocator.free(dev_pages)

    def timed(self, mode: str) -> float:
        t0 = time.perf_counter()
        if mode == "compute":
            self._forward(None)
            self.fwd.synchronize()
            return time.perf_counter() - t0
        load, pages = self._load()
        if mode == "serial":
            load.kv_ready[self.args.layers - 1].synchronize()
            self._forward(None)
        elif mode == "pipelined":
            self._forward(load)
        self._finish(load, pages)
        return time.perf_counter() - t0

    def run(self) -> dict:
        modes = ("load", "compute", "serial", "pipelined")
        for mode in modes:
            self.timed(mode)  # warm-up
        times = {m: statistics.median(self.timed(m) for _ in range(self.args.repeats)) for m in modes}
        a = self.args
        load_bytes = a.layers * a.pages * self.spec.page_bytes(0)
        t = a.queries
        flops = a.layers * (2 * t * self.ctx * a.index_heads * 128 + 4 * t * a.heads * min(2048, self.ctx) * 576)
        bound = max(times["load"], times["compute"])
        self.rt.close()
        return {
            "runtime": self.rt.kind, "layers": a.layers, "context_tokens": self.ctx, "queries": t,
            "load_s": times["load"], "compute_s": times["compute"], "serial_s": times["serial"],
            "pipelined_s": times["pipelined"], "pipelined_over_max": times["pipelined"] / bound,
            "serial_over_max": times["serial"] / bound, "load_GBps": load_bytes / times["load"] / 1e9,
            "compute_GFLOPps": flops / times["compute"] / 1e9, "repeats": a.repeats,
        }


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    from layersplit.cli.options import int_at_least

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int_at_least(1, 1024), default=8, help="layers loaded and computed (default 8)")
    p.add_argument("--pages", type=int_at_least(1, 1 << 20), default=256,
                   help="context pages (64 tokens each) loaded per layer (default 256)")
    p.add_argument("--queries", type=int_at_least(1, 1 << 16), default=2, help="query tokens in the batch (default 2)")
    p.add_argument("--heads", type=int_at_least(1, 256), default=8,
                   help="attention heads (GLM-5: 64; fewer balances load and compute on a CPU; default 8)")
    p.add_argument("--index-heads", type=int_at_least(1, 256), default=32, help="indexer heads (default 32)")
    p.add_argument("--repeats", type=int_at_least(1, 1000), default=5, help="runs of each variant; the median is kept (default 5)")
    p.add_argument("--runtime", choices=("auto", "emulated", "cuda"), default="auto",
                   help="streams: CUDA where present (auto, default) or the emulated runtime")
    p.add_argument("--threads", type=int_at_least(0, 1024), default=1,
                   help="torch intra-op threads (default 1: each emulated stream gets its own core; 0 = torch's default)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    host_bytes = args.layers * args.pages * 64 * 1200  # ~ bf16 MLA row + indexer key per token and layer
    if host_bytes > 64 * 2**30:
        p.error(f"--layers x --pages: the host tier would hold about {host_bytes / 2**30:,.0f} GiB; expected <= 64 GiB")
    return args


def verdict(result: dict) -> str:
    """What the two ratios mean, in one sentence (1.0 = perfect overlap)."""
    pipelined, serial = result["pipelined_over_max"], result["serial_over_max"]
    if pipelined >= serial:
        return ("pipelined is not faster than serial here: load and compute compete for the same resource "
                + ("(emulated streams are host threads sharing this machine's cores and memory bandwidth; on a GPU "
                   "the copy engine runs beside the SMs)" if result["runtime"] == "emulated"
                   else "(the copies and the kernels contend; check pinned host memory and the copy engine)"))
    hidden = (serial - pipelined) / max(serial - 1.0, 1e-9)
    return f"pipelining hides {min(hidden, 1.0):.0%} of the smaller of load and compute"


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if not args.json:
        print(f"measuring {args.repeats} runs each of load, compute, serial and pipelined...", file=sys.stderr, flush=True)
    result = Bench(args).run()
    result["verdict"] = verdict(result)
    if args.json:
        print(json.dumps(result))
    else:
        print(f"HiCache overlap ({result['runtime']} streams, measured), {result['layers']} layers, "
              f"{result['context_tokens']} context tokens, {result['queries']} queries, "
              f"{torch.get_num_threads()} torch thread(s), median of {result['repeats']}")
        print(f"  load alone      {result['load_s'] * 1e3:8.2f} ms  ({result['load_GBps']:.2f} GB/s)")
        print(f"  compute alone   {result['compute_s'] * 1e3:8.2f} ms  ({result['compute_GFLOPps']:.1f} GFLOP/s)")
        print(f"  serial          {result['serial_s'] * 1e3:8.2f} ms  = {result['serial_over_max']:.3f} x max(load, compute)")
        print(f"  pipelined       {result['pipelined_s'] * 1e3:8.2f} ms  = {result['pipelined_over_max']:.3f} x max(load, compute)")
        print(f"  {result['verdict']}")
    return result


if __name__ == "__main__":
    main()
