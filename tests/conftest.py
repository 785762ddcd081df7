"""Test setup: the Triton interpreter on machines without CUDA (must be set before triton is imported)."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BACKENDS = ("torch", "triton")


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    return request.param


@pytest.fixture
def device() -> torch.device:
    return DEVICE


@pytest.fixture
def sanitized():
    """The test body runs under the stream-ordering sanitizer (:mod:`hicache.sanitizer`); any
    hazard it reports fails the test."""
    from hicache import sanitizer

    with sanitizer.sanitized() as san:
        yield san
    assert not san.hazards, san.format()


@pytest.fixture(autouse=True)
def _layersplit_env_restored():
    """No test leaks a ``LAYERSPLIT_*`` variable into later tests (rank processes inherit the
    environment: a leaked ``LAYERSPLIT_SANITIZE=1`` would sanitize every later CP run)."""
    before = {k: v for k, v in os.environ.items() if k.startswith("LAYERSPLIT_")}
    yield
    for key in [k for k in os.environ if k.startswith("LAYERSPLIT_") and k not in before]:
        del os.environ[key]
    os.environ.update(before)
