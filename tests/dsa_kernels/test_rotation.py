"""Hadamard rotation of indexer q/k: DeepSeek's ``rotate_activation`` (Sylvester order, D^-0.5 scale)."""

from __future__ import annotations

import pytest
import torch

from dsa_kernels import hadamard_rotate


def sylvester(d: int) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


@pytest.mark.parametrize("d", [1, 2, 32, 128])
def test_equals_sylvester_matrix_scaled(d):
    x = torch.randn(5, 3, d, generator=torch.Generator().manual_seed(d))
    want = (x.double() @ sylvester(d).double()) * d**-0.5
    assert torch.allclose(hadamard_rotate(x).double(), want, atol=1e-5)


def test_orthonormal_keeps_dot_products_and_dtype():
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(7, 128, generator=gen), torch.randn(9, 128, generator=gen)
    assert torch.allclose(hadamard_rotate(q) @ hadamard_rotate(k).T, q @ k.T, atol=1e-4)
    assert hadamard_rotate(q.to(torch.bfloat16)).dtype == torch.bfloat16


def test_rows_independent_of_batch_bitwise():
    """CP ranks rotate different row sets; each row must come out bit-equal to a single process's."""
    x = torch.randn(33, 4, 32, generator=torch.Generator().manual_seed(1))
    whole = hadamard_rotate(x)
    assert all(torch.equal(hadamard_rotate(x[i:i + 1]), whole[i:i + 1]) for i in range(33))


def test_bad_dim():
    with pytest.raises(ValueError, match="power-of-two last dim, got 24"):
        hadamard_rotate(torch.zeros(2, 24))
