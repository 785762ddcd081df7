"""The GPU check's kernel cases as the GPU would build and judge them, on a CPU.

* The CUDA-shaped case lists are built (on the meta device: shapes only) and every op's arguments
  held to its input contract, so a contract error cannot hide behind the dry run's small shapes (the
  GLM-5 ``pack_mla_kv`` case once packed 131,072 rows into a 65,536-row cache).
* Sparse MLA's tolerance follows the path that runs: bf16 dots on a GPU (Triton's ``DOT_BF16``,
  FlashMLA, and the vendor adapter's Triton fallback) get bf16's tolerance, not fp32 q's 1e-5.
* A vendor row names the kernel that really ran (the adapter falls back to Triton where the gate refuses).
* The vendor section with neither FlashMLA nor FlashInfer importable did not run: skipped, not ok.
* Sparse MLA over the fp8 (656-byte) cache: the same bytes as the reference (the path's tolerance),
  and within fp8's error of the bf16 cache's output (relative RMS, cosine; NaN and -inf first), with
  teeth; its kernel is Triton on the vendor backend too; FLOPs and the 656-byte rows read are counted,
  as often as the kernel that ran loads them (Triton: once per ``BLOCK_H`` head block; FlashMLA: once).
* Below sm89 every case whose Triton kernel uses e4m3 (``fp8_gate``) is skipped on Triton and vendor
  with the launcher's own reason, not counted; the torch rows, and the cases without e4m3, still run.
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
    assert len(result["cases"]) == 12  # 2 index-key, 4 MLA KV, 2 indexer, 2 sparse MLA (bf16, fp8), 2 paged copy


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


# sparse MLA over the fp8 cache ---------------------------------------------------------------------

def _mla_cases(shapes=DRY_SHAPES, dev=torch.device("cpu"), seed=0):
    return cases.sparse_mla_cases(shapes, dev, torch.Generator().manual_seed(seed))


def _captured(case) -> dict:
    """The arguments the case hands its op."""
    args = {}
    case.make()(lambda q, kv, idx, scale, lat: args.update(q=q, kv=kv, idx=idx, scale=scale, lat=lat))
    return args


def test_fp8_case_reads_the_bf16_rows_packed_with_the_same_q_and_indices():
    from dsa_kernels.dispatch import resolve

    bf16_case, fp8_case = _mla_cases()
    a, b = _captured(bf16_case), _captured(fp8_case)
    assert a["q"] is b["q"] and a["idx"] is b["idx"] and b["kv"].dtype == torch.uint8 and b["kv"].shape[1] == 164
    assert (a["idx"][0] == -1).sum() == a["idx"].shape[1] // 2 and (a["idx"][1] == -1).all()  # the edge rows
    packed = torch.zeros_like(b["kv"])
    rows = a["kv"].float()
    resolve("pack_mla_kv", "cpu", "torch")[1](rows[:, :128].contiguous(), rows[:, 128:].contiguous(), packed,
                                              torch.arange(rows.shape[0]))
    assert torch.equal(packed, b["kv"])  # data movement: exact


@pytest.mark.parametrize("seed", [0, 1])
def test_fp8_case_passes_on_triton_and_counts_656_byte_rows(seed):
    from dsa_kernels.dispatch import resolve

    _, fp8_case = _mla_cases(seed=seed)
    want = fp8_case.make()(resolve("sparse_mla_prefill", "cpu", "torch")[1])
    verdict = fp8_case.check(fp8_case.make()(resolve("sparse_mla_prefill", "cpu", "triton")[1]), want, "triton")
    assert verdict["passed"], verdict["check"]
    vs_bf16 = verdict["fp8_vs_bf16"]
    assert 2**-10 < vs_bf16["rel_rms"] <= cases.FP8_REL_RMS_TOL and vs_bf16["min_cosine"] >= cases.FP8_MIN_COS
    # GLM-5's shapes on the meta device: 656-byte rows, FLOPs of the valid pairs, the bf16 peak (bf16 dots)
    glm_bf16, glm_fp8 = _mla_cases(CUDA_SHAPES, torch.device("meta"))
    valid = 512 * 2048 - 1024 - 2048  # row 0 half -1, row 1 all -1
    assert "row=656 B" in glm_fp8.label and "row=1152 B" in glm_bf16.label
    assert glm_fp8.work == glm_bf16.work == 2 * 64 * (512 + 576) * valid and glm_fp8.peak == "flops_bf16"


def test_sparse_mla_bytes_read_follow_the_kernel_that_ran():
    """GLM-5's 64 heads: the Triton kernel's cdiv(64, BLOCK_H = 16) = 4 head blocks per token each gather
    every selected row and the token's indices; FlashMLA (one group of <= 128 heads) and the torch
    reference gather them once. q is read once either way."""
    from dsa_kernels.triton_ops.sparse_mla import BLOCK_H

    glm_bf16, glm_fp8 = _mla_cases(CUDA_SHAPES, torch.device("meta"))
    valid, q_bytes, idx_bytes = 512 * 2048 - 1024 - 2048, 512 * 64 * 576 * 2, 512 * 2048 * 4
    passes = -(-64 // BLOCK_H)
    assert passes == 4
    for kernel, n in (("triton", passes), ("triton (vendor fallback: kv_cache torch.uint8 ...)", passes),
                      ("flash_mla sgl_kernel.flash_mla 0.4.1", 1), ("torch", 1)):
        nbytes, what = glm_fp8.bytes_read(kernel)
        assert nbytes == n * (valid * 656 + idx_bytes) + q_bytes, kernel
        assert what.startswith(f"{n} * (valid_indices*656 + T*K*4) + T*H*(L+R)*2 (x{n}: "), what
        assert glm_bf16.bytes_read(kernel)[0] - nbytes == n * valid * (1152 - 656)
    assert f"cdiv(H=64, BLOCK_H={BLOCK_H})" in glm_fp8.bytes_read("triton")[1]
    assert "FlashMLA" in glm_bf16.bytes_read("flash_mla x")[1] and "torch" in glm_bf16.bytes_read("torch")[1]


def _with_cache(args: dict, kv: torch.Tensor):
    from dsa_kernels.reference.sparse_mla import sparse_mla_prefill

    return sparse_mla_prefill(args["q"], kv, args["idx"], args["scale"], args["lat"])


SCALES = slice(128, 132)  # DRY shapes: 128 e4m3 bytes, one fp32 scale, then 16 bf16 rope


@pytest.mark.parametrize("corrupt", ["scale-x1.1", "rope-lost", "latent-reversed", "nan", "masked-row-nonzero"])
def test_fp8_vs_bf16_check_has_teeth(corrupt):
    """A fault in the fp8 bytes that the same-bytes check cannot see (the reference reads the same
    bytes) moves the output off the bf16 cache's: caught by relative RMS / cosine, NaN or the mask."""
    from dsa_kernels.dispatch import resolve

    bf16_case, fp8_case = _mla_cases()
    ref = resolve("sparse_mla_prefill", "cpu", "torch")[1]
    bf16_out = bf16_case.make()(ref)
    args = _captured(fp8_case)
    kv = args["kv"].clone()
    if corrupt == "scale-x1.1":
        kv[:, SCALES] = (kv[:, SCALES].contiguous().view(torch.float32) * 1.1).view(torch.uint8)
    elif corrupt == "rope-lost":
        kv[:, 132:] = 0
    elif corrupt == "latent-reversed":
        kv[:, :128] = kv[:, :128].flip(1)
    out, lse = _with_cache(args, kv)
    if corrupt == "nan":
        out[2, 0, 0] = float("nan")
    elif corrupt == "masked-row-nonzero":
        out[1] = 1e-3
    assert cases.check_fp8_vs_bf16(_with_cache(args, args["kv"]), bf16_out)["passed"]
    assert not cases.check_fp8_vs_bf16((out, lse), bf16_out)["passed"]
    assert not fp8_case.check((out, lse), (out, lse), "triton")["passed"]  # the case's check, same bytes or not


def test_fp8_case_kernel_is_triton_on_the_vendor_backend(monkeypatch):
    monkeypatch.setattr(vendor, "_flash_mla", lambda: (object(), "sgl_kernel.flash_mla 0.4.1"))
    monkeypatch.setattr(vendor, "_capability", lambda dev: (9, 0))
    monkeypatch.setattr(vendor, "_on_cuda", lambda t: True)
    monkeypatch.setattr(vendor, "flash_mla_lse_base", lambda version, dev: math.e)
    q, idx = torch.zeros(2, 64, 576, dtype=torch.bfloat16), torch.zeros(2, 128, dtype=torch.int32)
    fp8 = torch.zeros(256, 656, dtype=torch.uint8)
    label = cases.sparse_mla_kernel("vendor", q, fp8, idx, 512)
    assert label.startswith("triton (vendor fallback: kv_cache torch.uint8") and "bf16" in label
    assert cases.sparse_mla_kernel("vendor", q, torch.zeros(256, 576, dtype=torch.bfloat16), idx, 512).startswith(
        "flash_mla")
    _, fp8_case = _mla_cases()
    assert fp8_case.kernel("vendor").startswith("triton (vendor fallback: ")


def _dry_cases() -> list:
    gen = torch.Generator().manual_seed(0)
    return [case for build in cases.CASE_BUILDERS for case in build(DRY_SHAPES, torch.device("cpu"), gen)]


def test_every_e4m3_case_is_refused_as_its_launcher_refuses(monkeypatch):
    """Below sm89 a case's ``refused`` is exactly its Triton launcher's: the same one-line reason where
    the launcher raises, None where it runs (the bf16 MLA cache, the paged copies)."""
    from dsa_kernels.dispatch import resolve
    from dsa_kernels.triton_ops import fp8_gate

    monkeypatch.setattr(fp8_gate, "cuda_capability", lambda t: (8, 6))
    gated = []
    for case in _dry_cases():
        if case.fixed is not None:  # torch only (top-k): no Triton kernel
            continue
        reason = case.refused("triton") if case.refused else None
        try:
            case.make()(resolve(case.op, "cpu", "triton")[1])
            raised = None
        except ValueError as exc:
            raised = str(exc)
        assert reason == raised, case.label
        assert case.refused is None or case.refused("torch") is None
        if reason:
            gated.append(case.label.split()[0])
    assert gated == ["quantize_index_keys", "dequantize_index_keys", "pack_mla_kv[fp8]", "unpack_mla_kv[fp8]",
                     "indexer_scores", "sparse_mla_prefill[fp8]"]


def test_e4m3_cases_skipped_below_sm89_and_not_counted(monkeypatch):
    """Below sm89 the e4m3 kernels do not exist: their Triton rows are skipped with the gate's reason (not
    counted: this device cannot run the path); every torch row and the Triton rows without e4m3 still run."""
    from dsa_kernels.triton_ops import fp8_gate
    from layersplit.gpu_check import run as gpu_run

    _, fp8_case = _mla_cases()
    assert fp8_case.refused("triton") is None  # the CPU: nothing to gate
    monkeypatch.setattr(fp8_gate, "cuda_capability", lambda t: (8, 6))
    assert "sm89+ only" in fp8_case.refused("triton") and "got sm86" in fp8_case.refused("vendor")
    ctx = gpu_run.Context("cpu-dry-run", torch.device("cpu"), DRY_SHAPES, gpu_run.Deadline(100),
                          gpu_run.h200_peaks(), ("torch", "triton"))
    rows, all_cases = [], _dry_cases()
    for case in all_cases:
        gpu_run._run_op(ctx, case, rows, gpu_run.Deadline(100), [])
    assert all(r["passed"] for r in rows), [r["check"] for r in rows if not r["passed"]]
    triton = [r["label"].split()[0] for r in rows if r["backend"] == "triton"]
    assert triton == ["pack_mla_kv[bf16]", "unpack_mla_kv[bf16]", "sparse_mla_prefill[bf16]", "gather_pages",
                      "scatter_pages"]
    assert len([r for r in rows if r["backend"] == "torch"]) == len(all_cases)
    assert [s["what"].split()[1] for s in ctx.skipped] == [
        "quantize_index_keys", "dequantize_index_keys", "pack_mla_kv[fp8]", "unpack_mla_kv[fp8]", "indexer_scores",
        "sparse_mla_prefill[fp8]"]
    assert all(not s["counts"] and "got sm86" in s["reason"] and s["what"].endswith("[triton]") for s in ctx.skipped)
    fp8_row = next(r for r in rows if r["label"] == fp8_case.label)
    assert fp8_row["read_GBps"] > 0 and fp8_row["bytes_read"] > 0 and "torch reference" in fp8_row["bytes_formula"]
