"""The cp_engine section's per-dtype runs (:mod:`layersplit.gpu_check.cp_dtypes`), without rank processes:

* the rates: ``new_tokens_per_s`` counts new tokens, ``request_tokens_per_s`` every context token;
* the kernel each engine op is predicted to run (the vendor adapter runs Triton for an fp8 cache, and
  for the engine's fp32 q), not the indexer's backend for all of them;
* the fp8 run skipped with the reason where the device cannot run its kernels (not counted) or the
  budget no longer holds it (counted: the verdict is incomplete, never ok), failed with the error where
  it raises;
* the broadcast KV bytes as the engine counted them compared exactly, with teeth, and reported: neither
  they nor the predicted kernels are part of a verdict, which rests on the agreement with the reference;
* below sm89 the cp_engine section runs on the torch reference kernels (the Triton engine and its key
  bytes skipped, not counted), and the sections that check the Triton engine itself are skipped.
"""

from __future__ import annotations

import math
import os

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


@pytest.fixture
def sm86_triton(monkeypatch):
    """The Triton kernels (the interpreter on this CPU) on a device faked as sm86: no e4m3 there."""
    from dsa_kernels.triton_ops import fp8_gate

    monkeypatch.setenv("LAYERSPLIT_KERNEL_BACKEND", "triton")
    monkeypatch.setattr(fp8_gate, "cuda_capability", lambda t: (8, 6))


def test_fp8_run_where_the_device_refuses_it_is_skipped_not_counted(monkeypatch, sm86_triton):
    monkeypatch.setattr(cp_dtypes, "cp2", lambda *a, **k: pytest.fail("the fp8 run started"))
    ctx = _ctx()
    model, scenario = gpu_run._tiny_scenario(64)
    out = cp_dtypes.fp8_run(ctx, model, scenario, {}, 1.0, 0.0)
    assert out["status"] == "skipped" and "sm89+ only" in out["reason"] and "got sm86" in out["reason"]
    assert [(s["what"], s["counts"]) for s in ctx.skipped] == [("cp_engine: cp=2 fp8", False)]
    assert cp_dtypes.summary(out).startswith("fp8 skipped: quantize_index_keys on Triton: its kernel uses e4m3")
    monkeypatch.setenv("LAYERSPLIT_KERNEL_BACKEND", "torch")  # the torch reference kernels run anywhere
    assert cp_dtypes.kernels_refused(ctx.device, "fp8") is None


def test_kernels_refused_follows_the_backend_and_the_device(monkeypatch):
    from dsa_kernels.triton_ops import fp8_gate

    cpu = torch.device("cpu")
    monkeypatch.setenv("LAYERSPLIT_KERNEL_BACKEND", "triton")
    assert cp_dtypes.kernels_refused(cpu, "bf16") is None  # off CUDA: nothing to gate
    for cap, refused in (((8, 6), True), ((8, 0), True), ((8, 9), False), ((9, 0), False)):
        monkeypatch.setattr(fp8_gate, "cuda_capability", lambda t, cap=cap: cap)
        assert (cp_dtypes.kernels_refused(cpu, "bf16") is not None) == refused  # index keys: e4m3 in bf16 too
    monkeypatch.delenv("LAYERSPLIT_KERNEL_BACKEND")
    assert cp_dtypes.kernels_refused(cpu, "fp8") is None  # auto on a CPU: the torch reference


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


def test_counted_kv_bytes_compared_exactly_and_reported():
    bf16 = {"kv_row_bytes": 288, "bcast_kv_bytes_per_layer_by_rank_counted": [{0: 256 * 288, 1: 256 * 288}] * 2}
    fp8 = {"kv_row_bytes": 164, "bcast_kv_bytes_per_layer_by_rank_counted": [{0: 256 * 164, 1: 256 * 164}] * 2}
    got = cp_dtypes.counted_kv_bytes_vs_bf16(fp8, bf16)
    assert got["consistent"] and "passed" not in got and "counted by the engine on the host" in got["source"]
    assert got["check"] == "counted fp8 B x 288 == bf16 B x 164 per rank and layer"
    key = "bcast_kv_bytes_per_layer_by_rank_counted"
    off_by_a_row = {**fp8, key: [{0: 256 * 164, 1: 255 * 164}] * 2}
    assert not cp_dtypes.counted_kv_bytes_vs_bf16(off_by_a_row, bf16)["consistent"]
    bf16_bytes = {**fp8, key: bf16[key]}
    assert not cp_dtypes.counted_kv_bytes_vs_bf16(bf16_bytes, bf16)["consistent"]  # fp8 rows sent at bf16's size
    one_rank = {**fp8, key: fp8[key][:1]}
    assert not cp_dtypes.counted_kv_bytes_vs_bf16(one_rank, bf16)["consistent"]


class _Rank:
    def __init__(self, nbytes: int):
        self.bcast_kv_bytes = {0: nbytes}


class _Run:
    def __init__(self, hidden: torch.Tensor, nbytes: int):
        self.hidden, self.seconds, self.ranks = hidden, 0.5, [_Rank(nbytes), _Rank(nbytes)]


@pytest.mark.parametrize("agrees", [True, False], ids=["agrees", "deviates"])
def test_verdict_rests_on_the_agreement_not_on_counted_bytes_or_predicted_kernels(agrees, monkeypatch):
    """cp2's and the fp8 run's status follow the agreement with the reference (measured on the device)
    only: predicted kernels that name nonsense and counted bytes that disagree with bf16's change nothing."""
    ref = _Run(torch.ones(4, 8), 0)
    got = _Run(torch.ones(4, 8) * (1.0 if agrees else 2.0), 256 * 288)  # fp8 "sent" at bf16's row size
    monkeypatch.setattr("layersplit.engine.launcher.run_cp", lambda *a, **k: [got])
    monkeypatch.setattr("layersplit.engine.launcher.run_reference", lambda model, scenario: ref)
    monkeypatch.setattr(cp_dtypes, "device_floor", lambda *a: {"floor": 0.0, "by_row_blocks": {}})
    monkeypatch.setattr(cp_dtypes, "engine_kernels", lambda *a: {"sparse_mla_prefill": "nonsense"})
    model, scenario = gpu_run._tiny_scenario(64)
    bf16 = {"kv_row_bytes": 288, "bcast_kv_bytes_per_layer_by_rank_counted": [{0: 256 * 288}] * 2}
    out = cp_dtypes.fp8_run(_ctx(), model, scenario, bf16, 1.0, 0.0)
    assert not out["bcast_kv_bytes_vs_bf16_counted"]["consistent"]
    assert out["passed"] is agrees and out["status"] == ("ok" if agrees else "failed")
    assert "predicted on nonsense" in cp_dtypes.summary(out) and "B per layer counted" in cp_dtypes.summary(out)


def _fake_cp_engine(monkeypatch, seen: dict) -> None:
    """The cp_engine section with every run replaced: each records the kernel backend it saw."""
    import os

    from layersplit.gpu_check import link_overlap, overlap

    def backend():
        return os.environ.get("LAYERSPLIT_KERNEL_BACKEND", "auto")

    def cp2(ctx, model, scenario, ref, timeout_s):
        seen.setdefault("cp2", []).append(backend())
        return {"kv_dtype": scenario.cfg.kv_dtype, "passed": True, "status": "ok", "backend": "gloo",
                "check": "rel 0 <= 1e-4", "seconds": 0.1, "kv_row_bytes": 288,
                "bcast_kv_bytes_per_layer_by_rank_counted": [{0: 1}],
                "kernels_predicted": {"sparse_mla_prefill": backend()}}

    def overlap_probe(context, timeout_s):
        seen["order"] = backend()
        return {s: {"indexer_after_kv_bcast": v} for s, v in (("overlapped", "0 of 2"), ("legacy", "2 of 2"))}

    monkeypatch.setattr(cp_dtypes, "cp2", cp2)
    monkeypatch.setattr("layersplit.engine.launcher.run_reference", lambda model, scenario: _Run(torch.ones(1), 0))
    monkeypatch.setattr(overlap, "overlap_probe", overlap_probe)
    # the overlap measured on the device misses its bound: required of the Triton engine only
    monkeypatch.setattr(link_overlap, "measure", lambda *a, **k: {"passed": False, "summary": f"on {backend()}"})
    monkeypatch.setattr(overlap, "fp8_key_bytes", lambda dev: seen.setdefault("keys", {
        "passed": True, "differing_bytes": 0, "bytes": 1}))


class _GpuContext(gpu_run.Context):
    on_cuda = True  # the cuda mode's requirements, on this CPU's tensors


def _gpu_ctx() -> gpu_run.Context:
    return _GpuContext("cuda", torch.device("cpu"), gpu_run.DRY_SHAPES, gpu_run.Deadline(100), gpu_run.h200_peaks(),
                       ("torch", "triton", "vendor"))


def test_cp_engine_below_sm89_runs_on_the_torch_kernels(monkeypatch, sm86_triton):
    seen = {}
    _fake_cp_engine(monkeypatch, seen)
    ctx = _gpu_ctx()
    out = gpu_run.section_cp_engine(ctx)
    assert seen == {"cp2": ["torch", "torch"], "order": "torch"}  # bf16 and fp8, the ranks' environment; no keys
    assert os.environ["LAYERSPLIT_KERNEL_BACKEND"] == "triton"  # restored after the section
    assert out["passed"] and out["kernel_backend"].startswith("torch") and out["overlap_required"] is False
    assert out["cp2_fp8"]["status"] == "ok" and "skipped (sm89+)" in out["summary"]
    assert [(s["what"], s["counts"]) for s in ctx.skipped] == [
        ("cp_engine: the engine on Triton/vendor kernels", False), ("cp_engine: fp8 key bytes, Triton vs torch", False)]
    assert all("got sm86" in s["reason"] for s in ctx.skipped)
    assert report.verdict({"sections": {"cp_engine": {"status": "ok"}}, "skipped": ctx.skipped}) == "passed"


def test_cp_engine_on_sm89_plus_runs_the_triton_engine_and_requires_the_overlap(monkeypatch):
    from dsa_kernels.triton_ops import fp8_gate

    monkeypatch.setenv("LAYERSPLIT_KERNEL_BACKEND", "triton")
    monkeypatch.setattr(fp8_gate, "cuda_capability", lambda t: (9, 0))
    seen = {}
    _fake_cp_engine(monkeypatch, seen)
    ctx = _gpu_ctx()
    out = gpu_run.section_cp_engine(ctx)
    assert seen["cp2"] == ["triton", "triton"] and seen["keys"]["passed"] and ctx.skipped == []
    assert out["overlap_required"] is True and not out["passed"]  # the missed overlap fails it here


@pytest.mark.parametrize("name", gpu_run.TRITON_KERNEL_SECTIONS)
def test_sections_that_check_the_triton_engine_skipped_below_sm89(name, sm86_triton):
    ctx = _ctx()
    entry = gpu_run.run_section(ctx, name, lambda c: pytest.fail(f"{name} ran below sm89"))
    assert entry["status"] == "skipped" and "got sm86" in entry["reason"]
    assert [(s["what"], s["counts"]) for s in ctx.skipped] == [(name, False)]
