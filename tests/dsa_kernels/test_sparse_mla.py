"""Sparse MLA prefill (absorbed) against a per-token, per-head softmax oracle."""

from __future__ import annotations

import math

import pytest
import torch

from tests.dsa_kernels.helpers import assert_same_inf, op

# (tokens, heads, top-k, latent, rope, cache rows)
SHAPES = {
    "t1-h1-k1": (1, 1, 1, 128, 16, 10),
    "t5-h3-k31": (5, 3, 31, 128, 16, 100),
    "t7-h17-k33": (7, 17, 33, 128, 32, 65),  # two head blocks, a K tail
    "t3-h16-k64-glm": (3, 16, 64, 512, 64, 200),
    "t9-h4-k2048-short": (9, 4, 2048, 128, 16, 50),  # top-k longer than the context: mostly -1
    "t0": (0, 4, 8, 128, 16, 10),
}


def build(t, h, k, lat, rope, rows, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(t, h, lat + rope, generator=gen).to(torch.bfloat16)
    kv = torch.randn(rows, lat + rope, generator=gen).to(torch.bfloat16)
    idx = torch.full((t, k), -1, dtype=torch.int32)
    for i in range(t):
        n = min(k, rows, int(torch.randint(1, k + 1, (1,), generator=gen)))
        idx[i, :n] = torch.randperm(rows, generator=gen)[:n].int()
        idx[i] = idx[i][torch.randperm(k, generator=gen)]  # -1 holes anywhere, not only at the end
    if t > 2:
        idx[1] = -1  # a fully masked query row
    return q, kv, idx


def oracle(q, kv, idx, sm_scale, lat):
    t, h, _ = q.shape
    out, lse = torch.zeros(t, h, lat), torch.full((t, h), float("-inf"))
    for i in range(t):
        rows = kv[idx[i][idx[i] >= 0].long()].float()
        if len(rows) == 0:
            continue
        logits = q[i].float() @ rows.T * sm_scale  # [H, n]
        out[i] = torch.softmax(logits, -1) @ rows[:, :lat]
        lse[i] = torch.logsumexp(logits, -1)
    return out, lse


@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.slow
def test_matches_oracle(backend, device, name):
    t, h, k, lat, rope, rows = SHAPES[name]
    q, kv, idx = build(t, h, k, lat, rope, rows, seed=t * 31 + h)
    sm_scale = 1.0 / math.sqrt(lat // 4 + rope)
    out, lse = op("sparse_mla_prefill", backend, device)(q.to(device), kv.to(device), idx.to(device), sm_scale, lat)
    want_out, want_lse = oracle(q, kv, idx, sm_scale, lat)
    assert out.shape == (t, h, lat) and lse.shape == (t, h) and lse.dtype == torch.float32
    assert_same_inf(lse.cpu(), want_lse)
    assert not torch.isnan(out).any()
    # the output is rounded to q's dtype (bf16 on the Triton path): tolerance from its epsilon
    if t == 0:
        return
    # one rounding to the output dtype, or fp32 summation-order error over up to 2048 rows
    rtol = max(2 * torch.finfo(out.dtype).eps, 1e-5)
    assert (out.cpu().float() - want_out).abs().max() <= rtol * want_out.abs().max().clamp_min(1.0)
    finite = torch.isfinite(want_lse)
    lse_tol = 1e-4 if device.type == "cpu" else 1e-2  # tf32 dots on CUDA
    err = (lse.cpu()[finite] - want_lse[finite]).abs().max()
    assert err <= lse_tol * want_lse[finite].abs().max().clamp_min(1.0)


def test_index_outside_cache_is_masked_like_minus_one(backend, device):
    """Indices >= the cache's rows (as FlashMLA) or < -1 select nothing: the result equals the same call
    with those entries replaced by -1, and a row of only such indices is fully masked."""
    q, kv, idx = build(5, 3, 16, 128, 16, 40, seed=9)
    bad = idx.clone()
    bad[0, :4] = torch.tensor([40, 41, 2**31 - 1, -7], dtype=torch.int32)
    bad[2] = 40 + torch.arange(16, dtype=torch.int32)
    clean = torch.where((bad >= 0) & (bad < 40), bad, -1)
    fn = op("sparse_mla_prefill", backend, device)
    out, lse = fn(q.to(device), kv.to(device), bad.to(device), 0.1, 128)
    want_out, want_lse = fn(q.to(device), kv.to(device), clean.to(device), 0.1, 128)
    assert_same_inf(lse.cpu(), want_lse.cpu())
    assert torch.equal(out.cpu(), want_out.cpu()) and torch.isneginf(lse[2]).all()


def test_masked_row_is_zero(backend, device):
    q, kv, idx = build(4, 3, 8, 128, 16, 20, seed=5)
    out, lse = op("sparse_mla_prefill", backend, device)(q.to(device), kv.to(device), idx.to(device), 0.1, 128)
    assert torch.equal(out[1].cpu().float(), torch.zeros(3, 128)) and torch.isneginf(lse[1]).all()


def test_bad_input_errors(device):
    q, kv, idx = build(2, 2, 4, 128, 16, 10, seed=1)
    fn = op("sparse_mla_prefill", "triton", device)
    with pytest.raises(ValueError, match="q: expected last dim 144"):
        fn(q[..., :100].contiguous().to(device), kv.to(device), idx.to(device), 0.1, 128)
    with pytest.raises(ValueError, match="kv_lora_rank: expected a power of 2"):
        fn(q.to(device), kv.to(device), idx.to(device), 0.1, 100)
    with pytest.raises(ValueError, match="indices: expected 2 rows"):
        fn(q.to(device), kv.to(device), idx[:1].to(device), 0.1, 128)
