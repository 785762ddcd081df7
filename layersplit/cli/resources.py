"""Resources before work: what a command needs of this machine, checked or said before it starts.

* :func:`check_machine_env`: the ``LAYERSPLIT_*`` variables this machine cannot honour (NCCL without CUDA,
  Triton on a CPU without its interpreter), for the commands that run kernels or CP ranks here;
* :func:`check_storm_fits`: a long ``stress pd`` storm's memory and run time, from a short measurement;
* :func:`eta_printer`: a long run's expected duration, said once on stderr after its first seconds.

The sweep's measured engine is sized from its config (:func:`layersplit.api.check_fits`).
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
