"""MLA latent pack/unpack in the bf16 and fp8 (656-byte) layouts: exact bytes and round trips."""

from __future__ import annotations

import pytest
import torch

from dsa_kernels import layout
from tests.dsa_kernels.helpers import distinct_slots, fp8_exact_rows, op

SHAPES = [(0, 512, 64), (1, 512, 64), (63, 512, 64), (64, 128, 16), (65, 128, 16), (130, 256, 32), (37, 128, 64)]
IDS = [f"n{n}-L{lat}-R{r}" for n, lat, r in SHAPES]


def make(n: int, lat: int, rope: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    kv_c = fp8_exact_rows(n, lat, gen, tile=128).to(torch.bfloat16)  # exact in bf16 and per-tile fp8
    k_pe = torch.randn(n, rope, generator=gen).to(torch.bfloat16)
    return kv_c, k_pe, distinct_slots(n, 3, gen)


def expected_fp8_row(kv_c: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
    """Oracle from the layout doc: e4m3 latent, fp32 scale per 128, bf16 rope."""
    parts_q, parts_s = [], []
    for tile in kv_c.float().split(128):
        scale = float(tile.abs().max()) / 448.0
        parts_q.append((tile / (scale or 1.0)).to(torch.float8_e4m3fn).view(torch.uint8))
        parts_s.append(torch.tensor([scale]).view(torch.uint8))
    return torch.cat(parts_q + parts_s + [k_pe.contiguous().view(torch.uint8)])


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("n,lat,rope", SHAPES, ids=IDS)
@pytest.mark.slow
def test_pack_exact_and_round_trip(backend, device, kv_dtype, n, lat, rope):
    kv_c, k_pe, slots = make(n, lat, rope, seed=n + lat)
    width = layout.mla_row_bytes(lat, rope, kv_dtype)
    cache = (torch.zeros(3 * 64, width // 2, dtype=torch.bfloat16) if kv_dtype == "bf16"
             else torch.zeros(3 * 64, width, dtype=torch.uint8)).to(device)
    op("pack_mla_kv", backend, device)(kv_c.to(device), k_pe.to(device), cache, slots.to(device))
    rows = cache.cpu()[slots]
    for i in range(n):
        want = (torch.cat([kv_c[i], k_pe[i]]) if kv_dtype == "bf16" else expected_fp8_row(kv_c[i], k_pe[i]))
        assert torch.equal(rows[i], want), f"row {i} bytes differ from the layout"
    got_c, got_pe = op("unpack_mla_kv", backend, device)(cache, slots.to(device), lat)
    assert torch.equal(got_c.cpu(), kv_c.float()) and torch.equal(got_pe.cpu(), k_pe.float())


def test_glm5_row_sizes():
    assert layout.mla_row_bytes(512, 64, "bf16") == 1152
    assert layout.mla_row_bytes(512, 64, "fp8") == 656
    assert layout.index_row_bytes(128) == 132 and layout.index_page_bytes(128) == 8448


def test_zero_tile_stores_zero_scale(backend, device):
    cache = torch.zeros(64, 656, dtype=torch.uint8, device=device)
    kv_c = torch.zeros(1, 512, device=device)
    kv_c[0, 200] = 7.0  # tile 1 non-zero (scale 7 / 448 = 2^-6, exact), tiles 0, 2, 3 all zero
    op("pack_mla_kv", backend, device)(kv_c, torch.zeros(1, 64, device=device), cache, torch.tensor([9], device=device))
    scales = cache[9, 512:528].cpu().view(torch.float32)
    assert scales.tolist() == [0.0, 2.0**-6, 0.0, 0.0]
    back, _ = op("unpack_mla_kv", backend, device)(cache, torch.tensor([9], device=device), 512)
    assert torch.equal(back.cpu(), kv_c.cpu())


def test_random_latent_fp8_relative_error(device):
    gen = torch.Generator().manual_seed(2)
    kv_c, k_pe = torch.randn(100, 512, generator=gen), torch.randn(100, 64, generator=gen)
    cache = torch.zeros(128, 656, dtype=torch.uint8, device=device)
    slots = torch.arange(100, device=device)
    op("pack_mla_kv", "torch", device)(kv_c.to(device), k_pe.to(device), cache, slots)
    back, pe = op("unpack_mla_kv", "torch", device)(cache, slots, 512)
    rel = ((back.cpu() - kv_c).pow(2).mean() / kv_c.pow(2).mean()).sqrt()
    assert rel < 0.04 and torch.equal(pe.cpu(), k_pe.to(torch.bfloat16).float())


def test_bad_row_width_errors(device):
    cache = torch.zeros(64, 600, dtype=torch.uint8, device=device)
    with pytest.raises(ValueError, match="expected rows of 656 B"):
        op("pack_mla_kv", "triton", device)(torch.zeros(1, 512, device=device), torch.zeros(1, 64, device=device),
                                            cache, torch.tensor([0], device=device))
    with pytest.raises(ValueError, match="expected bfloat16 or uint8"):
        op("pack_mla_kv", "triton", device)(torch.zeros(1, 512, device=device), torch.zeros(1, 64, device=device),
                                            torch.zeros(64, 576, device=device), torch.tensor([0], device=device))
