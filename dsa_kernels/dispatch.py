"""Backend choice for every DSA op, in one place.

``LAYERSPLIT_KERNEL_BACKEND`` = auto | vendor | triton | torch (see ``lsconfig.envs``).
``auto`` picks, per op and device: vendor (CUDA, importable) -> Triton (CUDA, or the CPU under
``TRITON_INTERPRET=1`` only when asked explicitly) -> torch reference. On CPU ``auto`` is the
torch reference: the Triton interpreter is for kernel tests, not for runs.
"""

from __future__ import annotations

import functools
import importlib
from typing import Callable

import torch

from lsconfig import envs

OPS = {
    # op name -> module that holds it under dsa_kernels.reference / dsa_kernels.triton_ops
    "quantize_index_keys": "index_keys",
    "dequantize_index_keys": "index_keys",
    "pack_mla_kv": "mla_kv",
    "unpack_mla_kv": "mla_kv",
    "indexer_scores": "indexer",
    "sparse_mla_prefill": "sparse_mla",
    "gather_pages": "paged_copy",
    "scatter_pages": "paged_copy",
}


@functools.cache
def _vendor_ops() -> dict[str, object]:
    from dsa_kernels import vendor

    return vendor.available()


def _load(backend: str, op: str) -> Callable:
    package = {"torch": "reference", "triton": "triton_ops"}[backend]
    return getattr(importlib.import_module(f"dsa_kernels.{package}.{OPS[op]}"), op)


def resolve(op: str, device: torch.device | str, backend: str | None = None) -> tuple[str, Callable]:
    """Return ``(backend_name, function)`` for ``op`` on ``device`` (cached per op/device type/choice)."""
    return _resolve(op, torch.device(device).type, backend or envs.kernel_backend())


@functools.cache
def _resolve(op: str, device_type: str, choice: str) -> tuple[str, Callable]:
    if op not in OPS:
        raise ValueError(f"op: expected one of {sorted(OPS)}, got {op!r}")
    on_cuda = device_type == "cuda"
    if choice == "vendor":
        if op in _vendor_ops() and on_cuda:
            return "vendor", _vendor_ops()[op]
        choice = "auto"  # ops without a vendor kernel use the next tier
    if choice == "auto":
        if on_cuda and op in _vendor_ops():
            return "vendor", _vendor_ops()[op]
        choice = "triton" if on_cuda else "torch"
    if choice not in ("triton", "torch"):
        raise ValueError(f"backend: expected one of {envs.KERNEL_BACKENDS}, got {choice!r}")
    return choice, _load(choice, op)
