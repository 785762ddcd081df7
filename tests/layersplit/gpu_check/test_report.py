"""The GPU check's report is honest: passed / failed / incomplete in the summary and the exit status,
``--sections`` for a rerun, the watchdog ending whole child process groups, vendor JIT builds warmed
outside timed sections, the cp-vs-reference bound measured on the device, and the CP backend chosen
by the GPUs there are (NCCL refuses two ranks on one GPU)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import pytest
import torch

from layersplit.cli import gpu_check_cmd
from layersplit.cli.app import _int_at_least
from layersplit.engine import launcher
from layersplit.gpu_check import agreement, children, report
from layersplit.gpu_check import run as gpu_run


def _report(statuses: dict[str, str], skipped: list[dict] = ()) -> dict:
    return {"sections": {name: {"status": s} for name, s in statuses.items()}, "skipped": list(skipped)}


def test_verdict_and_exit_status():
    assert report.verdict(_report({"a": "ok", "b": "ok"})) == "passed" and report.exit_code(_report({"a": "ok"})) == 0
    failed = _report({"a": "ok", "b": "failed"}, [{"what": "c", "reason": "time budget", "counts": True}])
    assert report.verdict(failed) == "failed" and report.exit_code(failed) == 1
    skipped = _report({"a": "ok", "b": "skipped"}, [{"what": "b", "reason": "time budget", "counts": True}])
    assert report.verdict(skipped) == "incomplete" and report.exit_code(skipped) == 3  # not 0: a skip is no pass
    dry = _report({"a": "ok", "vendor": "skipped"}, [{"what": "vendor", "reason": "GPU-only", "counts": False}])
    assert report.verdict(dry) == "passed"


def test_vendor_section_with_nothing_to_run_is_skipped_and_counts_on_cuda(monkeypatch, tmp_path):
    from dsa_kernels import vendor

    monkeypatch.setattr(vendor, "_flash_mla", lambda: None)
    monkeypatch.setattr(vendor, "_flashinfer", lambda name: None)
    ctx = gpu_run.Context("cuda", torch.device("cuda"), gpu_run.CUDA_SHAPES, gpu_run.Deadline(100), {}, ("torch",))
    entry = gpu_run.run_section(ctx, "vendor", gpu_run.section_vendor)
    assert entry["status"] == "skipped" and [s["what"] for s in ctx.skipped] == ["vendor"]
    assert ctx.skipped[0]["counts"] and "not importable" in ctx.skipped[0]["reason"]
    assert report.verdict({"sections": {"vendor": entry}, "skipped": ctx.skipped}) == "incomplete"


def _parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    gpu_check_cmd.add_parser(p.add_subparsers(dest="command"), _int_at_least)
    return p.parse_args(["gpu-check", "--out", "x", *argv])


def test_sections_option(tmp_path, capsys):
    assert gpu_check_cmd.SECTION_NAMES == tuple(name for name, _ in gpu_run.SECTIONS)
    assert _parse("--sections", "kernels, cp_engine").sections == ("kernels", "cp_engine")
    with pytest.raises(SystemExit):
        _parse("--sections", "kernels,bogus")
    assert "expected a comma-separated list" in capsys.readouterr().err
    called = []
    sections = tuple((name, lambda ctx, name=name: called.append(name) or {"summary": name}) for name, _ in gpu_run.SECTIONS)
    mp = pytest.MonkeyPatch()
    mp.setattr(gpu_run, "SECTIONS", sections)
    try:
        out = gpu_run.run_check(tmp_path, dry_run=True, budget_s=60, sections=("hicache_overlap",))
    finally:
        mp.undo()
    assert called == ["environment", "hicache_overlap"]
    assert out["sections"]["kernels"] == {"status": "skipped", "reason": "not selected (--sections)", "seconds": 0.0}
    assert report.verdict(out) == "passed"  # a rerun of some sections judges those
    assert '"verdict": "passed"' in (tmp_path / report.JSON_NAME).read_text()
    with pytest.raises(ValueError, match="sections: expected names"):
        gpu_run.run_check(tmp_path, dry_run=True, sections=("nope",))


GRANDCHILD = ("import pathlib, subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; "
              "time.sleep(60)']); pathlib.Path(sys.argv[1]).write_text(str(p.pid)); time.sleep(60)")


def test_children_end_as_a_group(tmp_path):
    """The watchdog's ``end_all`` kills a child and the processes it started (the sanitized child's
    rank processes), not only the child."""
    import threading

    pid_file = tmp_path / "grandchild"
    cmd = [sys.executable, "-c", GRANDCHILD, str(pid_file)]
    t = threading.Thread(target=_run_child, args=(cmd,), daemon=True)
    t.start()
    deadline = time.monotonic() + 30
    while not pid_file.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    grandchild = int(pid_file.read_text())
    leader = next(iter(children._GROUPS.values()))
    assert children.end_all() == 1
    t.join(20)
    assert leader.poll() is not None
    for _ in range(100):  # killed; reaped by init
        if not _alive(grandchild):
            break
        time.sleep(0.05)
    assert not _alive(grandchild)


def _run_child(cmd):
    try:
        children.run(cmd, dict(os.environ), 60)
    except Exception:  # noqa: BLE001 - the child is killed: its output does not matter here
        pass


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_children_timeout_ends_the_group():
    with pytest.raises(subprocess.TimeoutExpired):
        children.run([sys.executable, "-c", "import time; time.sleep(30)"], dict(os.environ), 0.5)
    assert children._GROUPS == {}


def test_vendor_jit_warmed_outside_timed_sections(monkeypatch):
    """The warm-up calls each importable vendor op once with valid arguments (a fake vendor tier of the
    torch references stands in on the CPU) and times it."""
    from dsa_kernels import vendor
    from dsa_kernels.reference import indexer as ref

    calls = []

    def spy(fn):
        return lambda *a, **k: calls.append(fn.__name__) or fn(*a, **k)
    monkeypatch.setattr(vendor, "available", lambda: {"topk_indices": spy(ref.topk_indices),
                                                      "topk_merge": spy(ref.topk_merge),
                                                      "topk_slots": spy(ref.topk_slots)})
    seconds = gpu_run.warm_vendor(torch.device("cpu"))
    assert sorted(calls) == ["topk_indices", "topk_merge", "topk_slots"] and set(seconds) == set(calls)


def _noisy_projections(monkeypatch, seed: int) -> None:
    """A GPU's batch-variant GEMMs, emulated: every projection output x (1 + 2^-24 N(0, 1))."""
    from dataclasses import astuple

    from layersplit.engine import model as m

    original, gen = m.TinyDSA.project, torch.Generator().manual_seed(seed)

    def noisy(self, layer, h, pos):
        return m.Projections(*(x * (1 + 2**-24 * torch.randn(x.shape, generator=gen)) for x in astuple(original(self, layer, h, pos))))
    monkeypatch.setattr(m.TinyDSA, "project", noisy)


def test_agreement_floor_measured_on_the_device(monkeypatch):
    from layersplit.gpu_check.run import _tiny_scenario

    model, sc = _tiny_scenario(256)
    ref = launcher.run_reference(model, sc).hidden
    # CPU GEMMs: batch-invariant up to fp32's last bits (on 2 AVX-512 threads a 3-block row split moves the
    # hidden states by 3.5e-6 of their scale; 0 on one thread): far under the CPU tolerance
    assert agreement.row_split_floor(model, sc, ref, blocks=(2, 3))["floor"] < agreement.CPU_TOL / 10
    _noisy_projections(monkeypatch, 0)
    noisy_ref = launcher.run_reference(model, sc).hidden
    floor = agreement.row_split_floor(model, sc, noisy_ref, blocks=(2, 3))
    assert floor["floor"] > 0 and set(floor["by_row_blocks"]) == {2, 3}
    other_run = launcher.run_reference(model, sc).hidden  # a CP-like run: the same noise, other draws
    assert agreement.agreement(other_run, noisy_ref, floor["floor"])["passed"]
    # teeth: a defect moves rows by their own scale; NaN poison never passes
    wrong = other_run.clone()
    wrong[:5] = wrong[5:10]
    assert not agreement.agreement(wrong, noisy_ref, floor["floor"])["passed"]
    wrong[0, 0] = float("nan")
    assert not agreement.agreement(wrong, noisy_ref, 1.0)["passed"]


def test_row_blocks_change_only_the_gemm_shapes():
    from layersplit.engine.model import RowBlocks, TinyDSA
    from layersplit.plan.config import load_model

    cfg = load_model("tiny")
    model = TinyDSA(cfg)
    h, pos = torch.randn(11, cfg.hidden_size), torch.arange(11)
    blocked = RowBlocks(model, 3)
    for a, b in zip(vars(model.project(1, h, pos)).values(), vars(blocked.project(1, h, pos)).values()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(model.mlp(0, h), blocked.mlp(0, h), rtol=1e-5, atol=1e-5)
    assert blocked.sm_scale == model.sm_scale


@pytest.mark.parametrize("gpus,env,want", [(0, None, "gloo"), (1, None, "gloo"), (2, None, "nccl"), (4, None, "nccl"),
                                           (1, "gloo", "gloo"), (2, "gloo", "gloo")])
def test_cp_backend_by_gpus_per_rank(monkeypatch, gpus, env, want):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    if env is None:
        monkeypatch.delenv("LAYERSPLIT_CP_BACKEND", raising=False)
    else:
        monkeypatch.setenv("LAYERSPLIT_CP_BACKEND", env)
    assert launcher.cp_backend(2) == want


def test_nccl_on_fewer_gpus_than_ranks_refused_before_any_rank_starts(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LAYERSPLIT_CP_BACKEND", "nccl")
    monkeypatch.setattr(launcher.subprocess, "Popen", lambda *a, **k: pytest.fail("a rank process started"))
    model, sc = gpu_run._tiny_scenario(64)
    with pytest.raises(ValueError, match=r"nccl needs a GPU per rank \(2 ranks, 1 GPU\(s\) here\)"):
        launcher.run_cp(model, [sc], 2)
