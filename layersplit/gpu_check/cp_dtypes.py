"""cp=2 against the single-process reference for each KV dtype, for the GPU check's ``cp_engine``
section (:mod:`.run`).

Each dtype's CP run is held to the floor measured on *its own* reference (:mod:`.agreement`: an fp8
row carries e4m3's rounding, so a last-bit flip in a projection can move its output further than in
bf16), and reports its seconds, the KV bytes each rank broadcast per layer (rows in the dtype: 1152 B
a token in bf16 and 656 B in fp8 at GLM-5's 512 + 64; the tiny model's 128 + 16 keeps that ratio,
288 / 164 B) and the kernel each op really runs. The fp8 run comes last in the section and runs only
where the fp8 kernel does (sm89+) and while the time the bf16 run took still fits the budget; else
it is ``skipped`` with the reason, never ``ok``.
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


def engine_kernels(device: torch.device, model, kv_dtype: str) -> dict[str, str]:
    """The kernel each DSA op of the engine really runs on ``device`` (dispatch's choice, which the rank
    processes inherit through the environment): the indexer's scores, its top-k merge
    (``ops.indexer_topk``), and sparse MLA asked with a call of the engine's shape (q fp32, as
    ``TinyDSA.project`` makes it; the model's heads and row in ``kv_dtype``): the vendor adapter runs
    Triton where FlashMLA's gate refuses, as for every fp8 cache."""
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
    out = {"kv_dtype": kv_dtype} | agreement(res.hidden, ref.hidden, floor["floor"]) | {
        "seconds": res.seconds, "backend": cp_backend(2), "floor_by_row_blocks": floor["by_row_blocks"],
        "kernels": engine_kernels(ctx.device, model, kv_dtype), "reference": rates(scenario, ref.seconds),
        "kv_row_bytes": mla_row_bytes(model.kv_lora_rank, model.qk_rope_head_dim, kv_dtype),
        "bcast_kv_bytes_per_layer_by_rank": [dict(r.bcast_kv_bytes) for r in res.ranks]}
    return out | {"status": "ok" if out["passed"] else "failed"}


def kv_bytes_match(fp8: dict, bf16: dict) -> dict:
    """Data movement, exact: the same rows broadcast, so per rank and layer ``fp8 B x bf16 row ==
    bf16 B x fp8 row`` (656 / 1152 of the bytes at GLM-5's row)."""
    f_row, b_row = fp8["kv_row_bytes"], bf16["kv_row_bytes"]
    pairs = zip(fp8["bcast_kv_bytes_per_layer_by_rank"], bf16["bcast_kv_bytes_per_layer_by_rank"])
    ok = all(f.keys() == b.keys() and all(f[k] * b_row == b[k] * f_row for k in f) for f, b in pairs)
    ok = ok and len(fp8["bcast_kv_bytes_per_layer_by_rank"]) == len(bf16["bcast_kv_bytes_per_layer_by_rank"])
    return {"passed": ok, "check": f"fp8 B x {b_row} {'==' if ok else '!='} bf16 B x {f_row} per rank and layer"}


def fp8_unrunnable(ctx, bf16_cost_s: float, reserve_s: float) -> tuple[str, bool] | None:
    """``(why the fp8 run is skipped, whether that skip counts)`` or None: it runs. A device the fp8
    kernel refuses cannot run it (does not count); a budget that no longer holds the bf16 run's
    measured cost plus the later sections' estimates skipped a check (counts)."""
    from dsa_kernels.triton_ops.sparse_mla import fp8_unsupported

    refused = fp8_unsupported(torch.empty(0, dtype=torch.uint8, device=ctx.device))
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
    out["bcast_kv_bytes_vs_bf16"] = kv_bytes_match(out, bf16)
    out["passed"] = out["passed"] and out["bcast_kv_bytes_vs_bf16"]["passed"]
    return out | {"status": "ok" if out["passed"] else "failed", "wall_s": time.perf_counter() - t0}


def summary(run: dict) -> str:
    """One line for the section's summary: the verdict, seconds, KV bytes broadcast per layer."""
    if run["status"] == "skipped" or "error" in run:
        return f"{run['kv_dtype']} {run['status']}: {run.get('reason') or run.get('error')}"
    per_layer = sorted({n for rank in run["bcast_kv_bytes_per_layer_by_rank"] for n in rank.values()})
    return (f"{run['kv_dtype']} {run['status']} {run['check']}, {run['seconds']:.3f} s, KV broadcast "
            f"{'/'.join(str(n) for n in per_layer)} B per layer ({run['kv_row_bytes']} B rows), sparse MLA on "
            f"{run['kernels']['sparse_mla_prefill']}")
