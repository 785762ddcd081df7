"""The GPU check's kernel cases as the GPU would build and judge them, on a CPU.

* The CUDA-shaped case lists are built (on the meta device: shapes only) and every op's arguments
  held to its input contract, so a contract error cannot hide behind the dry run's small shapes (the
  GLM-5 ``pack_mla_kv`` case once packed 131,072 rows into a 65,536-row cache).
* Sparse MLA's tolerance follows the path that runs: bf16 dots on a GPU (Triton's ``DOT_BF16``,
  FlashMLA, and the vendor adapter's Triton fallback) get bf16's tolerance, not fp32 q's 1e-5.
* A vendor row names the kernel that really ran (the adapter falls back to Triton where the gate refuses).
* The vendor section with neither FlashMLA nor FlashInfer importable did not run: skipped, not ok.
"""

from __future__ import annotations

import math

import pytest
import torch

from dsa_kernels import vendor
from dsa_kernels.reference.sparse_mla import sparse_mla_prefill as reference
from layersplit.gpu_check import cases
from layersplit.gpu_check.run import CUDA_SHAPES, DRY_SHAPES


@pytest.mark.parametrize("shapes", [CUDA_SHAPES, DRY_SHAPES], ids=["cuda-shapes", "dry-shapes"])
def test_every_case_within_its_op_contract(shapes):
    result = cases.check_case_contracts(shapes)
    assert result["errors"] == [] and result["passed"]
    assert len(result["cases"]) == 11  # 2 index-key, 4 MLA KV, 2 indexer, 1 sparse MLA, 2 paged copy


def test_the_contract_check_refuses_a_case_the_gpu_would_refuse():
    """Teeth: the shapes that broke the first GPU run (more packed rows than cache rows) are refused."""
    from dataclasses import replace

    from dsa_kernels import contract

    original = contract.CHECKS["pack_mla_kv"]

    def cache_of_kv_rows(kv_c, k_pe, kv_cache, slots):  # the old case: a cache of kv_rows rows
        return original(kv_c, k_pe, kv_cache[: CUDA_SHAPES.kv_rows], slots[: CUDA_SHAPES.kv_rows])

    try:
        contract.CHECKS["pack_mla_kv"] = cache_of_kv_rows
        result = cases.check_case_contracts(CUDA_SHAPES)
    finally:
        contract.CHECKS["pack_mla_kv"] = original
    assert not result["passed"] and any("slots: expected 131072 rows" in e for e in result["errors"])
    assert not cases.check_case_contracts(replace(DRY_SHAPES, index_dim=48))["passed"]  # not a power of 2


def _bf16_dot_result(q, kv, idx, scale):
    """What a GPU's bf16-dot path returns for fp32 ``q``: q rounded to bf16 before the dots."""
    return reference(q.to(torch.bfloat16).float(), kv, idx, scale, 512)


def test_sparse_mla_tolerance_follows_the_path_that_ran():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(8, 64, 576, generator=gen)  # the fp32-q gating row of the vendor section
    kv = torch.randn(4096, 576, generator=gen).to(torch.bfloat16)
    idx = torch.randint(0, 4096, (8, 2048), generator=gen, dtype=torch.int32)
    want = reference(q, kv, idx, 576**-0.5, 512)
    got = _bf16_dot_result(q, kv, idx, 576**-0.5)
    on_gpu = cases.check_sparse_mla(1e-2, torch.device("cuda"))
    assert 1e-5 < on_gpu(got, want, "torch")["max_rel_err"]  # fp32's tolerance: the old false failure
    assert not on_gpu(got, want, "torch")["passed"]
    for backend in ("triton", "vendor"):
        verdict = on_gpu(got, want, backend)
        assert verdict["passed"] and verdict["tol"] == cases.BF16_DOT_TOL, verdict
    assert not cases.check_sparse_mla(1e-2, torch.device("cpu"))(got, want, "triton")["passed"]  # interpreter: fp32
    broken = (got[0] * 1.1, got[1])
    assert not on_gpu(broken, want, "vendor")["passed"]  # a 10% error is not a rounding


def test_vendor_row_names_the_kernel_that_ran(monkeypatch):
    monkeypatch.setattr(vendor, "_flash_mla", lambda: (object(), "sgl_kernel.flash_mla 0.4.1"))
    monkeypatch.setattr(vendor, "_capability", lambda dev: (9, 0))
    monkeypatch.setattr(vendor, "_on_cuda", lambda t: True)
    monkeypatch.setattr(vendor, "flash_mla_lse_base", lambda version, dev: math.e)
    kv = torch.zeros(256, 576, dtype=torch.bfloat16)
    idx = torch.zeros(2, 128, dtype=torch.int32)
    q_bf16, q_fp32 = torch.zeros(2, 64, 576, dtype=torch.bfloat16), torch.zeros(2, 64, 576)
    assert cases.sparse_mla_kernel("vendor", q_bf16, kv, idx, 512) == "flash_mla sgl_kernel.flash_mla 0.4.1"
    fallback = cases.sparse_mla_kernel("vendor", q_fp32, kv, idx, 512)
    assert fallback.startswith("triton (vendor fallback: ") and "q" in fallback
    assert cases.sparse_mla_kernel("triton", q_fp32, kv, idx, 512) == "triton"


def test_vendor_section_without_vendor_modules_did_not_run(monkeypatch):
    monkeypatch.setattr(vendor, "_flash_mla", lambda: None)
    monkeypatch.setattr(vendor, "_flashinfer", lambda name: None)
    result = cases.vendor_checks(torch.device("cpu"))
    assert result["ran"] is False and result["passed"] is False
    assert "not importable" in result["flash_mla"]["skipped"]
