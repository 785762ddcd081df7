"""Launcher-side argument checks shared by the Triton ops (public-boundary errors)."""

from __future__ import annotations

import torch


def check_tensor(name: str, t: torch.Tensor, *, dim: int, dtypes: tuple[torch.dtype, ...], device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dim() != dim:
        raise ValueError(f"{name}: expected {dim} dims, got shape {list(t.shape)}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name}: expected dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name}: expected device {device}, got {t.device}")
    if not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor, got strides {t.stride()}")


def check_len(name: str, t: torch.Tensor, n: int, what: str) -> None:
    if t.shape[0] != n:
        raise ValueError(f"{name}: expected {n} rows ({what}), got {t.shape[0]}")


INDEX_DTYPES = (torch.int32, torch.int64)
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
