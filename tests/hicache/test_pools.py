"""Device/host pools: SGLang-shaped accessors, layouts, layer subsets, errors."""

from __future__ import annotations

import pytest
import torch

from hicache.device_pool import DSADevicePool
from hicache.host_pool import DSAHostPool
from hicache.paged_buffers import DSACacheSpec
from tests.hicache.conftest import SPEC


def test_buffers_and_accessors():
    pool = DSADevicePool(SPEC, 3)
    assert pool.get_key_buffer(1).shape == (3 * 64, 144) and pool.get_key_buffer(1).dtype == torch.bfloat16
    assert set(pool.index) == {0, 2} and pool.get_index_k_with_scale_buffer(2).shape == (3, 64 * 36)
    loc = torch.tensor([5, 64, 130])
    nope, rope = torch.randn(3, 128).to(torch.bfloat16), torch.randn(3, 16).to(torch.bfloat16)
    pool.set_mla_kv_buffer(1, loc, nope, rope)
    got_nope, got_rope = pool.get_mla_kv_buffer(1, loc)
    assert torch.equal(got_nope, nope.float()) and torch.equal(got_rope, rope.float())
    keys = torch.randn(3, 32)
    pool.set_index_k_buffer(0, loc, keys)
    assert (pool.get_index_k_buffer(0, loc) - keys).abs().max() < 0.1 * keys.abs().max()


def test_fp8_layout_and_host_subset():
    spec = DSACacheSpec(4, 512, 64, 128, (0, 1, 2, 3), kv_dtype="fp8")
    host = DSAHostPool(spec, 2, layers=(1, 3))
    assert host.layers == (1, 3) and host.get_key_buffer(3).shape == (128, 656) and not host.pinned
    assert host.nbytes == 2 * (2 * 64 * 656 + 2 * 8448)
    with pytest.raises(ValueError, match=r"layer_id: expected one of this pool's layers \[1, 3\], got 0"):
        host.get_key_buffer(0)


def test_errors():
    pool = DSADevicePool(SPEC, 2)
    with pytest.raises(ValueError, match=r"expected a layer that runs the indexer \[0, 2\], got 1"):
        pool.get_index_k_with_scale_buffer(1)
    with pytest.raises(ValueError, match="kv_dtype: expected 'bf16' or 'fp8', got 'fp4'"):
        DSACacheSpec(4, 128, 16, 32, (0,), kv_dtype="fp4")
    with pytest.raises(ValueError, match=r"indexer_layers: expected layers in \[0, 4\), got \[9\]"):
        DSACacheSpec(4, 128, 16, 32, (0, 9))
