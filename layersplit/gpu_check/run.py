"""One prepared GPU check: prove and time every CUDA path in one command, inside a fixed time budget.

Sections (each a function returning a dict; one that raises is recorded as failed and the run goes on):

1. ``environment``     device, torch / triton / CUDA versions, vendor kernels importable (their JIT
                       builds warmed here, outside every timed section), H200 peaks;
2. ``kernels``         every CUDA-shaped case held to its op's input contract on the meta device (any
                       machine), then every ``dsa_kernels`` op through each backend (vendor where
                       importable, naming the kernel that really ran; Triton; torch reference = the
                       oracle) on GLM-5-sized shapes, checked with the tolerance of the path that ran
                       (sparse MLA over the bf16 and the fp8 656-byte cache; fp8 also against the bf16
                       cache's output), then timed (median of >= 10 after warm-up, CUDA events);
2b. ``vendor``         GPU only: FlashMLA's lse base measured for the installed ``sgl_kernel`` and its
                       gating matrix; FlashInfer top-k vs the torch reference (sets equal up to ties);
3. ``hicache_stress``  read-before-ready stress on the streams, checked as a valid top-k and as attention
                       given the forward's own indices (immune to tie order): 0 corruptions with every
                       wait, and on CUDA each dropped wait detected (``--unsafe-skip-wait``);
4. ``hicache_overlap`` layer-wise load pipelined under the forward vs serial (pinned host memory);
5. ``cp_engine``       the LayerSplit prefill engine on 2 ranks (on one GPU: gloo with CUDA tensors,
                       NCCL refuses two ranks per device) against the single-rank reference, held to a
                       floor measured on this device (:mod:`.agreement`), in bf16 and then in fp8 KV
                       (:mod:`.cp_dtypes`: seconds; reported beside the verdict, never in it, the KV
                       bytes broadcast per layer as the engine counted them and the kernel each op is
                       predicted to run; fp8 skipped with the reason where it does not fit); the
                       happens-before order of both schedules; the KV-broadcast overlap **measured** in one process on this
                       device's streams with the collectives replaced by link-timed copies
                       (:mod:`.link_overlap`; the 2-process gloo timings on one GPU are host-serialized
                       and reported without a verdict); the fp8 key bytes of Triton vs torch;
6. ``stream_sanitizer`` the HiCache stress and the 2-rank CP engine under PyTorch's CUDA sanitizer (in
                       a child process; our kernels are registered ops it sees), with its teeth: each
                       dropped edge must be reported (:mod:`.sanitize`; on the CPU: the emulated-runtime
                       sanitizer).

Modes: ``cuda`` (CUDA present, no ``--dry-run``) uses GLM-5 shapes; ``cpu-dry-run`` uses tiny shapes,
the Triton interpreter and emulated streams so CI keeps the script working (timings are CPU wall
time, not representative). Below sm89 (no e4m3 in Triton: ``dsa_kernels.triton_ops.fp8_gate``) every
kernel row whose Triton kernel uses e4m3 is skipped with the gate's reason, not counted; ``cp_engine``
runs on the torch reference kernels and the sections that check the Triton engine's own behaviour
(``TRITON_KERNEL_SECTIONS``) are skipped, not counted. A :class:`Deadline` skips, with a recorded
reason, every section whose estimate no longer fits the budget (default 480 s); in ``cuda`` mode a
watchdog writes the report, ends the check's child process groups and exits at budget + 25 s whatever
is running. ``sections`` (``--sections``) runs only those (``environment`` always runs): a rerun
takes what failed. Outputs in ``--out`` (flat, 2 files): ``gpu_check.json`` (rewritten after every
section) and ``gpu_check.md``; verdict and exit status: :mod:`.report`. Example::

    python benchmarks/gpu_check.py --out /tmp/gpu-check            # or: layersplit gpu-check --out DIR
    python benchmarks/gpu_check.py --out /tmp/gpu-check --dry-run  # tiny shapes on the CPU
    layersplit gpu-check --out /tmp/gpu-check --sections kernels,cp_engine
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
import threading
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

from layersplit.gpu_check import children
from lsconfig import envs
from layersplit.gpu_check.cases import CASE_BUILDERS, OpCase, Shapes, _ref, check_case_contracts, vendor_checks
from layersplit.gpu_check.report import CPU_TIMING_NOTE, JSON_NAME, MD_NAME, exit_code, write_json, write_outputs

BUDGET_S = 480  # default budget: with the watchdog's grace, inside a 10-minute device command and a 15-minute lease
WATCHDOG_GRACE_S = 25  # cuda mode: hard exit this long after the budget, whatever is running
SANITIZE_LOADS = {"cuda": 400, "cpu-dry-run": 64}
__all__ = ["JSON_NAME", "MD_NAME", "SECTIONS", "exit_code", "print_end", "run_check"]


CUDA_SHAPES = Shapes(
    index_tokens=1024, index_heads=32, index_dim=128, context=32768, attn_tokens=512, attn_heads=64,
    kv_lora_rank=512, rope_dim=64, topk=2048, kv_rows=65536, key_rows=131072, pool_pages=8192,
    moved_pages=4096, warmup=3, repeats=10, stress_loads=2000, stress_unsafe=("indexer", "kv", "fence"),
    overlap_argv=("--runtime", "cuda", "--layers", "8", "--pages", "512", "--queries", "64", "--heads", "64",
                  "--repeats", "5"),
    cp_context=4096, link_context=4096,
    # environment: FlashInfer may JIT-build its top-k module there (tens of seconds), outside the timed sections
    estimates_s=(("environment", 30), ("kernels", 100), ("vendor", 20), ("hicache_stress", 60),
                 ("hicache_overlap", 30), ("cp_engine", 110), ("stream_sanitizer", 120)),
)
DRY_SHAPES = Shapes(
    index_tokens=5, index_heads=4, index_dim=64, context=130, attn_tokens=4, attn_heads=4, kv_lora_rank=128,
    rope_dim=16, topk=64, kv_rows=200, key_rows=100, pool_pages=9, moved_pages=5, warmup=1, repeats=3,
    stress_loads=304, stress_unsafe=("indexer",),
    overlap_argv=("--runtime", "emulated", "--pages", "16", "--queries", "1", "--heads", "4", "--repeats", "1",
                  "--layers", "4"),
    cp_context=256, link_context=1024,
    estimates_s=(("environment", 0), ("kernels", 30), ("vendor", 2), ("hicache_stress", 10),
                 ("hicache_overlap", 5), ("cp_engine", 70), ("stream_sanitizer", 60)),
)


class Deadline:
    """Wall-clock budget shared by every section: ``allows(s)`` if ``s`` more seconds still fit."""

    def __init__(self, budget_s: float) -> None:
        self.budget_s = float(budget_s)
        self.start = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def left(self) -> float:
        return self.budget_s - self.elapsed()

    def allows(self, seconds: float) -> bool:
        return seconds <= self.left()

    def why_not(self, seconds: float) -> str:
        return (f"time budget: {self.elapsed():.0f} s used + ~{seconds:.0f} s estimated "
                f"> {self.budget_s:.0f} s budget")


@dataclass
class Context:
    """What every section reads: mode, device, shapes, peaks, the deadline and the shared report."""

    mode: str
    device: torch.device
    shapes: Shapes
    deadline: Deadline
    peaks: dict[str, float]
    backends: tuple[str, ...]
    triton_blocked: str | None = None  # why the Triton backend cannot run here, if it cannot
    skipped: list[dict] = field(default_factory=list)  # {"what", "reason", "counts"}, printed at the end
    floors: dict[str, dict] = field(default_factory=dict)  # kv_dtype -> the cp-vs-reference floor measured here

    @property
    def on_cuda(self) -> bool:
        return self.device.type == "cuda"

    def reserve_after(self, section: str) -> float:
        """Estimated seconds of the sections that run after ``section``."""
        names = [name for name, _ in self.shapes.estimates_s]
        return sum(s for _, s in self.shapes.estimates_s[names.index(section) + 1:])

    def skip(self, what: str, reason: str, counts: bool = True) -> dict:
        """Record a skip; ``counts`` False: the part cannot run in this mode, so the check is not
        incomplete without it (the GPU-only vendor section in a CPU dry run)."""
        self.skipped.append({"what": what, "reason": reason, "counts": counts})
        log(f"skipped {what}: {reason}")
        return {"status": "skipped", "reason": reason}


def log(text: str) -> None:
    print(f"[gpu-check] {text}", flush=True)


# 1. environment -------------------------------------------------------------------------------------

def h200_peaks() -> dict[str, float]:
    """Peaks from ``configs/hardware/h200.yaml``: FLOP/s (bf16, fp8 dense) and bytes/s (HBM, PCIe H2D)."""
    from layersplit.plan.config import load_hardware

    hw = load_hardware("h200")
    return {"flops_bf16": hw.dense_flops_bf16, "flops_fp8": hw.dense_flops_fp8, "hbm": hw.hbm_bandwidth,
            "pcie_h2d": hw.pcie_h2d_bandwidth}


def _vendor_ops() -> list[str]:
    from dsa_kernels import vendor

    return sorted(vendor.available())


def warm_vendor(device: torch.device) -> dict[str, float]:
    """One tiny call of each importable vendor op (FlashInfer JIT-builds its top-k module on first
    use: tens of seconds that must not land in a timed section); seconds each."""
    from dsa_kernels import vendor

    ops, seconds = vendor.available(), {}
    scores = torch.randn(4, 4096, device=device)
    table, rows = torch.arange(64, dtype=torch.int32, device=device)[None], torch.zeros(4, dtype=torch.int32, device=device)
    calls = {"topk_indices": lambda f: f(scores, 2048),
             "topk_merge": lambda f: f(scores[:, :0], rows[:, None][:, :0], scores, 0, 2048),
             "topk_slots": lambda f: f(scores, table, rows, torch.full_like(rows, 4095), 2048),
             "sparse_mla_prefill": lambda f: vendor.flash_mla_lse_base(vendor._flash_mla()[1], device)}
    for op in sorted(ops):
        t0 = time.perf_counter()
        try:
            calls[op](ops[op])
            sync(device)
        except Exception as exc:  # noqa: BLE001 - a JIT build or kernel that fails here fails the section
            seconds[op] = f"raised {type(exc).__name__}: {exc}"[:300]
            continue
        seconds[op] = round(time.perf_counter() - t0, 3)
    return seconds


def section_environment(ctx: Context) -> dict:
    import triton

    cuda = torch.cuda.is_available()
    name = torch.cuda.get_device_name(ctx.device) if ctx.on_cuda else platform.processor() or "cpu"
    warm = warm_vendor(ctx.device) if ctx.on_cuda else {}
    broken = {op: s for op, s in warm.items() if isinstance(s, str)}
    return {
        "mode": ctx.mode, "device": str(ctx.device), "device_name": name, "torch": torch.__version__,
        "triton": triton.__version__, "cuda_runtime": torch.version.cuda, "cuda_available": cuda,
        "cuda_devices": torch.cuda.device_count() if cuda else 0, "vendor_ops": _vendor_ops(),
        "backends": list(ctx.backends), "triton_interpret": envs.triton_interpret(),
        "cpu_threads": torch.get_num_threads(), "h200_peaks": ctx.peaks,
        # what `layersplit plan` takes as hbm_reported_bytes (configs/hardware): checked here on a GPU
        "device_total_memory_bytes": torch.cuda.get_device_properties(ctx.device).total_memory if ctx.on_cuda else None,
        "vendor_warmup_s": warm if ctx.on_cuda else {},
        # a vendor op that cannot even run its warm-up would fail every later call that dispatch gives it
        "passed": not broken,
        "summary": f"{name}, torch {torch.__version__}, triton {triton.__version__}, backends {'/'.join(ctx.backends)}"
                   + (f"; vendor warm-up FAILED: {'; '.join(f'{op} {why}' for op, why in broken.items())}" if broken else ""),
    }


# 2. kernels: timing and the section (cases in layersplit/gpu_check/cases.py) ---------------------------

def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def median_seconds(call: Callable[[], object], dev: torch.device, warmup: int, repeats: int) -> float:
    """Median of ``repeats`` timed calls after ``warmup``: CUDA events on a GPU, perf_counter on a CPU."""
    for _ in range(warmup):
        call()
    sync(dev)
    times = []
    for _ in range(repeats):
        if dev.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            call()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            call()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _backend_fn(ctx: Context, case: OpCase, backend: str) -> tuple[Callable | None, str | None]:
    """The op's function for ``backend``, or ``(None, reason)`` when that backend cannot run it."""
    from dsa_kernels.dispatch import resolve

    if case.fixed is not None:
        return (case.fixed, None) if backend == "torch" else (None, None)  # torch-only op: nothing to skip
    if backend == "triton" and ctx.triton_blocked:
        return None, ctx.triton_blocked
    name, fn = resolve(case.op, ctx.device, backend)
    return (fn, None) if name == backend else (None, f"dispatch gave {name}")


def _rate(case: OpCase, seconds: float, ctx: Context, kernel: str) -> dict:
    """Achieved rate against the peak; a FLOP case's bytes read too, as ``kernel`` (the one that ran) loads them."""
    scale, unit = (1e12, "TFLOP/s") if case.unit == "FLOP" else (1e9, "GB/s")
    rate = {"achieved": case.work / seconds / scale, "peak": ctx.peaks[case.peak] / scale, "rate_unit": unit,
            "peak_key": case.peak}
    if case.bytes_read is not None:  # a FLOP case's bytes too, against HBM
        nbytes, formula = case.bytes_read(kernel)
        rate |= {"bytes_read": nbytes, "bytes_formula": formula,
                 "read_GBps": nbytes / seconds / 1e9, "hbm_peak_GBps": ctx.peaks["hbm"] / 1e9}
    return rate


def run_case(ctx: Context, case: OpCase, backend: str, fn: Callable, want) -> dict:
    """Correctness against the torch reference on the same device, then the timing."""
    run = case.make()
    got = run(fn)
    sync(ctx.device)
    row = {"op": case.op, "label": case.label, "backend": backend, "work": case.work, "unit": case.unit,
           "formula": case.formula, "kernel": case.kernel(backend) if case.kernel else backend}
    row |= {"passed": True, "check": "oracle (torch reference)"} if backend == "torch" else case.check(got, want, backend)
    del got
    seconds = median_seconds(lambda: run(fn), ctx.device, ctx.shapes.warmup, ctx.shapes.repeats)
    row |= {"median_ms": seconds * 1e3, "repeats": ctx.shapes.repeats} | _rate(case, seconds, ctx, row["kernel"])
    log(f"{case.label:<52} {row['kernel'][:40]:<6} {'ok' if row['passed'] else 'FAILED':<6} {row['median_ms']:9.3f} ms "
        f"{row['achieved']:9.3f} {row['rate_unit']} (H200 {case.peak} {row['peak']:.0f})"
        + (f" {row['read_GBps']:.3f} GB/s loaded, L2 + HBM (H200 hbm {row['hbm_peak_GBps']:.0f}; counted as {row['bytes_formula']})"
           if "read_GBps" in row else "")
        + f" {row['check']}")
    return row


def _run_op(ctx: Context, case: OpCase, rows: list[dict], budget: Deadline, no_vendor: list[str]) -> None:
    ref = case.fixed or _ref(case.op, ctx.device)
    want = case.make()(ref)
    for backend in ctx.backends:
        fn, reason = _backend_fn(ctx, case, backend)
        if fn is None and backend == "vendor" and case.fixed is None:
            no_vendor.append(case.op)  # reported once for the section, not per op
        elif fn is None and reason:
            ctx.skip(f"kernels: {case.op} [{backend}]", reason)
        if fn is None:
            continue
        refused = case.refused(backend) if case.refused else None
        if refused:  # this device cannot run the path (an e4m3 kernel below sm89): not a check this mode holds
            ctx.skip(f"kernels: {case.label} [{backend}]", refused, counts=False)
            continue
        if not budget.allows(0):
            ctx.skip(f"kernels: {case.label} [{backend}]", budget.why_not(0))
            continue
        try:
            rows.append(run_case(ctx, case, backend, fn, want))
        except Exception as exc:  # one backend failing must not hide the others
            rows.append({"op": case.op, "label": case.label, "backend": backend, "passed": False,
                         "check": f"raised {type(exc).__name__}: {exc}"[:500]})
            log(f"{case.label} [{backend}] raised {exc!r}")


def _build(ctx: Context, build, gen: torch.Generator, rows: list[dict]) -> list[OpCase]:
    """The builder's cases; one that raises is a failed row (the other builders still run)."""
    try:
        return build(ctx.shapes, ctx.device, gen)
    except Exception as exc:  # noqa: BLE001 - recorded, never raised
        rows.append({"op": build.__name__, "label": build.__name__, "backend": "build", "passed": False,
                     "check": f"raised {type(exc).__name__}: {exc}"[:500]})
        log(f"{build.__name__} raised {exc!r}")
        return []


def section_kernels(ctx: Context) -> dict:
    budget = Deadline(ctx.deadline.left() - ctx.reserve_after("kernels"))  # ops stop early, later sections still fit
    # the GPU's shapes against every op's contract first, on any machine (meta tensors: no memory)
    contracts = check_case_contracts(CUDA_SHAPES)
    gen, rows, no_vendor = torch.Generator().manual_seed(0), [], []
    for build in CASE_BUILDERS:
        if not budget.allows(0):
            ctx.skip(f"kernels: {build.__name__}", budget.why_not(0))
            continue
        for case in _build(ctx, build, gen, rows):
            _run_op(ctx, case, rows, budget, no_vendor)
        if ctx.on_cuda:
            torch.cuda.empty_cache()
    if no_vendor:
        ctx.skip(f"kernels: vendor backend for {', '.join(sorted(set(no_vendor)))}",
                 f"no vendor kernel for these ops here (importable vendor ops: {', '.join(_vendor_ops()) or 'none'})",
                 counts=False)  # FlashMLA / FlashInfer cover only these ops: the vendor section says if they are missing
    by_backend = {b: all(r["passed"] for r in rows if r["backend"] == b) for b in {r["backend"] for r in rows}}
    n_ok = sum(r["passed"] for r in rows)
    timing = "CUDA events" if ctx.on_cuda else CPU_TIMING_NOTE
    return {"rows": rows, "correct_by_backend": by_backend, "cuda_shape_contracts": contracts,
            "passed": n_ok == len(rows) and contracts["passed"], "timing": timing,
            "summary": f"{n_ok}/{len(rows)} op x backend runs correct ({', '.join(sorted(by_backend))}); "
                       f"{len(contracts['cases'])} CUDA-shaped cases within their contracts"
                       + (f", {len(contracts['errors'])} refused" if contracts["errors"] else "")}


def section_vendor(ctx: Context) -> dict:
    """GPU only: FlashMLA's lse base measured for the installed ``sgl_kernel`` and its gating matrix;
    FlashInfer top-k (plain, chunked merge, fused page-table transform) vs the torch reference, sets
    equal up to ties (``cases.vendor_checks``). Without CUDA there is nothing to run: reported as such."""
    if not ctx.on_cuda:
        return {"ran": False, "applicable": False,
                "summary": "GPU-only (FlashMLA lse base, FlashInfer top-k): not run without CUDA"}
    result = vendor_checks(ctx.device)
    for name in ("flash_mla", "flashinfer_topk"):
        if "skipped" in result[name] and result["ran"]:  # neither ran: the section itself is skipped
            ctx.skip(f"vendor: {name}", result[name]["skipped"])
    return result


# 3./4. HiCache stress and overlap -------------------------------------------------------------------

def _stress_summary(r) -> dict:
    keep = ("layers_loaded", "outputs_checked", "corrupted_outputs", "corrupted_requests", "poisoned_reads",
            "seconds", "corruption_rate", "runtime", "topk_rows_checked", "topk_tie_rows", "topk_invalid_rows",
            "score_rel_tol")
    return {k: v for k, v in asdict(r).items() if k in keep}


def section_stress(ctx: Context) -> dict:
    """Tiny-model caches (the race, not the shapes, is under test); delays are ``torch.cuda._sleep``
    on the CUDA streams. Outputs are checked as a valid top-k of the reference scores and as attention
    given the forward's own indices (``hicache.stress``): FlashInfer's tie order is never corruption.
    With waits: 0 corrupted. In cuda mode each dropped wait must be detected."""
    from hicache.stress import StressConfig, run_stress
    from layersplit.engine.cp_pool import cache_spec
    from layersplit.plan.config import load_model

    model = load_model("tiny")
    base = StressConfig(layer_loads=ctx.shapes.stress_loads, runtime="cuda" if ctx.on_cuda else "emulated",
                        index_heads=model.index_n_heads, attn_heads=model.num_heads, topk=model.index_topk)
    safe = _stress_summary(run_stress(cache_spec(model), base))
    unsafe = {}
    for wait in ctx.shapes.stress_unsafe:
        cfg = StressConfig(**(asdict(base) | {"unsafe_skip": frozenset({wait})}))
        unsafe[wait] = _stress_summary(run_stress(cache_spec(model), cfg))
    detected = {w: r["corrupted_outputs"] > 0 for w, r in unsafe.items()}
    passed = safe["corrupted_outputs"] == 0 and (not ctx.on_cuda or all(detected.values()))
    parts = [f"with waits {safe['corrupted_outputs']}/{safe['outputs_checked']} corrupted "
             f"({safe['topk_tie_rows']} of {safe['topk_rows_checked']} top-k rows met a tie)"]
    parts += [f"--unsafe-skip-wait {w}: {r['corrupted_outputs']}/{r['outputs_checked']}" for w, r in unsafe.items()]
    return {"with_waits": safe, "unsafe_skip_wait": unsafe, "detected": detected, "passed": passed,
            "detection_required": ctx.on_cuda, "summary": "; ".join(parts)}


def _overlap_bench():
    """``benchmarks/hicache_overlap.py`` (a script, not a package module), loaded from the repository."""
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "hicache_overlap.py"
    spec = importlib.util.spec_from_file_location("hicache_overlap_bench", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def section_overlap(ctx: Context) -> dict:
    """Pipelined vs serial layer-wise load; on CUDA the host pool is pinned, so loads run at real H2D speed."""
    bench = _overlap_bench()
    result = bench.Bench(bench.parse(list(ctx.shapes.overlap_argv))).run()
    result["pcie_h2d_peak_GBps"] = ctx.peaks["pcie_h2d"] / 1e9
    result["speedup_vs_serial"] = result["serial_s"] / result["pipelined_s"]
    result["argv"] = list(ctx.shapes.overlap_argv)
    result["summary"] = (f"pipelined {result['pipelined_s'] * 1e3:.1f} ms vs serial {result['serial_s'] * 1e3:.1f} ms "
                         f"({result['pipelined_over_max']:.2f}x max(load, compute)); load "
                         f"{result['load_GBps']:.2f} GB/s (H200 PCIe H2D {result['pcie_h2d_peak_GBps']:.0f} GB/s)")
    return result


# 5. CP prefill engine -------------------------------------------------------------------------------

def _tiny_scenario(n: int):
    from layersplit.engine.engine import EngineConfig
    from layersplit.engine.launcher import Scenario
    from layersplit.engine.requests import synthetic_requests
    from layersplit.plan.config import load_model

    model = load_model("tiny")
    requests = synthetic_requests(1, n, 0.9, model.vocab_size, 0)
    cfg = EngineConfig(mode="layersplit", cp=2, pool_pages=-(-n // 64), max_batch_tokens=n, max_requests=1)
    return model, Scenario("gpu-check", requests, cfg)


def section_cp_engine(ctx: Context) -> dict:
    """Tiny model, one request with a 90% cached prefix: cp=2 LayerSplit vs the single-rank reference
    in bf16 (then in fp8, last, where it fits: :mod:`.cp_dtypes`), the schedules' happens-before order,
    the KV-broadcast overlap measured on this device's streams.

    Below sm89 the engine's Triton kernels cannot run (index keys are e4m3 in every KV dtype:
    ``fp8_gate``). This section checks the CP engine (broadcasts, all-gathers, ownership, the stream
    schedule) against the single-rank reference, which holds whichever kernels both sides use; the
    kernels themselves are the ``kernels`` section's. So there it runs the whole section on the torch
    reference kernels (``LAYERSPLIT_KERNEL_BACKEND=torch``, inherited by the ranks), records the Triton
    engine as skipped (not counted: this device cannot run it), and skips the Triton-vs-torch key bytes."""
    from layersplit.engine.prefill import kernel_backend
    from layersplit.gpu_check import cp_dtypes

    refused = cp_dtypes.kernels_refused(ctx.device, "bf16")
    if refused is None:
        return _cp_engine(ctx, triton_refused=None)
    ctx.skip("cp_engine: the engine on Triton/vendor kernels", refused + "; the section ran on the torch "
             "reference kernels instead", counts=False)
    with kernel_backend("torch"):
        return _cp_engine(ctx, triton_refused=refused) | {"kernel_backend": "torch (Triton e4m3 needs sm89+)"}


def _cp_engine(ctx: Context, triton_refused: str | None) -> dict:
    from layersplit.engine.launcher import cp_backend, run_reference
    from layersplit.gpu_check import cp_dtypes, link_overlap
    from layersplit.gpu_check.overlap import fp8_key_bytes, overlap_probe

    n = ctx.shapes.cp_context
    model, scenario = _tiny_scenario(n)
    t0 = time.perf_counter()
    ref = run_reference(model, scenario)
    out = {"model": model.name, "context": n, "new_tokens": sum(len(r.new_tokens) for r in scenario.requests),
           "reference": cp_dtypes.rates(scenario, ref.seconds)}
    out["cp2"] = cp_dtypes.cp2(ctx, model, scenario, ref, max(30.0, min(300.0, ctx.deadline.left())))
    out["cp2"]["wall_s"] = bf16_cost = time.perf_counter() - t0  # reference, floor and cp=2: the fp8 run's estimate
    # both schedules in two processes: the happens-before order of the issued program (device-independent)
    out["happens_before"] = overlap_probe(n, max(30.0, min(300.0, ctx.deadline.left())))
    if torch.cuda.is_available() and cp_backend(2) != "nccl":
        # a gloo collective blocks the host thread that queues the next kernels: on CUDA these timings
        # measure host serialization, not stream overlap; no verdict is drawn from them
        out["happens_before"]["timing_note"] = f"{cp_backend(2)} on CUDA: collectives block the host, timings are host-serialized"
    # the overlap itself, measured: one rank's schedule on this device's streams, link-timed copies.
    # Required on a GPU; on a CPU (emulated streams on shared cores) reported, its logic is unit-tested
    out["overlap"] = link_overlap.measure(ctx.shapes.link_context, runtime="cuda" if ctx.on_cuda else "emulated")
    # a claim about the Triton engine: on the torch reference kernels (their host reads each layer) reported only
    out["overlap_required"] = ctx.on_cuda and triton_refused is None
    if triton_refused is None:
        keys = out["fp8_key_bytes_triton_vs_torch"] = fp8_key_bytes(ctx.device)
        keys_text = f"fp8 key bytes differing {keys['differing_bytes']} of {keys['bytes']}"
    else:  # a Triton kernel check this device cannot run: recorded, not counted, nothing to judge
        keys = ctx.skip("cp_engine: fp8 key bytes, Triton vs torch", triton_refused, counts=False) | {"passed": True}
        out["fp8_key_bytes_triton_vs_torch"], keys_text = keys, "fp8 key bytes Triton vs torch skipped (sm89+)"
    out["cp2_fp8"] = cp_dtypes.fp8_run(ctx, model, scenario, out["cp2"], bf16_cost, ctx.reserve_after("cp_engine"))
    hb = out["happens_before"]
    legacy = hb["legacy"]["indexer_after_kv_bcast"].split(" of ")
    order_ok = hb["overlapped"]["indexer_after_kv_bcast"].startswith("0 of") and legacy[0] == legacy[1] != "0"
    overlap_ok = out["overlap"]["passed"] or not out["overlap_required"]
    fp8_ok = out["cp2_fp8"]["status"] != "failed"  # skipped: recorded in the skip list (the verdict says so)
    # the verdict: what can fail on the device (agreement, order, overlap, key bytes); never the counted
    # KV bytes or the predicted kernels (cp_dtypes), which are reported beside it
    out["passed"] = out["cp2"]["passed"] and fp8_ok and order_ok and overlap_ok and keys["passed"]
    out["summary"] = (f"cp=2 ({out['cp2']['backend']}): {cp_dtypes.summary(out['cp2'])}; "
                      f"{cp_dtypes.summary(out['cp2_fp8'])}; "
                      f"indexer after the KV broadcast: overlapped {hb['overlapped']['indexer_after_kv_bcast']}, "
                      f"legacy {hb['legacy']['indexer_after_kv_bcast']} (happens-before); "
                      f"overlap measured: {out['overlap']['summary']}; {keys_text}")
    return out


def section_stream_sanitizer(ctx: Context) -> dict:
    """The HiCache stress and the 2-rank CP engine under a stream sanitizer (CSAN on CUDA), with teeth."""
    from layersplit.gpu_check.sanitize import section

    n = ctx.shapes.cp_context // 4
    timeout = max(60.0, min(120.0, ctx.deadline.left() / 3))
    model, scenario = _tiny_scenario(n)
    from layersplit.engine.launcher import run_reference
    from layersplit.gpu_check.agreement import row_split_floor, tolerance

    ref = run_reference(model, scenario).hidden  # the floor at the sanitized runs' own size, unsanitized
    tol = tolerance(row_split_floor(model, scenario, ref)["floor"])
    return section(ctx.on_cuda, n, SANITIZE_LOADS[ctx.mode], timeout, tol)


# runner ---------------------------------------------------------------------------------------------

SECTIONS: tuple[tuple[str, Callable[[Context], dict]], ...] = (
    ("environment", section_environment),
    ("kernels", section_kernels),
    ("vendor", section_vendor),
    ("hicache_stress", section_stress),
    ("hicache_overlap", section_overlap),
    ("cp_engine", section_cp_engine),
    ("stream_sanitizer", section_stream_sanitizer),
)


# sections whose verdict rests on the engine's Triton kernels themselves (their timing under the stress's
# dropped waits, the overlap benchmark, the sanitizer's registered ops): where those kernels cannot compile
# (e4m3 below sm89: fp8_gate) there is nothing of theirs to check, so the section is skipped, not counted.
# cp_engine runs on the torch kernels instead (section_cp_engine says why).
TRITON_KERNEL_SECTIONS = ("hicache_stress", "hicache_overlap", "stream_sanitizer")


def run_section(ctx: Context, name: str, fn: Callable[[Context], dict]) -> dict:
    """Run one section unless its estimate no longer fits or this device cannot run the kernels it checks
    (``TRITON_KERNEL_SECTIONS``); an exception is recorded, never raised."""
    from layersplit.gpu_check.cp_dtypes import kernels_refused

    estimate = dict(ctx.shapes.estimates_s)[name]
    if not ctx.deadline.allows(estimate):
        return ctx.skip(name, ctx.deadline.why_not(estimate)) | {"seconds": 0.0}
    t0 = time.perf_counter()
    try:
        # inside the try: asking for the kernels can itself raise (a sticky CUDA error from an earlier
        # section, a Triton that fails to import), and that is this section's failure, not the run's
        refused = kernels_refused(ctx.device, "bf16") if name in TRITON_KERNEL_SECTIONS else None
        if refused is not None:
            return ctx.skip(name, refused, counts=False) | {"seconds": 0.0}
        log(f"{name}: start ({ctx.deadline.left():.0f} s of budget left)")
        result = fn(ctx)
        status = "ok" if result.get("passed", True) else "failed"
        if result.get("ran") is False:  # a section with nothing to run here is not "ok"
            status = "skipped"
            ctx.skip(name, result.get("summary", "not run"), counts=result.get("applicable", True))
        entry = {"status": status, "result": result}
    except Exception as exc:
        entry = {"status": "failed", "error": f"{type(exc).__name__}: {exc}",
                 "traceback": traceback.format_exc()[-4000:]}
    entry["seconds"] = time.perf_counter() - t0
    log(f"{name}: {entry['status']} in {entry['seconds']:.1f} s"
        + (f" -- {entry['error']}" if "error" in entry else f" -- {entry['result'].get('summary', '')}"))
    return entry


def choose_mode(dry_run: bool) -> tuple[str, torch.device]:
    if torch.cuda.is_available() and not dry_run:
        return "cuda", torch.device("cuda", torch.cuda.current_device())
    return "cpu-dry-run", torch.device("cpu")


def prepare_triton(mode: str) -> str | None:
    """CPU runs need ``TRITON_INTERPRET=1`` before the Triton kernels are imported (``triton.jit``
    reads it at decoration); returns why Triton cannot run here, or None.

    Set here only where CUDA is absent: next to a GPU it would turn every later Triton kernel of
    this process into an interpreted one, so a dry run there needs it set at launch.
    """
    if mode == "cuda" or envs.triton_interpret():
        return None
    if torch.cuda.is_available():
        return "Triton on the CPU next to a GPU needs TRITON_INTERPRET=1 set at launch"
    # the capability gate imports no Triton: it may be loaded already (the engine's device check reads it)
    kernels = [m for m in sys.modules if m.startswith("dsa_kernels.triton_ops.") and not m.endswith(".fp8_gate")]
    if kernels:
        return "Triton kernels were imported without TRITON_INTERPRET=1, so they cannot run on the CPU"
    os.environ["TRITON_INTERPRET"] = "1"
    return None


def _arm_watchdog(ctx: Context, out: Path, report: dict) -> threading.Timer:
    """cuda mode: whatever hangs (a kernel, NCCL, a sanitized child), write what we have, end every
    child process group this check started, and exit 1 at budget + grace (the running section failed)."""
    def fire() -> None:
        report.update(aborted=f"watchdog after {ctx.deadline.elapsed():.0f} s", elapsed_s=ctx.deadline.elapsed())
        running = report.get("running")
        for name, _ in SECTIONS:
            if name == running:
                report["sections"][name] = {"status": "failed", "error": "stopped by the watchdog while running",
                                            "seconds": ctx.deadline.elapsed()}
            elif name not in report["sections"]:
                reason = "not reached: the watchdog stopped the check"
                report["sections"][name] = ctx.skip(name, reason) | {"seconds": 0.0}
        write_outputs(out, report)
        ended = children.end_all()
        log(f"watchdog: stopping after {ctx.deadline.elapsed():.0f} s ({ended} child process group(s) ended); "
            f"partial report in {out}")
        os._exit(exit_code(report))
    timer = threading.Timer(ctx.deadline.budget_s + WATCHDOG_GRACE_S, fire)
    timer.daemon = True
    timer.start()
    return timer


def _selected(sections: tuple[str, ...] | None) -> set[str]:
    names = [name for name, _ in SECTIONS]
    if sections is None:
        return set(names)
    bad = [s for s in sections if s not in names]
    if bad or not sections:
        raise ValueError(f"sections: expected names from {names}, got {list(sections)}")
    return set(sections) | {"environment"}  # the report's device facts, always


def run_check(out: str | Path, dry_run: bool = False, budget_s: float = BUDGET_S,
              sections: tuple[str, ...] | None = None) -> dict:
    """Run every section (or only ``sections``; ``environment`` always) into ``out`` (created; flat,
    2 files) and return the report dict."""
    if budget_s <= 0:
        raise ValueError(f"budget_s: expected > 0, got {budget_s}")
    chosen = _selected(sections)
    deadline = Deadline(budget_s)  # started first: the report counts import and setup time too
    mode, device = choose_mode(dry_run)
    blocked = prepare_triton(mode)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    backends = ("torch", "triton", "vendor") if mode == "cuda" else ("torch", "triton")
    ctx = Context(mode, device, CUDA_SHAPES if mode == "cuda" else DRY_SHAPES, deadline, h200_peaks(), backends,
                  triton_blocked=blocked)
    report = {"mode": mode, "device": str(device), "budget_s": float(budget_s), "elapsed_s": 0.0,
              "timing": "CUDA events, median after warm-up" if mode == "cuda" else CPU_TIMING_NOTE,
              "sections": {}, "skipped": ctx.skipped}
    log(f"mode {mode} on {device}, budget {budget_s:.0f} s, output {out}")
    timer = _arm_watchdog(ctx, out, report) if mode == "cuda" else None
    try:
        for name, fn in SECTIONS:
            report["running"] = name
            if name in chosen:
                report["sections"][name] = run_section(ctx, name, fn)
            else:  # a rerun of some sections: the others are not this run's to judge
                report["sections"][name] = ctx.skip(name, "not selected (--sections)", counts=False) | {"seconds": 0.0}
            report["elapsed_s"] = deadline.elapsed()
            write_json(out, report)
    finally:
        if timer:
            timer.cancel()
        report.pop("running", None)
    report["elapsed_s"] = deadline.elapsed()
    write_outputs(out, report)
    return report


def print_end(report: dict, out: Path) -> None:
    from layersplit.gpu_check.report import verdict

    for name, s in report["sections"].items():
        log(f"{name:<16} {s['status']}")
    for s in report["skipped"]:
        log(f"skipped: {s['what']}: {s['reason']}")
    log(f"{verdict(report).upper()}: {len(report['skipped'])} item(s) skipped; report: {out / JSON_NAME}, "
        f"{out / MD_NAME} ({report['elapsed_s']:.1f} s of {report['budget_s']:.0f} s)")
