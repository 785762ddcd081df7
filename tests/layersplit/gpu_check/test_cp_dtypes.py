"""The cp_engine section's per-dtype runs (:mod:`layersplit.gpu_check.cp_dtypes`), without rank processes:

* the rates: ``new_tokens_per_s`` counts new tokens, ``request_tokens_per_s`` every context token;
* the kernel each engine op really runs (the vendor adapter runs Triton for an fp8 cache, and for the
  engine's fp32 q), not the indexer's backend for all of them;
* the fp8 run skipped with the reason where the device cannot run it (not counted) or the budget no
  longer holds it (counted: the verdict is incomplete, never ok), failed with the error where it raises;
* the broadcast KV bytes compared exactly, with teeth.
"""

from __future__ import annotations

import math

import pytest
import torch

from dsa_kernels import dispatch, vendor
from layersplit.gpu_check import cp_dtypes, report
from layersplit.gpu_check import run as gpu_run
from layersplit.plan.config import load_model

TINY = load_model("tiny")


def _ctx(budget_s: float = 100) -> gpu_run.Context:
    return gpu_run.Context("cpu-dry-run", torch.device("cpu"), gpu_run.DRY_SHAPES, gpu_run.Deadline(budget_s),
                           gpu_run.h200_peaks(), ("torch", "triton"))


def test_rates_count_new_and_request_tokens():
    _, scenario = gpu_run._tiny_scenario(256)
    new = sum(len(r.new_tokens) for r in scenario.requests)
    assert 0 < new < 256 and scenario.requests[0].prefix_len + new == 256  # a 90% cached prefix
    assert cp_dtypes.rates(scenario, 2.0) == {"seconds": 2.0, "new_tokens_per_s": new / 2, "request_tokens_per_s": 128}
    fp8 = cp_dtypes.with_kv_dtype(scenario, "fp8")
    assert fp8.cfg.kv_dtype == "fp8" and fp8.requests is scenario.requests and scenario.cfg.kv_dtype == "bf16"


def test_engine_kernels_name_what_runs_per_op(monkeypatch):
    """A GPU with FlashMLA and FlashInfer, faked: the indexer is Triton's, top-k FlashInfer's, and
    sparse MLA Triton's through the vendor adapter (fp8 cache; and the engine's q is fp32)."""
    monkeypatch.setattr(vendor, "_flash_mla", lambda: (object(), "sgl_kernel.flash_mla 0.4.1"))
    monkeypatch.setattr(vendor, "_capability", lambda dev: (9, 0))
    monkeypatch.setattr(vendor, "_on_cuda", lambda t: True)
    monkeypatch.setattr(vendor, "flash_mla_lse_base", lambda version, dev: math.e)
    chosen = {"indexer_scores": "triton", "topk_merge": "vendor", "sparse_mla_prefill": "vendor"}
    monkeypatch.setattr(dispatch, "resolve", lambda op, device, backend=None: (chosen[op], None))
    fp8 = cp_dtypes.engine_kernels(torch.device("cpu"), TINY, "fp8")
    assert fp8["indexer_scores"] == "triton" and fp8["topk_merge"] == "flashinfer.top_k"
    assert fp8["sparse_mla_prefill"].startswith("triton (vendor fallback: kv_cache torch.uint8")
    bf16 = cp_dtypes.engine_kernels(torch.device("cpu"), TINY, "bf16")
    assert bf16["sparse_mla_prefill"].startswith("triton (vendor fallback: ")
    assert "torch.uint8" not in bf16["sparse_mla_prefill"]


def test_engine_kernels_on_the_cpu_are_the_reference():
    assert cp_dtypes.engine_kernels(torch.device("cpu"), TINY, "fp8") == {
        "indexer_scores": "torch", "topk_merge": "torch", "sparse_mla_prefill": "torch"}


def test_fp8_run_where_the_device_refuses_it_is_skipped_not_counted(monkeypatch):
    from dsa_kernels.triton_ops import sparse_mla

    monkeypatch.setattr(sparse_mla, "_cuda_capability", lambda t: (8, 6))
    monkeypatch.setattr(cp_dtypes, "cp2", lambda *a, **k: pytest.fail("the fp8 run started"))
    ctx = _ctx()
    model, scenario = gpu_run._tiny_scenario(64)
    out = cp_dtypes.fp8_run(ctx, model, scenario, {}, 1.0, 0.0)
    assert out["status"] == "skipped" and "needs sm89+" in out["reason"] and "got sm86" in out["reason"]
    assert [(s["what"], s["counts"]) for s in ctx.skipped] == [("cp_engine: cp=2 fp8", False)]
    assert cp_dtypes.summary(out).startswith("fp8 skipped: kv_cache: the fp8 KV cache")


def test_fp8_run_past_the_budget_is_skipped_and_the_verdict_incomplete(monkeypatch):
    monkeypatch.setattr(cp_dtypes, "cp2", lambda *a, **k: pytest.fail("the fp8 run started"))
    ctx = _ctx(budget_s=50)
    model, scenario = gpu_run._tiny_scenario(64)
    out = cp_dtypes.fp8_run(ctx, model, scenario, {}, bf16_cost_s=30.0, reserve_s=30.0)  # 60 s > 50 s left
    assert out["status"] == "skipped" and "time budget" in out["reason"] and "bf16 run's cost" in out["reason"]
    assert ctx.skipped[0]["counts"]
    section = {"status": "ok", "result": {"cp2_fp8": out}}
    assert report.verdict({"sections": {"cp_engine": section}, "skipped": ctx.skipped}) == "incomplete"
    assert cp_dtypes.fp8_unrunnable(_ctx(budget_s=100), 30.0, 30.0) is None  # 60 s of 100: it runs


def test_fp8_run_that_raises_is_failed_with_the_error(monkeypatch):
    def boom(*args, **kwargs):
        raise TimeoutError("CP ranks: no result within 30 s")

    monkeypatch.setattr(cp_dtypes, "cp2", boom)
    monkeypatch.setattr("layersplit.engine.launcher.run_reference", lambda model, scenario: None)
    model, scenario = gpu_run._tiny_scenario(64)
    out = cp_dtypes.fp8_run(_ctx(), model, scenario, {}, 1.0, 0.0)
    assert out["status"] == "failed" and out["passed"] is False and "TimeoutError: CP ranks" in out["error"]
    assert "fp8 failed: TimeoutError" in cp_dtypes.summary(out)


def test_broadcast_kv_bytes_compared_exactly():
    bf16 = {"kv_row_bytes": 288, "bcast_kv_bytes_per_layer_by_rank": [{0: 256 * 288, 1: 256 * 288}] * 2}
    fp8 = {"kv_row_bytes": 164, "bcast_kv_bytes_per_layer_by_rank": [{0: 256 * 164, 1: 256 * 164}] * 2}
    assert cp_dtypes.kv_bytes_match(fp8, bf16) == {"passed": True,
                                                  "check": "fp8 B x 288 == bf16 B x 164 per rank and layer"}
    off_by_a_row = {**fp8, "bcast_kv_bytes_per_layer_by_rank": [{0: 256 * 164, 1: 255 * 164}] * 2}
    assert not cp_dtypes.kv_bytes_match(off_by_a_row, bf16)["passed"]
    bf16_bytes = {**fp8, "bcast_kv_bytes_per_layer_by_rank": bf16["bcast_kv_bytes_per_layer_by_rank"]}
    assert not cp_dtypes.kv_bytes_match(bf16_bytes, bf16)["passed"]  # fp8 rows sent at bf16's size
    one_rank = {**fp8, "bcast_kv_bytes_per_layer_by_rank": fp8["bcast_kv_bytes_per_layer_by_rank"][:1]}
    assert not cp_dtypes.kv_bytes_match(one_rank, bf16)["passed"]
