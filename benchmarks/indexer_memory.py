"""Indexer peak memory and time per layer: chunked ``indexer_topk`` vs the unchunked scores + sort.

One layer of the lightning indexer + top-k for one request whose last ``T`` positions are the
queries (a cached prefix of ``ctx - T``), GLM-5 indexer shapes (32 heads x 128, top-2048):

* unchunked: ``topk_indices(indexer_scores(...))`` — a ``[T, ctx]`` fp32 score matrix, then a sort
  (values + int64 indices: ~16 B per score in flight);
* chunked:   ``indexer_topk(..., chunk, query_block)`` — per query block, ``chunk`` columns at a
  time merged into a running top-k: ~``query_block x (topk + chunk)`` scores in flight.

On CUDA (the real 16k x 128k shape by default): peak = ``max_memory_allocated`` above what the
inputs hold, time = median of CUDA-event timings after a warm-up. On CPU (a scaled shape: every
size / 32 by default) each variant runs in a forked child: peak = the child's resident-set high
water mark (reset through ``/proc/self/clear_refs`` just before the call) minus its resident set
then; time = ``perf_counter``, median. The line printed says which. FLOP/s count
``2 * H * D * pairs`` (``pairs`` = causal query/key pairs).

    python benchmarks/indexer_memory.py [--tokens T] [--context C] [--topk K] [--chunk N] [--query-block B]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time

import torch

from dsa_kernels import indexer_scores, indexer_topk, quantize_index_keys, topk_indices
from dsa_kernels.layout import index_page_bytes

REAL = dict(tokens=16384, context=131072, topk=2048, chunk=16384, query_block=2048)
CPU_SCALE = 32


def build(args, dev: torch.device):
    gen = torch.Generator().manual_seed(0)
    pages = -(-args.context // 64)
    cache = torch.zeros(pages, index_page_bytes(args.dim), dtype=torch.uint8, device=dev)
    table = torch.randperm(pages, generator=gen).to(torch.int32)[None].to(dev)
    s = torch.arange(args.context, device=dev)
    for s0 in range(0, args.context, 1 << 16):  # random keys, quantized into shuffled pages
        rows = s[s0:s0 + (1 << 16)]
        keys = torch.randn(len(rows), args.dim, generator=gen).to(dev)
        quantize_index_keys(keys, cache, table[0, rows // 64].long() * 64 + rows % 64)
    q = torch.randn(args.tokens, args.heads, args.dim, generator=gen).to(torch.bfloat16).to(dev)
    w = torch.randn(args.tokens, args.heads, generator=gen).to(dev)
    req = torch.zeros(args.tokens, dtype=torch.int32, device=dev)
    pos = torch.arange(args.context - args.tokens, args.context, device=dev)
    return q, w, cache, table, req, pos


def variants(args):
    def unchunked(inputs):
        return topk_indices(indexer_scores(*inputs, args.context), args.topk)

    def chunked(inputs):
        return indexer_topk(*inputs, args.context, args.topk, chunk=args.chunk, query_block=args.query_block)
    return {"unchunked": unchunked, "chunked": chunked}


def _rss_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _cpu_child(args, name: str, out: mp.Queue) -> None:
    torch.set_num_threads(args.threads)
    inputs = build(args, torch.device("cpu"))
    fn = variants(args)[name]
    q, w, cache, table, req, pos = inputs
    fn((q[:8], w[:8], cache, table, req[:8], pos[:8]))  # warm-up: thread pool and allocator, not measured
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the high-water mark (VmHWM) to the current resident set
    before = _rss_bytes("VmRSS")
    t0 = time.perf_counter()
    top = fn(inputs)
    first = time.perf_counter() - t0
    peak = _rss_bytes("VmHWM") - before
    times = [first]
    for _ in range(args.repeats - 1):
        t0 = time.perf_counter()
        fn(inputs)
        times.append(time.perf_counter() - t0)
    out.put((peak, statistics.median(times), top.numpy()))  # numpy: pickled by value, not as a shared fd


def run_cpu(args, name: str):
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    child = ctx.Process(target=_cpu_child, args=(args, name, out))
    child.start()
    peak, seconds, top = out.get()
    child.join()
    return peak, seconds, torch.from_numpy(top)


def run_cuda(args, name: str, inputs):
    fn = variants(args)[name]
    fn(inputs)  # warm-up (Triton compile)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(args.repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        top = fn(inputs)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return torch.cuda.max_memory_allocated() - base, statistics.median(times), top.cpu()


def main(argv: list[str] | None = None) -> int:
    cuda = torch.cuda.is_available()
    scale = 1 if cuda else CPU_SCALE
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    from layersplit.cli.options import int_at_least

    what = {"tokens": "new (query) tokens", "context": "context tokens", "topk": "top-k per query",
            "chunk": "context columns scored per step of the chunked indexer",
            "query_block": "queries per block of the chunked indexer"}
    for key, value in REAL.items():
        flags = ["--" + key.replace("_", "-")] + (["--context-len"] if key == "context" else [])
        p.add_argument(*flags, dest=key, type=int_at_least(1), default=value // scale,
                       help=f"{what.get(key, key)} (default {value // scale}: the real shape{'' if cuda else f' / {scale}'})")
    p.add_argument("--heads", type=int_at_least(1, 256), default=32, help="indexer heads (default 32, GLM-5)")
    p.add_argument("--dim", type=int_at_least(1, 1024), default=128, help="indexer head dim (default 128, GLM-5)")
    p.add_argument("--repeats", type=int_at_least(1, 100), default=3, help="runs of each variant; the median is kept (default 3)")
    p.add_argument("--threads", type=int_at_least(1, 1024), default=1,
                   help="CPU threads per run (1: on a shared machine every op otherwise pays a thread-pool wake-up)")
    args = p.parse_args(argv)
    sizes = {key: getattr(args, key) for key in REAL}
    shape = "REAL GLM-5 shape" if sizes == REAL else \
        f"SCALED shape (every size of the real one / {scale})" if sizes == {k: v // scale for k, v in REAL.items()} \
        else "custom shape"
    how = "CUDA max_memory_allocated above inputs, CUDA events" if cuda else \
        "CPU, forked child: resident-set high-water mark growth, perf_counter"
    print(f"indexer per layer, {shape}: T={args.tokens} ctx={args.context} H={args.heads} D={args.dim} "
          f"k={args.topk} chunk={args.chunk} query_block={args.query_block} [measured: {how}]")
    pairs = sum(min(p_ + 1, args.context) for p_ in range(args.context - args.tokens, args.context))
    flops = 2 * args.heads * args.dim * pairs
    inputs = build(args, torch.device("cuda")) if cuda else None
    results = {}
    for name in ("unchunked", "chunked"):
        peak, seconds, top = run_cuda(args, name, inputs) if cuda else run_cpu(args, name)
        results[name] = top
        print(f"  {name:<10} peak {peak / 2**20:10.1f} MiB   time {seconds * 1e3:10.1f} ms/layer   "
              f"{flops / seconds / 1e12:7.3f} TFLOP/s")
    model_unchunked = args.tokens * args.context * 4
    model_chunked = min(args.query_block, args.tokens) * (args.topk + args.chunk) * 4
    print(f"  score matrix alone (model, not measured): unchunked T*ctx*4 = {model_unchunked / 2**20:.1f} MiB, "
          f"chunked query_block*(k+chunk)*4 = {model_chunked / 2**20:.1f} MiB")
    same = torch.equal(results["unchunked"], results["chunked"])
    print(f"  same top-k (indices, order, ties): {'yes' if same else 'NO'}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
