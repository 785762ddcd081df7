"""cp=2 against the single-process reference for each KV dtype, for the GPU check's ``cp_engine``
section (:mod:`.run`).

Each dtype's CP run is held to the floor measured on *its own* reference (:mod:`.agreement`: an fp8
row carries e4m3's rounding, so a last-bit flip in a projection can move its output further than in
bf16): that agreement, measured on the device, is the run's verdict. Reported beside it, never part
of the verdict, are facts that cannot fail on the device: the KV bytes each rank broadcast per layer as
the engine **counted** them on the host (rows in the dtype: 1152 B a token in bf16 and 656 B in fp8 at
GLM-5's 512 + 64; the tiny model's 128 + 16 keeps that ratio, 288 / 164 B) and the kernel each op is
**predicted** to run (dispatch asked once in this process, which the ranks inherit). The fp8 run comes
last in the section and runs only where its kernels do (:func:`kernels_refused`) and while the time the
bf16 run took still fits the budget; else it is ``skipped`` with the reason, never ``ok``.
"""

from __future__ import annotations

import time
from dataclasses import replace

import torch


def with_kv_dtype(scenario, kv_dtype: str):
    """``scenario`` with its MLA cache rows in ``kv_dtype`` (same requests, same pool)."""
    from layersplit.engine.launcher import Scenario

    return Scenario(f"{scenario.name}-{kv_dtype}", scenario.requests, replace(scenario.cfg, kv_dtype=kv_dtype),
                    scenario.model)


def rates(scenario, seconds: float) -> dict:
    """``new_tokens_per_s``: new (uncached) tokens per second of wall time; ``request_tokens_per_s``:
    every context token of the requests (cached prefix + new) per second."""
    new = sum(len(r.new_tokens) for r in scenario.requests)
    context = sum(r.prefix_len + len(r.new_tokens) for r in scenario.requests)
    return {"seconds": seconds, "new_tokens_per_s": new / seconds, "request_tokens_per_s": context / seconds}


def kernels_refused(device: torch.device, kv_dtype: str) -> str | None:
    """Why the engine's kernels for ``kv_dtype`` cannot run on ``device`` under the current backend
    (``LAYERSPLIT_KERNEL_BACKEND``): a Triton (or vendor-fallback) kernel that uses e4m3 on a device below
    sm89 (``fp8_gate``: the index keys in every dtype, the MLA cache at fp8); None: they can."""
    from dsa_kernels.dispatch import resolve
    from dsa_kernels.triton_ops import fp8_gate

    compiled = [op for op in fp8_gate.e4m3_ops(kv_dtype) if resolve(op, device)[0] != "torch"]
    return fp8_gate.e4m3_unsupported(compiled[0], torch.empty(0, device=device)) if compiled else None


def engine_kernels(device: torch.device, model, kv_dtype: str) -> dict[str, str]:
    """The kernel each DSA op of the engine is **predicted** to run on ``device``: dispatch's choice here
    in the parent (the rank processes inherit the environment it reads), not observed in the ranks. The
    indexer's scores, its top-k merge (``ops.indexer_topk``), and sparse MLA asked with a call of the
    engine's shape (q fp32, as ``TinyDSA.project`` makes it; the model's heads and row in ``kv_dtype``):
    the vendor adapter runs Triton where FlashMLA's gate refuses, as for every fp8 cache. A reported fact,
    never part of a verdict."""
    from dsa_kernels.dispatch import resolve
    from dsa_kernels.layout import mla_row_bytes
    from layersplit.gpu_check.cases import sparse_mla_kernel

    lat, rope = model.kv_lora_rank, model.qk_rope_head_dim
    row = mla_row_bytes(lat, rope, kv_dtype)
    fp8 = kv_dtype == "fp8"
    kv = torch.zeros(1, row if fp8 else row // 2, dtype=torch.uint8 if fp8 else torch.bfloat16, device=device)
    q = torch.zeros(1, model.num_heads, lat + rope, device=device)
    idx = torch.zeros(1, model.index_topk, dtype=torch.int32, device=device)
    topk = resolve("topk_merge", device)[0]
    return {"indexer_scores": resolve("indexer_scores", device)[0],
            "topk_merge": "flashinfer.top_k" if topk == "vendor" else topk,
            "sparse_mla_prefill": sparse_mla_kernel(resolve("sparse_mla_prefill", device)[0], q, kv, idx, lat)}


def device_floor(ctx, model, scenario, reference: torch.Tensor) -> dict:
    """The reference against itself at other row splits (:mod:`.agreement`), once per check and dtype."""
    from layersplit.gpu_check.agreement import row_split_floor

    key = scenario.cfg.kv_dtype
    if key not in ctx.floors:
        ctx.floors[key] = row_split_floor(model, scenario, reference)
    return ctx.floors[key]


def cp2(ctx, model, scenario, ref, timeout_s: float) -> dict:
    """cp=2 in two processes (gloo with CUDA tensors on one GPU) against ``ref`` (the single-process
    run of the same scenario) and the floor; ``ctx``: the check's ``run.Context``."""
    from dsa_kernels.layout import mla_row_bytes
    from layersplit.engine.launcher import cp_backend, run_cp
    from layersplit.gpu_check.agreement import agreement

    kv_dtype = scenario.cfg.kv_dtype
    res = run_cp(model, [scenario], 2, timeout_s=timeout_s)[0]
    floor = device_floor(ctx, model, scenario, ref.hidden)
    # verdict: the agreement with the reference (measured on the device); the rest is reported facts
    out = {"kv_dtype": kv_dtype} | agreement(res.hidden, ref.hidden, floor["floor"]) | {
        "seconds": res.seconds, "backend": cp_backend(2), "floor_by_row_blocks": floor["by_row_blocks"],
        "kernels_predicted": engine_kernels(ctx.device, model, kv_dtype), "reference": rates(scenario, ref.seconds),
        "kv_row_bytes": mla_row_bytes(model.kv_lora_rank, model.qk_rope_head_dim, kv_dtype),
        "bcast_kv_bytes_per_layer_by_rank_counted": [dict(r.bcast_kv_bytes) for r in res.ranks]}
    return out | {"status": "ok" if out["passed"] else "failed"}


def counted_kv_bytes_vs_bf16(fp8: dict, bf16: dict) -> dict:
    """The engine's **counted** KV broadcast bytes (host arithmetic over the rows it sends, not bytes read
    back from the device), fp8 against bf16: the same rows, so per rank and layer ``fp8 B x bf16 row ==
    bf16 B x fp8 row`` (656 / 1152 of the bytes at GLM-5's row). A reported consistency fact: it cannot
    fail on the device, so it is never part of a verdict (``consistent``, not ``passed``)."""
    f_row, b_row = fp8["kv_row_bytes"], bf16["kv_row_bytes"]
    f_all, b_all = fp8["bcast_kv_bytes_per_layer_by_rank_counted"], bf16["bcast_kv_bytes_per_layer_by_rank_counted"]
    ok = len(f_all) == len(b_all) and all(
        f.keys() == b.keys() and all(f[k] * b_row == b[k] * f_row for k in f) for f, b in zip(f_all, b_all))
    return {"consistent": ok, "source": "counted by the engine on the host, not measured on the device",
            "check": f"counted fp8 B x {b_row} {'==' if ok else '!='} bf16 B x {f_row} per rank and layer"}


def fp8_unrunnable(ctx, bf16_cost_s: float, reserve_s: float) -> tuple[str, bool] | None:
    """``(why the fp8 run is skipped, whether that skip counts)`` or None: it runs. A device the fp8
    run's kernels refuse (:func:`kernels_refused`) cannot run it (does not count); a budget that no
    longer holds the bf16 run's measured cost plus the later sections' estimates skipped a check (counts)."""
    refused = kernels_refused(ctx.device, "fp8")
    if refused is not None:
        return refused, False
    if not ctx.deadline.allows(bf16_cost_s + reserve_s):
        return ctx.deadline.why_not(bf16_cost_s + reserve_s) + " (fp8 run estimated by the bf16 run's cost)", True
    return None


def fp8_run(ctx, model, scenario, bf16: dict, bf16_cost_s: float, reserve_s: float) -> dict:
    """The fp8 cp=2 run and its own single-process fp8 reference, or a recorded skip; a run that raises
    is ``failed`` with the error (the section's other results stay in the report)."""
    from layersplit.engine.launcher import run_reference

    why = fp8_unrunnable(ctx, bf16_cost_s, reserve_s)
    if why is not None:
        return ctx.skip("cp_engine: cp=2 fp8", why[0], counts=why[1]) | {"kv_dtype": "fp8"}
    t0 = time.perf_counter()
    try:
        fp8 = with_kv_dtype(scenario, "fp8")
        timeout = max(30.0, min(300.0, ctx.deadline.left() - reserve_s))
        out = cp2(ctx, model, fp8, run_reference(model, fp8), timeout)
    except Exception as exc:  # noqa: BLE001 - recorded: the bf16 run and the rest of the section stay reported
        return {"kv_dtype": "fp8", "status": "failed", "passed": False, "error": f"{type(exc).__name__}: {exc}"[:2000]}
    out["bcast_kv_bytes_vs_bf16_counted"] = counted_kv_bytes_vs_bf16(out, bf16)  # reported, not a verdict
    return out | {"wall_s": time.perf_counter() - t0}


def summary(run: dict) -> str:
    """One line for the section's summary: the verdict, seconds, KV bytes broadcast per layer."""
    if run["status"] == "skipped" or "error" in run:
        return f"{run['kv_dtype']} {run['status']}: {run.get('reason') or run.get('error')}"
    per_layer = sorted({n for rank in run["bcast_kv_bytes_per_layer_by_rank_counted"] for n in rank.values()})
    vs_bf16 = run.get("bcast_kv_bytes_vs_bf16_counted")  # not a verdict, but never hidden when it disagrees
    ratio = "" if vs_bf16 is None else (", fp8/bf16 bytes " + ("consistent" if vs_bf16["consistent"] else
                                                                 "INCONSISTENT with the row sizes"))
    return (f"{run['kv_dtype']} {run['status']} {run['check']}, {run['seconds']:.3f} s, KV broadcast "
            f"{'/'.join(str(n) for n in per_layer)} B per layer counted ({run['kv_row_bytes']} B rows){ratio}, "
            f"sparse MLA predicted on {run['kernels_predicted']['sparse_mla_prefill']}")
