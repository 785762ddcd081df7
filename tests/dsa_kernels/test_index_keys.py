"""Indexer-key fp8 paging: exact layout bytes (ue8m0 scales), backend agreement, round trip, errors."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from dsa_kernels import layout
from tests.dsa_kernels.helpers import distinct_slots, fp8_exact_rows, op

# (tokens, head dim, pages): empty, one token, page boundary -1 / 0 / +1, non-power-of-2 counts
SHAPES = [(0, 128, 1), (1, 128, 1), (63, 128, 2), (64, 128, 2), (65, 128, 3), (129, 128, 4), (77, 32, 3), (200, 64, 5)]
IDS = [f"n{n}-d{d}-p{p}" for n, d, p in SHAPES]


def ue8m0(amax: float) -> float:
    """From the layout doc: 2 ** ceil(log2(max(amax, 1e-4) * fp32(1/448))), the product in fp32."""
    x = float(np.float32(max(amax, 1e-4)) * np.float32(1.0 / 448.0))
    return 2.0 ** math.ceil(math.log2(x))


def expected_page_bytes(keys: torch.Tensor, slots: torch.Tensor, num_pages: int) -> torch.Tensor:
    """Oracle written from the layout doc: per page, 64 x D key bytes, then 64 fp32 scales."""
    d = keys.shape[1]
    cache = torch.zeros(num_pages, 64 * (d + 4), dtype=torch.uint8)
    for k, slot in zip(keys, slots.tolist()):
        page, off = divmod(slot, 64)
        scale = ue8m0(float(k.abs().max()))
        cache[page, off * d:(off + 1) * d] = (k / scale).to(torch.float8_e4m3fn).view(torch.uint8)
        cache[page, 64 * d + 4 * off:64 * d + 4 * off + 4] = torch.tensor([scale]).view(torch.uint8)
    return cache


@pytest.mark.parametrize("n,d,pages", SHAPES, ids=IDS)
def test_quantize_layout_exact(backend, device, n, d, pages):
    gen = torch.Generator().manual_seed(n * 7 + d)
    keys = fp8_exact_rows(n, d, gen)
    slots = distinct_slots(n, pages, gen)
    cache = torch.zeros(pages, layout.index_page_bytes(d), dtype=torch.uint8, device=device)
    op("quantize_index_keys", backend, device)(keys.to(device), cache, slots.to(device))
    assert torch.equal(cache.cpu(), expected_page_bytes(keys, slots, pages))


@pytest.mark.parametrize("n,d,pages", SHAPES, ids=IDS)
@pytest.mark.slow
def test_dequantize_round_trip_exact(backend, device, n, d, pages):
    gen = torch.Generator().manual_seed(n + 3 * d)
    keys = fp8_exact_rows(n, d, gen).to(torch.bfloat16).float()  # also bf16-representable
    slots = distinct_slots(n, pages, gen).to(device)
    cache = torch.zeros(pages, layout.index_page_bytes(d), dtype=torch.uint8, device=device)
    op("quantize_index_keys", backend, device)(keys.to(device).to(torch.bfloat16), cache, slots)
    assert torch.equal(op("dequantize_index_keys", backend, device)(cache, slots).cpu(), keys)


def test_random_keys_relative_error_within_fp8(device):
    """Arbitrary (non-representable) keys: e4m3 keeps 3 mantissa bits, relative RMS error < 4%."""
    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(300, 128, generator=gen) * 3
    slots = torch.arange(300, device=device)
    cache = torch.zeros(5, layout.index_page_bytes(128), dtype=torch.uint8, device=device)
    op("quantize_index_keys", "torch", device)(keys.to(device), cache, slots)
    back = op("dequantize_index_keys", "torch", device)(cache, slots).cpu()
    rel = ((back - keys).pow(2).mean() / keys.pow(2).mean()).sqrt()
    assert rel < 0.04, f"relative RMS error {rel:.4f}"


def test_zero_key_gets_floor_scale(backend, device):
    cache = torch.zeros(1, layout.index_page_bytes(128), dtype=torch.uint8, device=device)
    slots = torch.tensor([5], device=device)
    op("quantize_index_keys", backend, device)(torch.zeros(1, 128, device=device), cache, slots)
    scale = cache[0, 64 * 128 + 20:64 * 128 + 24].cpu().view(torch.float32)
    assert float(scale) == 2.0**-22  # 1e-4 / 448 = 2.2e-7, rounded up to a power of two


@pytest.mark.parametrize(
    "amax,want", [(448.0, 1.0), (448.0 * (1 + 2**-10), 2.0), (447.0, 1.0), (7.0, 2.0**-6), (3e38, 2.0**120)],
    ids=["exact-pow2", "just-above", "just-below", "small", "huge"])
def test_ue8m0_scale_rounds_up_to_power_of_two(backend, device, amax, want):
    """The scale's boundary cases: an exact power of two stays, anything above goes to the next one."""
    keys = torch.zeros(1, 128, device=device)
    keys[0, 3] = amax
    cache = torch.zeros(1, layout.index_page_bytes(128), dtype=torch.uint8, device=device)
    op("quantize_index_keys", backend, device)(keys, cache, torch.tensor([0], device=device))
    assert float(cache[0, 64 * 128:64 * 128 + 4].cpu().view(torch.float32)) == want == ue8m0(amax)


def test_untouched_slots_keep_their_bytes(backend, device):
    gen = torch.Generator().manual_seed(1)
    cache = torch.randint(0, 255, (2, layout.index_page_bytes(128)), dtype=torch.uint8, generator=gen).to(device)
    before = cache.clone()
    slots = torch.tensor([70], device=device)
    op("quantize_index_keys", backend, device)(fp8_exact_rows(1, 128, gen).to(device), cache, slots)
    changed = (cache != before).cpu()
    changed[1, 6 * 128:7 * 128] = False
    changed[1, 64 * 128 + 24:64 * 128 + 28] = False
    assert not changed.any(), "bytes outside slot 70's key and scale were written"


@pytest.mark.parametrize(
    "keys_shape,cache_cols,slots_len,match",
    [((4, 64), 64 * 132, 4, "head dim 128"), ((4, 128), 64 * 132, 3, "one slot per key"),
     ((4, 128), 1000, 4, "64 \\* \\(D \\+ 4\\)")],
    ids=["wrong-head-dim", "slot-count", "bad-page-size"],
)
def test_bad_input_errors(device, keys_shape, cache_cols, slots_len, match):
    cache = torch.zeros(2, cache_cols, dtype=torch.uint8, device=device)
    with pytest.raises(ValueError, match=match):
        op("quantize_index_keys", "triton", device)(torch.zeros(keys_shape, device=device), cache,
                                                     torch.arange(slots_len, device=device))
