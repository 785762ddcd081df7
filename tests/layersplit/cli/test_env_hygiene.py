"""The GPU check's sanitizer section sets its variables for its own runs only."""

from __future__ import annotations

import os

import pytest


def test_sanitizer_section_leaves_the_environment_as_it_found_it(monkeypatch):
    import torch

    from layersplit.gpu_check import sanitize

    monkeypatch.delenv("LAYERSPLIT_SANITIZE", raising=False)
    seen = {}

    def fake_stress(loads, on_cuda, unsafe=frozenset()):
        seen["during"] = os.environ.get("LAYERSPLIT_SANITIZE")
        return {"hazards": 1 if unsafe else 0}

    def fake_engine(context, skip, timeout_s, tol, from_host=False):
        return {"hazards": 1 if skip else 0, "max_rel_deviation": 0.0, "tol": tol, "backend": "gloo"}

    monkeypatch.setattr(sanitize, "_stress", fake_stress)
    monkeypatch.setattr(sanitize, "_engine", fake_engine)
    out = sanitize.run_checks(64, 1, 10.0, 1e-4)
    if not torch.cuda.is_available():
        assert seen["during"] == "1"
    assert "LAYERSPLIT_SANITIZE" not in os.environ and out["clean"] and not out["passed"]  # teeth unnamed: not reported


@pytest.mark.parametrize("phase", ["leak", "check"])
def test_conftest_restores_layersplit_variables(phase):
    if phase == "leak":
        os.environ["LAYERSPLIT_TEST_LEAK_PROBE"] = "1"
    else:  # runs after "leak": the autouse fixture removed it
        assert "LAYERSPLIT_TEST_LEAK_PROBE" not in os.environ
