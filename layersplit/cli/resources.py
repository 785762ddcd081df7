"""Resources before work: what a command needs of this machine, checked or said before it starts.

* :func:`check_machine_env`: the ``LAYERSPLIT_*`` variables this machine cannot honour (NCCL without CUDA,
  Triton on a CPU without its interpreter), for the commands that run kernels or CP ranks here;
* :func:`check_storm_fits`: a long ``stress pd`` storm's memory and run time, from a short measurement;
* :func:`eta_printer`: a long run's expected duration, said once on stderr after its first seconds;
* :func:`check_gpu_fits` / :func:`check_sweep_gpu_fits`: where the rank processes would run on CUDA, each
  GPU's free memory (:func:`gpu_free_bytes`, the seam a CPU test replaces) against the ranks placed on it.

The sweep's measured engine is sized from its config: host memory by :func:`layersplit.api.check_fits`,
device memory by :func:`check_sweep_gpu_fits`.
"""

from __future__ import annotations

import sys
import time


def check_machine_env() -> None:
    """The ``LAYERSPLIT_*`` variables this machine cannot honour (``lsconfig.envs.check_machine``), for a
    command that runs kernels or CP ranks here; imports torch (to ask for CUDA) only where one is set."""
    from lsconfig import envs

    if envs.cp_backend() == "nccl" or envs.kernel_backend() == "triton":
        import torch

        envs.check_machine(torch.cuda.is_available())


def eta_printer(command: str, total: int, unit: str, after_s: float = 5.0, long_s: float = 60.0,
                clock=time.perf_counter):
    """A ``progress(n)`` callback (``n`` more done) that, once ``after_s`` have passed, says once on stderr how
    long the whole run will take at the rate so far, when that is more than ``long_s`` (a short run says
    nothing); Ctrl-C stops a run that is too long (exit 130)."""
    start, done, said = clock(), [0], [False]

    def step(n: int = 1) -> None:
        done[0] += n
        elapsed = clock() - start
        if said[0] or elapsed < after_s or not done[0]:
            return
        said[0] = True
        left = elapsed * (total - done[0]) / done[0]
        if elapsed + left > long_s:
            print(f"layersplit {command}: about {duration(elapsed + left)} for {total:,} {unit} "
                  f"({done[0] / elapsed:,.0f} {unit}/s so far; Ctrl-C stops it)", file=sys.stderr, flush=True)

    return step


def duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:,.1f} h"


STORM_MEASURED = 400  # requests of the short run a long storm's memory and time are estimated from
STORM_LONG = 50_000  # storms with more requests are measured first (the default 10,000 is not)


def check_storm_fits(cfg, run_pd_stress) -> None:
    """A long storm keeps every request's state until its end (the arrivals are queued up front): its
    memory grows with ``--requests``. Estimated from a short run of the same config under ``tracemalloc``
    (peak bytes per request, a bound: the short run's fixed cost is charged per request too); refused
    where it exceeds this machine's available memory, and its run time said on stderr."""
    if cfg.requests <= STORM_LONG:
        return
    import tracemalloc
    from dataclasses import replace

    from layersplit.engine.prefill import available_memory_bytes

    short = replace(cfg, requests=STORM_MEASURED)
    start = time.perf_counter()
    run_pd_stress(short)
    per_s = (time.perf_counter() - start) / STORM_MEASURED
    tracemalloc.start()
    try:
        run_pd_stress(short)
        per_request = tracemalloc.get_traced_memory()[1] / STORM_MEASURED
    finally:
        tracemalloc.stop()
    have = available_memory_bytes()
    need = cfg.requests * per_request
    if have is not None and need > 0.8 * have:
        fits = int(0.8 * have / per_request)
        raise ValueError(f"--requests: expected <= {fits:,} on this machine, got {cfg.requests:,}: a storm keeps each "
                         f"request's state to its end, about {per_request / 1024:,.1f} KiB a request (measured on "
                         f"{STORM_MEASURED}), {need / 2**30:,.1f} GiB in all; {have / 2**30:,.1f} GiB are available "
                         "(80% usable); run several seeds (--seed) of fewer requests instead")
    print(f"layersplit stress pd: about {duration(cfg.requests * per_s)} and {need / 2**30:,.1f} GiB for "
          f"{cfg.requests:,} requests (measured on {STORM_MEASURED}); Ctrl-C stops it", file=sys.stderr, flush=True)


def gpu_free_bytes(ranks: int) -> list[int] | None:
    """Free bytes of each CUDA device ``ranks`` rank processes would use (rank r on device ``r % count``, as
    :mod:`layersplit.engine.rank_worker` places them), or None where they run on the CPU or the probe fails
    (nothing to compare then: the ranks' own allocations say it). Read in a child process by
    :func:`layersplit.engine.prefill.gpu_memory_bytes`; the seam tests replace."""
    import torch

    from layersplit.engine.prefill import gpu_memory_bytes

    if not torch.cuda.is_available():
        return None
    memory = gpu_memory_bytes(min(ranks, torch.cuda.device_count()))
    return None if memory is None else [free for free, _ in memory]


def check_gpu_fits(ranks: int, rank_bytes: int, what: str, fix: str) -> None:
    """Refuse, before any rank starts, ``ranks`` processes of ``rank_bytes`` device bytes each (``what``: what
    those bytes are) where the GPUs they would share round-robin have less free; ``fix``: what to run instead."""
    free = gpu_free_bytes(ranks)
    for device, have in enumerate(free or ()):
        sharing = len(range(device, ranks, len(free)))  # ranks device, device + count, ...
        if sharing * rank_bytes > have:
            placed = f"{sharing} ranks share cuda:{device}" if sharing > 1 else f"one rank on cuda:{device}"
            raise ValueError(f"each of {ranks} rank processes needs about {size(rank_bytes)} on its GPU ({what}); "
                             f"{placed}, which has {size(have)} free; {fix}")


def size(nbytes: float) -> str:
    """``nbytes`` in GiB, or MiB below one GiB (a tiny model's pool reads 0.0 GiB otherwise)."""
    return f"{nbytes / 2**30:,.1f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:,.1f} MiB"


def check_sweep_gpu_fits(cfg, fix: str) -> None:
    """The measured sweep's device memory per rank, from its config (the arithmetic of
    :func:`layersplit.api.check_fits`, whose host tier stays in host memory): the engine's fp32 weights and
    a pool of every layer for the largest batch (a LayerSplit rank holds fewer layers: a bound)."""
    from dsa_kernels.layout import PAGE_SIZE
    from layersplit.engine.prefill import cache_bytes, weight_bytes
    from layersplit.plan.config import load_model

    model = load_model(cfg.model)
    batch_tokens = max(cfg.scaled(cfg.max_batch_context), cfg.scaled(max(cfg.lengths)))  # one request always fits
    pages = -(-batch_tokens // PAGE_SIZE) + cfg.max_batch_requests  # each request may end in a partial page
    weights, pool = weight_bytes(model), cache_bytes(model, pages, cfg.kv_dtype)
    check_gpu_fits(cfg.cp, weights + pool, f"{model.name}'s fp32 weights, {size(weights)}, and a KV pool of "
                   f"{size(pool)} ({cfg.kv_dtype}) for a batch of {batch_tokens:,} tokens", fix)
