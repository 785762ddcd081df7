"""Backend resolution: one environment variable, CPU default, clear errors."""

from __future__ import annotations

import pytest
import torch

from dsa_kernels import dispatch


@pytest.mark.parametrize("op", sorted(dispatch.OPS))
def test_cpu_auto_is_reference(op):
    name, fn = dispatch.resolve(op, "cpu", "auto")
    assert name == "torch" and fn.__module__.startswith("dsa_kernels.reference")


@pytest.mark.parametrize("op", sorted(dispatch.OPS))
def test_explicit_triton(op):
    name, fn = dispatch.resolve(op, "cpu", "triton")
    assert name == "triton" and fn.__module__.startswith("dsa_kernels.triton_ops")


def test_vendor_without_cuda_falls_back():
    assert dispatch.resolve("sparse_mla_prefill", "cpu", "vendor")[0] == "torch"


def test_env_override(monkeypatch):
    monkeypatch.setenv("LAYERSPLIT_KERNEL_BACKEND", "triton")
    assert dispatch.resolve("indexer_scores", "cpu")[0] == "triton"
    monkeypatch.setenv("LAYERSPLIT_KERNEL_BACKEND", "cudnn")
    with pytest.raises(ValueError, match="LAYERSPLIT_KERNEL_BACKEND: expected one of"):
        dispatch.resolve("indexer_scores", "cpu")


def test_unknown_op():
    with pytest.raises(ValueError, match="op: expected one of"):
        dispatch.resolve("flash_attn", "cpu", "torch")


def test_public_api_uses_dispatch(monkeypatch):
    import dsa_kernels

    monkeypatch.setenv("LAYERSPLIT_KERNEL_BACKEND", "torch")
    pages = torch.arange(12, dtype=torch.uint8).view(3, 4)
    assert dsa_kernels.gather_pages(pages, torch.tensor([2, 0])).tolist() == [[8, 9, 10, 11], [0, 1, 2, 3]]
