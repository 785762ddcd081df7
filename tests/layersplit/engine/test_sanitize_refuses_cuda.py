"""``LAYERSPLIT_SANITIZE=1`` refuses a CUDA runtime where the engine's rank meets it (the launcher's
rank loop), before any engine is built: the stream sanitizer cannot see CUDA streams, so it must not
report "0 hazards" about a CUDA run. No GPU here: ``torch.cuda.is_available`` patched to True."""

from __future__ import annotations

import pytest
import torch

from hicache import sanitizer
from layersplit.engine import launcher
from layersplit.engine.batch_plan import Request
from layersplit.engine.engine import EngineConfig
from layersplit.plan.config import load_model


def test_sanitized_rank_refuses_a_cuda_runtime_before_any_work(monkeypatch):
    monkeypatch.setenv("LAYERSPLIT_SANITIZE", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: pytest.fail("CUDA touched before the refusal"))
    monkeypatch.setattr(launcher, "RankEngine", lambda *a, **k: pytest.fail("an engine was built"))
    sc = launcher.Scenario("refused", [Request(0, (1, 2, 3))], EngineConfig(cp=1, pool_pages=8, max_batch_tokens=64))
    try:
        with pytest.raises(ValueError, match="LAYERSPLIT_SANITIZE=1: the stream sanitizer models the emulated "
                                             "runtime only; got a CUDA runtime"):
            launcher.run_reference(load_model("tiny"), sc)
    finally:
        sanitizer.disable()  # the launcher enabled it just before the refusal
