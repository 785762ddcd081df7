"""The GPU check on a one-GPU machine: every 2-rank run of the cp_engine section (the engine and the
overlap probe) goes over gloo, since NCCL refuses two ranks on one device; and its timings say they
are host-serialized there. CUDA is faked: the section's runs are stubs that record the backend."""

from __future__ import annotations

import os
from types import SimpleNamespace

import torch

from layersplit.engine import launcher
from layersplit.gpu_check import overlap as overlap_mod
from layersplit.gpu_check import run as gpu_run


def test_one_gpu_runs_every_two_rank_run_over_gloo(monkeypatch):
    seen = []
    result = SimpleNamespace(hidden=torch.ones(3, 4), seconds=0.1)

    def fake_run_cp(*args, **kwargs):
        seen.append(("engine", os.environ.get("LAYERSPLIT_CP_BACKEND")))
        return [result]

    def fake_probe(*args, **kwargs):
        seen.append(("overlap", os.environ.get("LAYERSPLIT_CP_BACKEND")))
        side = {"indexer_after_kv_bcast": "0 of 5", "exposed_share": 0.1}
        return {"delay_ms": 1.0, "overlapped": side, "legacy": side | {"indexer_after_kv_bcast": "5 of 5"}}

    monkeypatch.delenv("LAYERSPLIT_CP_BACKEND", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(launcher, "run_cp", fake_run_cp)
    monkeypatch.setattr(launcher, "run_reference", lambda *a, **k: result)
    monkeypatch.setattr(overlap_mod, "overlap_probe", fake_probe)
    monkeypatch.setattr(overlap_mod, "fp8_key_bytes", lambda dev: {"differing_bytes": 0, "bytes": 1, "passed": True})
    ctx = SimpleNamespace(shapes=SimpleNamespace(cp_context=256), device=torch.device("cpu"),
                          deadline=SimpleNamespace(left=lambda: 100.0))
    out = gpu_run.section_cp_engine(ctx)
    assert seen == [("engine", "gloo"), ("overlap", "gloo")]
    assert "LAYERSPLIT_CP_BACKEND" not in os.environ  # restored after the section
    assert out["cp2"]["backend"] == "gloo" and "host-serialized" in out["overlap"]["timing_note"]
