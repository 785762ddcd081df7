"""The new rows' trip (:mod:`layersplit.engine.new_rows`) in one process: each rank packs its rows, the
all-gather is a byte copy (``torch.stack``), every rank lands them; the cache bytes must equal those of
the old path, which gathered bf16 rows and quantized all of them where they landed (``pack_mla_kv`` and
``quantize_index_keys`` at the slots). Exact equality: the trip is data movement. Both kernel backends
(Triton interpreted), both KV dtypes, ranks with no row, rows across an index page boundary."""

from __future__ import annotations

import pytest
import torch

from dsa_kernels import pack_mla_kv, quantize_index_keys
from dsa_kernels.layout import PAGE_SIZE, index_page_bytes, mla_row_bytes
from hicache.paged_buffers import DSACacheSpec, PagedDSABuffers
from layersplit.engine.new_rows import NewRows

L, R, D = 128, 16, 32
POOL_PAGES = 5


def _spec(kv_dtype: str) -> DSACacheSpec:
    return DSACacheSpec(num_layers=2, kv_lora_rank=L, rope_dim=R, index_head_dim=D, indexer_layers=(0,),
                        kv_dtype=kv_dtype)


def _split(counts: list[int], gen: torch.Generator) -> list[torch.Tensor]:
    """Each rank's global new-token indices: a random partition with these counts."""
    order = torch.randperm(sum(counts), generator=gen)
    return [part.sort().values for part in order.split(counts)]


# counts per rank: one rank with no row (fewer new tokens than ranks), one row, a rank crossing 64 rows
SPLITS = {"one-rank": [37], "zero-rows-rank": [5, 0, 3], "one-row": [1, 1], "page-plus-one": [65, 64, 9]}


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("counts", list(SPLITS.values()), ids=list(SPLITS))
def test_landed_bytes_equal_quantizing_where_landed(counts, kv_dtype, backend, monkeypatch):
    monkeypatch.setenv("LAYERSPLIT_KERNEL_BACKEND", backend)
    gen = torch.Generator().manual_seed(len(counts) * 100 + sum(counts))
    spec, n = _spec(kv_dtype), sum(counts)
    local = _split(counts, gen)
    kv_c, k_pe, index_k = (torch.randn(n, w, generator=gen) * 3 for w in (L, R, D))  # fp32 projections
    slots = torch.randperm(POOL_PAGES * PAGE_SIZE, generator=gen)[:n]  # where each new token goes
    landed, old = (PagedDSABuffers(spec, POOL_PAGES, "cpu") for _ in range(2))
    for buffers in (landed, old):
        buffers.fill_pages(torch.arange(POOL_PAGES), 0xA5)  # bytes outside the new slots must stay as they were
    # the old path: bf16 rows gathered, every rank quantizing all of them where they land
    bf16 = [x.to(torch.bfloat16) for x in (kv_c, k_pe, index_k)]
    pack_mla_kv(bf16[0], bf16[1], old.kv[0], slots)
    pack_mla_kv(bf16[0], bf16[1], old.kv[1], slots)
    quantize_index_keys(bf16[2], old.index[0], slots)
    for layer in (0, 1):  # with and without indexer keys
        sent = [NewRows(spec, local, r, torch.device("cpu")).pack(layer, kv_c[idx], k_pe[idx], index_k[idx])
                for r, idx in enumerate(local)]
        gathered = torch.stack(sent)  # the all-gather: bytes, rank by rank
        rows = NewRows(spec, local, 0, torch.device("cpu"))
        assert gathered.shape == (len(counts), rows.layout(layer).nbytes)
        if spec.has_indexer(layer):
            rows.land_index(layer, gathered, landed.index[layer], slots)
        rows.land_kv(layer, gathered, landed.kv[layer], slots)
        assert torch.equal(landed.kv_pages(layer), old.kv_pages(layer)), f"layer {layer}: KV bytes differ"
    assert torch.equal(landed.index[0], old.index[0]), "index-key bytes differ"


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("rows", [1, 63, 64, 65, 130])
def test_send_buffer_bytes_follow_the_layout(rows, kv_dtype):
    """The send buffer is the rows as stored, indexer keys in whole pages: sizes from ``dsa_kernels.layout``."""
    spec = _spec(kv_dtype)
    new = NewRows(spec, [torch.arange(rows)], 0, torch.device("cpu"))
    kv = rows * mla_row_bytes(L, R, kv_dtype)
    assert new.layout(1).nbytes == new.layout(1).kv_bytes == kv  # layer 1: no indexer
    assert new.layout(0).nbytes == kv + -(-rows // PAGE_SIZE) * index_page_bytes(D)
    assert new.layout(0).kv_bytes == kv
