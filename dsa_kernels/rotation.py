"""Hadamard rotation of indexer queries and keys (DeepSeek-V3.2's ``rotate_activation``).

DeepSeek-V3.2-Exp ``inference/model.py`` (``rotate_activation``) applies a Walsh-Hadamard transform
in Sylvester (natural) order, scaled by ``D^-0.5`` so it is orthonormal, to the indexer's q and k
after RoPE and before fp8 quantization: it spreads outlier channels over all ``D`` values so one
scale per 128 values loses less. Dot products are unchanged (``H`` is orthogonal); only the
quantization error changes. Here it is a butterfly of adds and subtracts, elementwise per row,
so a row's result does not depend on how many rows are in the batch (CP ranks see different
batches and must agree with a single process bit for bit).
"""

from __future__ import annotations

import torch


def hadamard_rotate(x: torch.Tensor) -> torch.Tensor:
    """``x @ H_D * D^-0.5`` over the last dim (``D`` a power of two), Sylvester order, fp32 math.

    Example: ``hadamard_rotate(torch.eye(2)) == [[1, 1], [1, -1]] / sqrt(2)``.
    """
    d = x.shape[-1]
    if d & (d - 1) or d == 0:
        raise ValueError(f"hadamard_rotate: expected a power-of-two last dim, got {d}")
    y = x.float()
    h = 1
    while h < d:
        pairs = y.reshape(*y.shape[:-1], d // (2 * h), 2, h)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        y = torch.stack([a + b, a - b], dim=-2).reshape(y.shape)
        h *= 2
    return (y * d**-0.5).to(x.dtype)
