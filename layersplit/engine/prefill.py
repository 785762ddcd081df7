"""One CP prefill from plain arguments, checked against the single-process reference.

:func:`prefill` is what ``layersplit prefill`` and the Python API run: build ``requests`` requests
of ``context_len`` tokens (a ``hit`` share cached), size the pools for them, run ``cp`` rank
processes (gloo on CPU, NCCL on CUDA), run the single-process reference, and return a
:class:`PrefillReport`. Every argument is checked, and the weights and caches the run would
allocate are compared with the memory this machine has, **before** any process starts.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

from dsa_kernels.layout import PAGE_SIZE
from layersplit.engine.batch_plan import SPLITS
from layersplit.engine.cp_pool import MODES
from layersplit.plan.choices import ENGINE_KV_DTYPES
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
    tokens_per_s: float
    kv_bytes_per_rank: list[dict]
    bcast_bytes_per_layer: dict
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
    trace_events: list[dict] = field(default_factory=list, repr=False)

    def as_dict(self) -> dict:
        d = asdict(self)
        d.pop("trace_events")
        if self.sanitizer_hazards is None:
            d.pop("sanitizer_hazards")
            d.pop("sanitizer_hazard_list")
        return d


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


def check_arguments(model: ModelConfig, *, cp: int, mode: str, ownership: str, split: str, requests: int,
                    context_len: int, hit: float, seed: int, kv_dtype: str = "bf16") -> None:
    """Every argument of :func:`prefill`, and whether the run fits this machine; raises ``ValueError``
    naming the argument (the CLI's flag is the same name with dashes)."""
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
    if cp > model.num_layers:
        raise ValueError(f"cp: expected <= {model.num_layers} (the layers of {model.name}, so every rank owns one), got {cp}")
    plan_ownership(model.num_layers, cp, ownership)
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


@contextmanager
def _kernel_backend(choice: str):
    """Run the enclosed in-process work with ``LAYERSPLIT_KERNEL_BACKEND=choice`` (restored after)."""
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
            bcast_kv_delay_ms: float = 0.0, host_tier: bool = False, kv_dtype: str = "bf16") -> PrefillReport:
    """Prefill ``requests`` synthetic requests on ``cp`` rank processes and check the result against
    the single-process reference (``max_abs_deviation_vs_reference``; when the kernels are not the
    torch reference, also against the torch-reference engine). ``trace``: keep every rank's trace
    events (``report.trace_events``, for :func:`layersplit.engine.trace.write_trace`).
    ``schedule``: ``overlapped`` (default) or ``legacy`` (one FIFO comm stream); ``bcast_kv_delay_ms``
    stalls every KV broadcast (to see what the schedule hides); ``host_tier``: the cached prefixes are
    reloaded from each rank's host tier layer by layer during the prefill (HiCache). ``kv_dtype``: the MLA
    cache rows, ``bf16`` (default) or ``fp8`` (the reference then runs fp8 too: same bytes, same numerics).
    ``progress(stage: str)``: told when each stage starts (the run takes seconds to minutes on a CPU)."""
    import torch

    from dsa_kernels.dispatch import resolve
    from layersplit.engine.engine import SCHEDULES, EngineConfig, FaultInjection
    from layersplit.engine.launcher import Scenario, cp_backend, run_cp, run_reference
    from layersplit.engine.requests import synthetic_requests

    cfg_model = model if isinstance(model, ModelConfig) else load_model(model)
    check_arguments(cfg_model, cp=cp, mode=mode, ownership=ownership, split=split, requests=requests,
                    context_len=context_len, hit=hit, seed=seed, kv_dtype=kv_dtype)
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule: expected one of {SCHEDULES}, got {schedule!r}")
    if isinstance(bcast_kv_delay_ms, bool) or not isinstance(bcast_kv_delay_ms, (int, float)) \
            or not 0 <= bcast_kv_delay_ms <= 10_000:
        raise ValueError(f"bcast_kv_delay_ms: expected a number in [0, 10000], got {bcast_kv_delay_ms!r}")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    backend = resolve("indexer_scores", device)[0]
    if not isinstance(host_tier, bool):
        raise ValueError(f"host_tier: expected True or False, got {host_tier!r}")
    reqs = synthetic_requests(requests, context_len, hit, cfg_model.vocab_size, seed, from_host=host_tier)
    cfg = EngineConfig(mode=mode, cp=cp, ownership=ownership, split=split,
                       pool_pages=requests * -(-context_len // PAGE_SIZE), max_batch_tokens=requests * context_len,
                       max_requests=requests, trace=trace, schedule=schedule, kv_dtype=kv_dtype,
                       faults=FaultInjection(bcast_kv_delay_s=bcast_kv_delay_ms / 1e3))
    scenario = Scenario("prefill", reqs, cfg)
    say = progress or (lambda stage: None)
    say(f"prefill on {cp} rank process(es) ({mode})")
    result = run_cp(cfg_model, [scenario], cp, on_ready=lambda: say(f"{cp} rank(s) joined the group, computing"))[0]
    say("single-process reference")
    reference = run_reference(cfg_model, scenario)
    vs_torch = None
    if backend != "torch":
        say("single-process reference on the torch kernels")
        with _kernel_backend("torch"):
            vs_torch = float((result.hidden - run_reference(cfg_model, scenario).hidden).abs().max())
    new_tokens = sum(len(r.new_tokens) for r in reqs)
    report = PrefillReport(
        model=cfg_model.name, cp=cp, mode=mode, ownership=ownership, split=split, requests=requests,
        context_len=context_len, hit=hit, new_tokens=new_tokens, prefill_seconds=result.seconds,
        tokens_per_s=new_tokens / result.seconds, kv_bytes_per_rank=[r.kv_bytes for r in result.ranks],
        kv_dtype=kv_dtype, bcast_bytes_per_layer=result.ranks[0].bcast_bytes if cp > 1 else {},
        bcast_kv_bytes_per_layer=result.ranks[0].bcast_kv_bytes if cp > 1 else {},
        max_abs_deviation_vs_reference=float((result.hidden - reference.hidden).abs().max()),
        measured_on=f"cuda ({cp_backend(cp)})" if torch.cuda.is_available() else "cpu (gloo, emulated streams)",
        schedule=schedule, host_tier=host_tier, kernel_backend=backend, max_abs_deviation_vs_torch_engine=vs_torch,
        indexer_waits_for_kv_bcast=_kv_order_summary(result),
        bcast_wait_ms_per_rank=[round(r.bcast_wait_s * 1e3, 3) for r in result.ranks],
        trace_events=[e for r in result.ranks for e in r.trace] if trace else [])
    if result.ranks[0].hazards is not None:  # LAYERSPLIT_SANITIZE=1: every rank and the reference
        hazards = sorted({h for r in [*result.ranks, *reference.ranks] for h in r.hazards})
        report.sanitizer_hazards, report.sanitizer_hazard_list = len(hazards), hazards
    return report


__all__ = ["PrefillReport", "available_memory_bytes", "cache_bytes", "check_arguments", "prefill", "weight_bytes"]
