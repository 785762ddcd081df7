"""The GPU check's CPU dry run, end to end through the ``gpu-check`` subcommand: every section runs (or
is skipped with a reason), kernels agree with the reference on both backends (sparse MLA over the bf16
and the fp8 cache), cp=2 agrees with the reference in bf16 and fp8 KV, the stress with waits sees no
corruption, and the outputs are at most 8 flat files. A tiny budget skips later sections."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest
import torch

from dsa_kernels.dispatch import OPS
from layersplit.gpu_check import run as gpu_check
from layersplit.cli import gpu_check_cmd
from layersplit.cli.app import _int_at_least
from tests.paths import ROOT

SECTIONS = [name for name, _ in gpu_check.SECTIONS]


def run_cli(out, *extra: str) -> tuple[int, dict]:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="command", required=True)
    gpu_check_cmd.add_parser(sub, _int_at_least)
    args = p.parse_args(["gpu-check", "--out", str(out), "--dry-run", *extra])
    rc = args.func(args)
    return rc, json.loads((out / gpu_check.JSON_NAME).read_text())


def run_hidden_gpu(out) -> tuple[int, dict]:
    """On a GPU machine: CI's CPU mode in a child with CUDA hidden and the Triton interpreter set at
    launch (setting it in this process would turn later GPU tests' kernels into interpreted ones)."""
    env = os.environ | {"CUDA_VISIBLE_DEVICES": "", "TRITON_INTERPRET": "1"}
    script = ROOT / "benchmarks" / "gpu_check.py"
    cmd = [sys.executable, str(script), "--out", str(out), "--dry-run", "--budget-s", "360"]
    rc = subprocess.run(cmd, env=env, timeout=400).returncode
    return rc, json.loads((out / gpu_check.JSON_NAME).read_text())


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-check")
    rc, report = run_hidden_gpu(out) if torch.cuda.is_available() else run_cli(out, "--budget-s", "360")
    return out, rc, report


@pytest.mark.timeout(420)
@pytest.mark.slow
def test_dry_run_every_section_ok(dry_run):
    _, rc, report = dry_run
    assert rc == 0 and report["mode"] == "cpu-dry-run" and report["device"] == "cpu"
    assert list(report["sections"]) == SECTIONS
    for name, section in report["sections"].items():
        if name == "vendor":  # GPU-only: a section that did not run says so, never "ok"
            assert section["status"] == "skipped" and "not run without CUDA" in section["result"]["summary"]
            assert any(s["what"] == "vendor" for s in report["skipped"])
            continue
        assert section["status"] == "ok", f"{name}: {section.get('error') or section.get('reason')}"
    assert report["verdict"] == "passed" and [s["counts"] for s in report["skipped"]] == [False]
    cp2 = report["sections"]["cp_engine"]["result"]["cp2"]
    assert cp2["status"] == "ok" and cp2["backend"] == "gloo" and cp2["max_rel_deviation"] <= 1e-4
    # a CPU's GEMMs are batch-invariant up to fp32's last bits (5.8e-6 on 2 AVX-512 threads): the CPU tolerance holds
    assert cp2["floor"] < 1e-5 and cp2["tol"] == 1e-4
    cp_engine = report["sections"]["cp_engine"]["result"]
    # fp8 KV: cp=2 against its own single-process fp8 reference, the same agreement machinery
    fp8 = cp_engine["cp2_fp8"]
    assert fp8["status"] == "ok" and fp8["kv_dtype"] == "fp8" and fp8["max_rel_deviation"] <= fp8["tol"] == 1e-4
    assert cp2["kv_row_bytes"] == 288 and fp8["kv_row_bytes"] == 164  # the tiny model: GLM-5's 1152 / 656 ratio
    for b, f in zip(cp2["bcast_kv_bytes_per_layer_by_rank_counted"], fp8["bcast_kv_bytes_per_layer_by_rank_counted"]):
        assert f and {k: v * 288 for k, v in f.items()} == {k: v * 164 for k, v in b.items()}
    assert fp8["bcast_kv_bytes_vs_bf16_counted"]["consistent"] and fp8["seconds"] > 0 and cp2["seconds"] > 0
    for run in (cp2, fp8):  # what is predicted to run per op (the CPU: the torch reference for each)
        assert run["kernels_predicted"] == {"indexer_scores": "torch", "topk_merge": "torch",
                                            "sparse_mla_prefill": "torch"}
        assert run["reference"]["new_tokens_per_s"] > 0 and run["reference"]["request_tokens_per_s"] > 0
    reference = cp_engine["reference"]
    assert "tokens_per_s" not in reference and reference["new_tokens_per_s"] == pytest.approx(
        cp_engine["new_tokens"] / reference["seconds"])
    assert "fp8 ok" in cp_engine["summary"] and "41984 B per layer" in cp_engine["summary"]
    order, keys = cp_engine["happens_before"], cp_engine["fp8_key_bytes_triton_vs_torch"]
    assert order["overlapped"]["indexer_after_kv_bcast"].startswith("0 of ")  # the happens-before order
    n = order["legacy"]["indexer_after_kv_bcast"].split(" of ")[1]
    assert order["legacy"]["indexer_after_kv_bcast"] == f"{n} of {n}" and int(n) > 0
    overlap = cp_engine["overlap"]  # measured on the emulated streams: reported on a CPU, required on a GPU
    assert overlap["runtime"] == "emulated" and cp_engine["overlap_required"] is False
    assert 0 <= overlap["overlapped"]["exposed_stall_share_in_waits"] and "legacy" in overlap["summary"]
    assert keys["differing_bytes"] == 0 and keys["passed"]
    san = report["sections"]["stream_sanitizer"]["result"]
    assert san["stress"]["hazards"] == 0 and san["engine_cp2"]["hazards"] == 0 and san["engine_cp2_host"]["hazards"] == 0
    assert san["teeth_reported"] == {"stress:fence": True, "stress:indexer": True, "engine:compute_wait": True,
                                     "engine:slot_release": True, "engine:poison_fence": True}  # the check has teeth
    env = report["sections"]["environment"]["result"]
    assert env["torch"] == torch.__version__ and env["h200_peaks"]["hbm"] == 4.8e12


@pytest.mark.timeout(420)
@pytest.mark.slow
def test_dry_run_kernels_correct_on_both_backends(dry_run):
    result = dry_run[2]["sections"]["kernels"]["result"]
    rows = result["rows"]
    assert result["cuda_shape_contracts"]["passed"] and len(result["cuda_shape_contracts"]["cases"]) == 12
    assert result["correct_by_backend"] == {"torch": True, "triton": True}
    for backend in ("torch", "triton"):
        assert {r["op"] for r in rows if r["backend"] == backend} >= set(OPS), f"{backend}: an op did not run"
    for r in rows:
        assert r["passed"], f"{r['label']} [{r['backend']}]: {r['check']}"
        assert r["median_ms"] > 0 and r["achieved"] > 0 and r["peak"] > 0
    assert "not representative" in result["timing"]
    fp8 = [r for r in rows if r["label"].startswith("sparse_mla_prefill[fp8]")]
    assert [r["backend"] for r in fp8] == ["torch", "triton"] and "row=164 B" in fp8[0]["label"]
    assert fp8[1]["fp8_vs_bf16"]["passed"] and fp8[1]["kernel"] == "triton"
    assert all(r["read_GBps"] > 0 and r["bytes_read"] > 0 for r in fp8)


@pytest.mark.timeout(420)
@pytest.mark.slow
def test_dry_run_stress_and_overlap(dry_run):
    sections = dry_run[2]["sections"]
    stress = sections["hicache_stress"]["result"]
    assert stress["with_waits"]["corrupted_outputs"] == 0 and stress["with_waits"]["outputs_checked"] > 0
    assert stress["with_waits"]["runtime"] == "emulated"
    assert set(stress["unsafe_skip_wait"]) == {"indexer"}  # reported; detection is required on CUDA only
    overlap = sections["hicache_overlap"]["result"]
    assert overlap["runtime"] == "emulated" and overlap["pipelined_s"] > 0 and overlap["serial_s"] > 0


@pytest.mark.timeout(420)
@pytest.mark.slow
def test_dry_run_outputs_flat_and_few(dry_run):
    out, _, report = dry_run
    entries = list(out.iterdir())
    assert len(entries) <= 8 and all(e.is_file() for e in entries)
    assert {e.name for e in entries} == {gpu_check.JSON_NAME, gpu_check.MD_NAME}
    md = (out / gpu_check.MD_NAME).read_text()
    assert all(f"| {name} | {'skipped' if name == 'vendor' else 'ok'} |" in md for name in SECTIONS)
    assert "not representative" in md and [s["what"] for s in report["skipped"]] == ["vendor"]  # GPU-only


@pytest.mark.timeout(120)
def test_tiny_budget_skips_later_sections(tmp_path, capsys):
    rc, report = run_cli(tmp_path, "--budget-s", "1")
    assert rc == 3 and report["verdict"] == "incomplete"  # nothing failed, but nothing was checked either
    sections = report["sections"]
    assert sections["environment"]["status"] == "ok"
    for name in SECTIONS[1:]:
        assert sections[name]["status"] == "skipped" and "time budget" in sections[name]["reason"]
    assert [s["what"] for s in report["skipped"]] == SECTIONS[1:]
    printed = capsys.readouterr().out
    assert all(f"skipped: {name}: time budget" in printed for name in SECTIONS[1:])
    assert "INCOMPLETE: 6 item(s) skipped" in printed


def test_budget_must_be_positive(tmp_path):
    with pytest.raises(SystemExit):
        run_cli(tmp_path, "--budget-s", "0")
    with pytest.raises(ValueError, match="budget_s: expected > 0"):
        gpu_check.run_check(tmp_path, dry_run=True, budget_s=0)


def test_failing_section_is_recorded_and_the_rest_runs(tmp_path, monkeypatch):
    def broken(ctx):
        raise RuntimeError("boom")

    sections = (("environment", gpu_check.section_environment), ("kernels", broken),
                ("hicache_overlap", gpu_check.section_overlap))
    monkeypatch.setattr(gpu_check, "SECTIONS", sections)
    report = gpu_check.run_check(tmp_path, dry_run=True, budget_s=120)
    assert report["sections"]["kernels"]["status"] == "failed"
    assert report["sections"]["kernels"]["error"] == "RuntimeError: boom"
    assert report["sections"]["hicache_overlap"]["status"] == "ok"
    assert gpu_check.exit_code(report) == 1
    assert "| kernels | failed |" in (tmp_path / gpu_check.MD_NAME).read_text()


@pytest.mark.parametrize("name", gpu_check.TRITON_KERNEL_SECTIONS)
def test_asking_for_the_kernels_fails_the_section_not_the_run(name, monkeypatch):
    """The below-sm89 question runs inside the section's try: an error there (a sticky CUDA error from an
    earlier section, a Triton that fails to import) is that section's failure, recorded, never raised."""
    from layersplit.gpu_check import cp_dtypes

    def boom(device, kv_dtype):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(cp_dtypes, "kernels_refused", boom)
    ctx = gpu_check.Context("cpu-dry-run", torch.device("cpu"), gpu_check.DRY_SHAPES, gpu_check.Deadline(100),
                            gpu_check.h200_peaks(), ("torch", "triton"))
    entry = gpu_check.run_section(ctx, name, lambda c: {"passed": True})
    assert entry["status"] == "failed" and "illegal memory access" in entry["error"]
