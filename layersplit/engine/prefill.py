"""One CP prefill from plain arguments, checked against the single-process reference.

:func:`prefill` is what ``layersplit prefill`` and the Python API run: build ``requests`` requests
of ``context_len`` tokens (a ``hit`` share cached), size the pools for them, run ``cp`` rank
processes (gloo on CPU, NCCL on CUDA), run the single-process reference, and return a
:class:`PrefillReport`. Every argument is checked, and the weights and caches the run would
allocate are compared with the memory this machine has, **before** any process starts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

from dsa_kernels.layout import PAGE_SIZE
from layersplit.engine.batch_plan import SPLITS
from layersplit.engine.cp_pool import MODES
from layersplit.plan.choices import ENGINE_KV_DTYPES, TIMEOUT_MAX_S
from layersplit.plan.modes import scratch_pages_for
from layersplit.plan.ownership import STRATEGIES, plan_ownership
from layersplit.plan.config import ModelConfig, load_model

SEED_MAX = 2**63 - 1


@dataclass
class PrefillReport:
    model: str
    cp: int
    mode: str
    ownership: str
    split: str
    requests: int
    context_len: int
    hit: float
    new_tokens: int
    prefill_seconds: float  # measured: the slowest rank's prefill
    new_tokens_per_s: float  # the new tokens of all requests per prefill second (per run)
    kv_bytes_per_rank: list[dict]
    bcast_bytes_per_layer: dict  # rank 0's: what it sent or received, per layer
    max_abs_deviation_vs_reference: float
    measured_on: str
    kv_dtype: str = "bf16"  # the MLA cache rows (the reference's too)
    bcast_kv_bytes_per_layer: dict = field(default_factory=dict)  # the KV part of bcast_bytes_per_layer
    schedule: str = "overlapped"
    host_tier: bool = False  # the prefixes were reloaded from the host tier during the prefill
    kernel_backend: str = "torch"  # what dispatch picked for the engine's ops on this device
    # the torch-reference engine's output vs this run's (None: this run already used the torch reference)
    max_abs_deviation_vs_torch_engine: float | None = None
    # non-owned indexer layers (all ranks) whose indexer happens after the layer's KV broadcast, in the
    # issued program's happens-before order: 0 of N is the overlap; N of N is a serialized schedule
    indexer_waits_for_kv_bcast: str = ""
    bcast_wait_ms_per_rank: list[float] = field(default_factory=list)  # compute-stream stalls on broadcasts
    sanitizer_hazards: int | None = None  # None: not sanitized (LAYERSPLIT_SANITIZE unset)
    sanitizer_hazard_list: list[str] = field(default_factory=list)
    # every context token of the requests, cached prefix included, per second of the same wall time (per run)
    request_tokens_per_s: float = 0.0
    # rank 0's new rows' all-gather, per layer: bytes received from the other ranks, and their KV part
    allgather_bytes_per_layer: dict = field(default_factory=dict)
    allgather_kv_bytes_per_layer: dict = field(default_factory=dict)
    trace_events: list[dict] = field(default_factory=list, repr=False)

    def as_dict(self) -> dict:
        """The report as plain data (the CLI's ``--json``), with ``count_scope``: whose each count is."""
        d = asdict(self)
        d.pop("trace_events")
        if self.sanitizer_hazards is None:
            d.pop("sanitizer_hazards")
            d.pop("sanitizer_hazard_list")
        d["count_scope"] = {k: v for k, v in COUNT_SCOPE.items() if k in d}
        return d


# whose each count of a report is: the run's (all ranks together), one rank's, or a list with one per rank
COUNT_SCOPE = {
    "new_tokens": "per run (all requests)",
    "prefill_seconds": "per run (the slowest rank)",
    "new_tokens_per_s": "per run", "request_tokens_per_s": "per run",
    "kv_bytes_per_rank": "per rank (one entry per rank)",
    "bcast_bytes_per_layer": "rank 0, per layer (sent or received)",
    "bcast_kv_bytes_per_layer": "rank 0, per layer (sent or received)",
    "allgather_bytes_per_layer": "rank 0, per layer (received from the other ranks)",
    "allgather_kv_bytes_per_layer": "rank 0, per layer (received from the other ranks)",
    "bcast_wait_ms_per_rank": "per rank (one entry per rank)",
    "indexer_waits_for_kv_bcast": "per run (all ranks)",
    "max_abs_deviation_vs_reference": "per run (all new tokens)",
    "max_abs_deviation_vs_torch_engine": "per run (all new tokens)",
    "sanitizer_hazards": "per run (all ranks and the reference, distinct)",
}


def weight_bytes(model: ModelConfig) -> int:
    """fp32 bytes of the engine's model weights (:class:`layersplit.engine.model.TinyDSA`: dense MLPs,
    no experts), computed from the config without allocating."""
    c = model
    qk = c.qk_nope_head_dim + c.qk_rope_head_dim
    per_layer = (c.hidden_size * c.q_lora_rank + c.q_lora_rank * c.num_heads * qk
                 + c.hidden_size * (c.kv_lora_rank + c.qk_rope_head_dim)
                 + c.kv_lora_rank * c.num_heads * (c.qk_nope_head_dim + c.v_head_dim)
                 + c.num_heads * c.v_head_dim * c.hidden_size
                 + c.q_lora_rank * c.index_n_heads * c.index_head_dim
                 + c.hidden_size * (c.index_head_dim + c.index_n_heads)
                 + 3 * c.hidden_size * c.intermediate_size)
    return 4 * (c.vocab_size * c.hidden_size + c.num_layers * per_layer)


def cache_bytes(model: ModelConfig, pool_pages: int, kv_dtype: str = "bf16") -> int:
    """Bytes of a pool holding every layer for ``pool_pages`` pages (the reference's pool, and the
    most any rank holds: a layersplit rank holds fewer layers plus two scratch slots)."""
    per_token = sum(model.layer_bytes_per_token(layer, kv_dtype) for layer in range(model.num_layers))
    return pool_pages * PAGE_SIZE * per_token


def available_memory_bytes() -> int | None:
    """``MemAvailable`` from ``/proc/meminfo`` (None where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def rank_cache_bytes(model: ModelConfig, *, cp: int, mode: str, ownership: str, pool_pages: int, scratch_pages: int,
                     kv_dtype: str = "bf16") -> int:
    """Cache bytes of the rank that holds the most, as :class:`layersplit.engine.cp_pool.CPPool` allocates
    them: every layer (``redundant``, or one rank), else its owned layers plus two scratch slots of
    ``scratch_pages`` pages of the widest layer it does not own."""
    page = [PAGE_SIZE * model.layer_bytes_per_token(layer, kv_dtype) for layer in range(model.num_layers)]
    if mode == "redundant" or cp == 1:
        return pool_pages * sum(page)
    own = plan_ownership(model.num_layers, cp, ownership)

    def held(rank: int) -> int:
        owned = set(own.owned_layers(rank))
        remote = [page[layer] for layer in range(model.num_layers) if layer not in owned]
        return pool_pages * sum(page[layer] for layer in owned) + (2 * scratch_pages * max(remote) if remote else 0)
    return max(held(rank) for rank in range(cp))


# the probe runs in a child: torch.cuda.mem_get_info here would create a CUDA context in this process that
# lives through the whole run (memory the ranks then lack; a device they cannot open in exclusive-process mode)
_GPU_PROBE = ("import json, sys, torch; print(json.dumps([[*torch.cuda.mem_get_info(d), "
              "*torch.cuda.get_device_capability(d)] for d in range(int(sys.argv[1]))]))")


@dataclass(frozen=True)
class GpuFacts:
    """One CUDA device as the probe read it: free and total bytes, compute capability ``(major, minor)``."""

    free: int
    total: int
    capability: tuple[int, int]


def rank_devices(cp: int) -> int:
    """How many CUDA devices ``cp`` ranks use (rank ``r`` on device ``r % count``, as the rank worker places
    them); 1 where there is no CUDA (the probe then answers None)."""
    import torch

    return min(cp, max(1, torch.cuda.device_count())) if torch.cuda.is_available() else 1


def probe_gpus(devices: int) -> list[GpuFacts] | None:
    """:class:`GpuFacts` of CUDA devices ``0 .. devices - 1``, read in ONE child process, or None where there
    is no CUDA or the probe fails (the ranks' own allocations and launches say it then). The seam a CPU test
    replaces; :func:`prefill` calls it once and hands the facts to each device check."""
    import torch

    if not torch.cuda.is_available():
        return None
    try:
        probe = subprocess.run([sys.executable, "-c", _GPU_PROBE, str(devices)], capture_output=True, text=True,
                               timeout=120, check=True)
        rows = json.loads(probe.stdout.strip().splitlines()[-1])
        return [GpuFacts(int(free), int(total), (int(major), int(minor))) for free, total, major, minor in rows]
    except (OSError, subprocess.SubprocessError, ValueError, IndexError, TypeError) as exc:
        # the memory and capability checks are off for this run: say so (the ranks' own gates still refuse)
        print(f"layersplit: the GPU probe failed ({type(exc).__name__}): GPU memory and compute capability are "
              "not checked before the ranks start", file=sys.stderr, flush=True)
        return None


def gpu_memory_bytes(devices: int) -> list[tuple[int, int]] | None:
    """``(free, total)`` bytes of CUDA devices ``0 .. devices - 1`` (:func:`probe_gpus`), or None off CUDA.
    For callers outside :func:`prefill` (``layersplit.cli.resources.gpu_free_bytes``)."""
    facts = probe_gpus(devices)
    return None if facts is None else [(gpu.free, gpu.total) for gpu in facts]


def check_kernel_devices(gpus: list[GpuFacts] | None, kv_dtype: str) -> None:
    """Refuse, before any process starts, a device the engine's kernels cannot compile for: on CUDA the
    ranks run Triton (or vendor, whose sparse-MLA fallback is Triton) kernels that use e4m3
    (:func:`dsa_kernels.triton_ops.fp8_gate.e4m3_ops`: the index keys in every KV dtype, the MLA cache
    too at fp8), which need sm89+. With ``LAYERSPLIT_KERNEL_BACKEND=torch`` they run the torch reference
    and any device passes. ``gpus``: :func:`probe_gpus`' facts (None: no CUDA, nothing to check)."""
    if not gpus:
        return
    from dsa_kernels.dispatch import resolve
    from dsa_kernels.triton_ops import fp8_gate
    from lsconfig import envs

    compiled = [op for op in fp8_gate.e4m3_ops(kv_dtype) if resolve(op, "cuda")[0] != "torch"]
    low = next(((d, gpu.capability) for d, gpu in enumerate(gpus) if fp8_gate.below_e4m3(gpu.capability)), None)
    if not compiled or low is None:
        return
    device, (major, minor) = low
    need = "index keys are e4m3 in every KV dtype" + (", and so is the fp8 MLA cache" if kv_dtype == "fp8" else "")
    raise ValueError(f"LAYERSPLIT_KERNEL_BACKEND: {envs.kernel_backend()} picks Triton for {', '.join(compiled)} "
                     f"({need}), whose e4m3 needs sm89+ (Ada/Hopper/Blackwell), got sm{major}{minor} on cuda:{device}; "
                     "set LAYERSPLIT_KERNEL_BACKEND=torch to run the torch reference kernels (--kv-dtype bf16 alone "
                     "does not avoid e4m3)")


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:,.2f} GiB"


def check_gpu_memory(model: ModelConfig, *, cp: int, mode: str, ownership: str, requests: int, context_len: int,
                     kv_dtype: str, gpus: list[GpuFacts] | None) -> None:
    """Where the ranks run on CUDA (rank ``r`` on device ``r % count``, as the rank worker places them): each
    device's free memory (``gpus``: :func:`probe_gpus`' facts, None off CUDA) against the fp32 weights and
    caches of the ranks it holds, and on device 0 against the single-process reference's too (every layer;
    it runs there after them). Refused in one line naming ``context_len`` with the largest that fits, or
    ``model`` where none does."""
    if not gpus:
        return
    memory = [(gpu.free, gpu.total) for gpu in gpus]

    def pages(tokens: int) -> int:
        return requests * -(-tokens // PAGE_SIZE)

    def rank_bytes(tokens: int) -> int:
        return weight_bytes(model) + rank_cache_bytes(model, cp=cp, mode=mode, ownership=ownership,
                                                      pool_pages=pages(tokens), kv_dtype=kv_dtype,
                                                      scratch_pages=scratch_pages_for(requests * tokens, requests))

    def need(device: int, tokens: int) -> int:
        reference = weight_bytes(model) + cache_bytes(model, pages(tokens), kv_dtype) if device == 0 else 0
        return max(len(range(device, cp, len(memory))) * rank_bytes(tokens), reference)

    for device, (free, total) in enumerate(memory):
        if need(device, context_len) <= free:
            continue
        low, high = 1, context_len  # bisect: the largest context that fits (1: none of >= 2 tokens does)
        while high - low > 1:
            mid = (low + high) // 2
            low, high = (mid, high) if need(device, mid) <= free else (low, mid)
        where = (f"cuda:{device} has {_gib(free)} free of {_gib(total)} and needs {_gib(need(device, context_len))}: "
                 f"{len(range(device, cp, len(memory)))} rank process(es) of {_gib(rank_bytes(context_len))} each "
                 f"({model.name}'s fp32 weights and {kv_dtype} caches for {requests} x {context_len:,} tokens)"
                 + (", then the single-process reference (every layer)" if device == 0 else ""))
        if low < 2:
            raise ValueError(f"model: {model.name!r} does not fit any context: {where}; use a smaller model (tiny)")
        raise ValueError(f"context_len: expected <= {low:,} on this GPU, got {context_len:,}: {where}")


def check_arguments(model: ModelConfig, *, cp: int, mode: str, ownership: str, split: str, requests: int,
                    context_len: int, hit: float, seed: int, kv_dtype: str = "bf16", timeout_s: float = 600.0) -> None:
    """The arguments of :func:`prefill` that describe the batch; raises ``ValueError`` naming the argument (the
    CLI's flag is the same name with dashes). Whether the run fits this machine: :func:`check_memory`."""
    for name, value, low in (("cp", cp, 1), ("requests", requests, 1), ("context_len", context_len, 2)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name}: expected an integer >= {low}, got {value!r}")
    for name, value, allowed in (("mode", mode, MODES), ("ownership", ownership, STRATEGIES), ("split", split, SPLITS),
                                 ("kv_dtype", kv_dtype, ENGINE_KV_DTYPES)):
        if value not in allowed:
            raise ValueError(f"{name}: expected one of {allowed}, got {value!r}")
    if not (isinstance(hit, (int, float)) and 0 <= hit < 1):
        raise ValueError(f"hit: expected a number in [0, 1), got {hit!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= SEED_MAX:
        raise ValueError(f"seed: expected an integer in [0, 2**63 - 1], got {seed!r}")
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s <= TIMEOUT_MAX_S:
        raise ValueError(f"timeout_s: expected a number of seconds in (0, {TIMEOUT_MAX_S}], got {timeout_s!r}")
    if cp > model.num_layers:
        raise ValueError(f"cp: expected <= {model.num_layers} (the layers of {model.name}, so every rank owns one), got {cp}")
    plan_ownership(model.num_layers, cp, ownership)


def check_memory(model: ModelConfig, *, cp: int, mode: str, ownership: str, requests: int, context_len: int,
                 kv_dtype: str = "bf16", gpus: list[GpuFacts] | None = None) -> None:
    """Whether the run fits this machine, from the config before anything is allocated: host memory (every
    process's fp32 weights and caches), then, where the ranks run on CUDA, each GPU's (:func:`check_gpu_memory`,
    from ``gpus``: :func:`probe_gpus`' facts; None: none to check); raises ``ValueError`` naming the argument
    to change."""
    pool_pages = requests * -(-context_len // PAGE_SIZE)
    processes = cp + 1  # the rank processes and the reference in this one
    caches = cache_bytes(model, pool_pages, kv_dtype)
    need = processes * weight_bytes(model) + 2 * caches
    have = available_memory_bytes()
    if have is not None and need > have:
        raise ValueError(f"model {model.name!r} with context_len {context_len} x {requests} request(s): the engine "
                         f"keeps fp32 weights ({weight_bytes(model) / 2**30:,.1f} GiB) in each of {processes} "
                         f"processes and {kv_dtype} caches of about {caches / 2**30:,.1f} GiB, "
                         f"{need / 2**30:,.1f} GiB in all; this machine has {have / 2**30:,.1f} GiB available "
                         "(on a CPU use --model tiny)")
    check_gpu_memory(model, cp=cp, mode=mode, ownership=ownership, requests=requests, context_len=context_len,
                     kv_dtype=kv_dtype, gpus=gpus)


@contextmanager
def kernel_backend(choice: str):
    """Run the enclosed work with ``LAYERSPLIT_KERNEL_BACKEND=choice`` (restored after); rank processes
    started inside inherit it."""
    old = os.environ.get("LAYERSPLIT_KERNEL_BACKEND")
    os.environ["LAYERSPLIT_KERNEL_BACKEND"] = choice
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("LAYERSPLIT_KERNEL_BACKEND")
        else:
            os.environ["LAYERSPLIT_KERNEL_BACKEND"] = old


def _kv_order_summary(result) -> str:
    orders = [o["indexer"] for r in result.ranks for o in r.kv_order.values() if "indexer" in o]
    return f"{sum(orders)} of {len(orders)}"


def prefill(model: str | ModelConfig = "tiny", *, cp: int = 2, mode: str = "layersplit", context_len: int = 8192,
            hit: float = 0.9, requests: int = 1, seed: int = 0, ownership: str = "contiguous",
            split: str = "zigzag", trace: bool = False, progress=None, schedule: str = "overlapped",
            bcast_kv_delay_ms: float = 0.0, host_tier: bool = False, kv_dtype: str = "bf16",
            timeout_s: float = 600.0) -> PrefillReport:
    """Prefill ``requests`` synthetic requests on ``cp`` rank processes and check the result against
    the single-process reference (``max_abs_deviation_vs_reference``; when the kernels are not the
    torch reference, also against the torch-reference engine). ``trace``: keep every rank's trace
    events (``report.trace_events``, for :func:`layersplit.engine.trace.write_trace`).
    ``schedule``: ``overlapped`` (default) or ``legacy`` (one FIFO comm stream); ``bcast_kv_delay_ms``
    stalls every KV broadcast (to see what the schedule hides); ``host_tier``: the cached prefixes are
    reloaded from each rank's host tier layer by layer during the prefill (HiCache). ``kv_dtype``: the MLA
    cache rows, ``bf16`` (default) or ``fp8`` (the reference then runs fp8 too; see
    :mod:`layersplit.engine.engine` for which bytes agree where). ``timeout_s``: how long the rank
    processes may take (default 600 s; the CLI's ``--timeout-s``), a ``TimeoutError`` naming it after that.
    ``progress(stage: str)``: told when each stage starts (the run takes seconds to minutes on a CPU).

    Before any process starts: every argument, the ``LAYERSPLIT_*`` variables (as the CLI checks them:
    ``lsconfig.envs``), the memory the run needs (:func:`check_memory`) and, on CUDA, whether each device
    compiles the kernels that will run (:func:`check_kernel_devices`; both device checks read one child
    probe, :func:`probe_gpus`), each a ``ValueError`` naming the argument or variable. The report's throughputs: ``new_tokens_per_s`` (the new tokens) and
    ``request_tokens_per_s`` (every context token, cached prefix included), both per second of the slowest
    rank's prefill."""
    import torch

    from dsa_kernels.dispatch import resolve
    from lsconfig import envs
    from layersplit.engine.engine import SCHEDULES, EngineConfig, FaultInjection
    from layersplit.engine.launcher import Scenario, run_cp, run_reference
    from layersplit.engine.requests import synthetic_requests

    cfg_model = model if isinstance(model, ModelConfig) else load_model(model)
    check_arguments(cfg_model, cp=cp, mode=mode, ownership=ownership, split=split, requests=requests,
                    context_len=context_len, hit=hit, seed=seed, kv_dtype=kv_dtype, timeout_s=timeout_s)
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule: expected one of {SCHEDULES}, got {schedule!r}")
    if isinstance(bcast_kv_delay_ms, bool) or not isinstance(bcast_kv_delay_ms, (int, float)) \
            or not 0 <= bcast_kv_delay_ms <= 10_000:
        raise ValueError(f"bcast_kv_delay_ms: expected a number in [0, 10000], got {bcast_kv_delay_ms!r}")
    if not isinstance(host_tier, bool):
        raise ValueError(f"host_tier: expected True or False, got {host_tier!r}")
    envs.check_all()  # every LAYERSPLIT_* variable, as the CLI checks them, before any process starts
    envs.check_machine(torch.cuda.is_available())
    gpus = probe_gpus(rank_devices(cp))  # one child process: both device checks below read its facts
    check_memory(cfg_model, cp=cp, mode=mode, ownership=ownership, requests=requests, context_len=context_len,
                 kv_dtype=kv_dtype, gpus=gpus)
    check_kernel_devices(gpus, kv_dtype)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    backend = resolve("indexer_scores", device)[0]
    reqs = synthetic_requests(requests, context_len, hit, cfg_model.vocab_size, seed, from_host=host_tier)
    cfg = EngineConfig(mode=mode, cp=cp, ownership=ownership, split=split,
                       pool_pages=requests * -(-context_len // PAGE_SIZE), max_batch_tokens=requests * context_len,
                       max_requests=requests, trace=trace, schedule=schedule, kv_dtype=kv_dtype,
                       faults=FaultInjection(bcast_kv_delay_s=bcast_kv_delay_ms / 1e3))
    scenario = Scenario("prefill", reqs, cfg)
    say = progress or (lambda stage: None)
    say(f"prefill on {cp} rank process(es) ({mode})")
    try:
        result = run_cp(cfg_model, [scenario], cp, timeout_s=timeout_s,
                        on_ready=lambda: say(f"{cp} rank(s) joined the group, computing"))[0]
    except TimeoutError:
        raise TimeoutError(f"timeout_s: the {cp} rank process(es) gave no result within {timeout_s:g} s (they were "
                           "ended); raise it: Triton's interpreter, fp8 or a loaded machine can take longer") from None
    say("single-process reference")
    reference = run_reference(cfg_model, scenario)
    vs_torch = None
    if backend != "torch":
        say("single-process reference on the torch kernels")
        with kernel_backend("torch"):
            vs_torch = float((result.hidden - run_reference(cfg_model, scenario).hidden).abs().max())
    return _report(cfg_model, scenario, result, reference, context_len=context_len, hit=hit, host_tier=host_tier,
                   backend=backend, vs_torch=vs_torch, trace=trace)


def _report(model: ModelConfig, scenario, result, reference, *, context_len: int, hit: float, host_tier: bool,
            backend: str, vs_torch: float | None, trace: bool) -> PrefillReport:
    """The report of a finished run: its counts, each per run or per rank as :data:`COUNT_SCOPE` says."""
    import torch

    from layersplit.engine.launcher import cp_backend

    cfg, reqs, rank0 = scenario.cfg, scenario.requests, result.ranks[0]
    new_tokens = sum(len(r.new_tokens) for r in reqs)
    request_tokens = sum(r.prefix_len + len(r.new_tokens) for r in reqs)
    shared = cfg.cp > 1  # at cp 1 nothing is broadcast or gathered
    report = PrefillReport(
        model=model.name, cp=cfg.cp, mode=cfg.mode, ownership=cfg.ownership, split=cfg.split, requests=len(reqs),
        context_len=context_len, hit=hit, new_tokens=new_tokens,
        prefill_seconds=result.seconds, new_tokens_per_s=new_tokens / result.seconds,
        request_tokens_per_s=request_tokens / result.seconds, kv_bytes_per_rank=[r.kv_bytes for r in result.ranks],
        kv_dtype=cfg.kv_dtype, bcast_bytes_per_layer=rank0.bcast_bytes if shared else {},
        bcast_kv_bytes_per_layer=rank0.bcast_kv_bytes if shared else {},
        allgather_bytes_per_layer=rank0.allgather_bytes, allgather_kv_bytes_per_layer=rank0.allgather_kv_bytes,
        max_abs_deviation_vs_reference=float((result.hidden - reference.hidden).abs().max()),
        measured_on=f"cuda ({cp_backend(cfg.cp)})" if torch.cuda.is_available() else "cpu (gloo, emulated streams)",
        schedule=cfg.schedule, host_tier=host_tier, kernel_backend=backend,
        max_abs_deviation_vs_torch_engine=vs_torch, indexer_waits_for_kv_bcast=_kv_order_summary(result),
        bcast_wait_ms_per_rank=[round(r.bcast_wait_s * 1e3, 3) for r in result.ranks],
        trace_events=[e for r in result.ranks for e in r.trace] if trace else [])
    if rank0.hazards is not None:  # LAYERSPLIT_SANITIZE=1: every rank and the reference
        hazards = sorted({h for r in [*result.ranks, *reference.ranks] for h in r.hazards})
        report.sanitizer_hazards, report.sanitizer_hazard_list = len(hazards), hazards
    return report


__all__ = ["GpuFacts", "PrefillReport", "available_memory_bytes", "cache_bytes", "check_arguments",
           "check_kernel_devices", "check_memory", "gpu_memory_bytes", "kernel_backend", "prefill", "probe_gpus",
           "rank_cache_bytes", "weight_bytes"]
