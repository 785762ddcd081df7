"""``indexer_topk`` with host-known ``block_extents`` (``query_block_extents``): same result as the
device-computed extents, checked cheaply, and no host read on the GPU path (the Triton scores)."""

from __future__ import annotations

import pytest
import torch

import dsa_kernels
from dsa_kernels import query_block_extents
from tests.dsa_kernels.helpers import count_host_reads
from tests.dsa_kernels.test_indexer import CASES, build, to_device


@pytest.mark.parametrize("positions,max_context,query_block,want", [
    ([5, 9, 2, 70], 64, 2, [10, 64]),
    ([5, 9, 2, 70, 3], 100, 2, [10, 71, 4]),  # a last, shorter block
    ([0], 1, 2048, [1]),
    ([], 10, 4, []),
], ids=["two-blocks-clamped", "odd-tail", "one-row", "empty"])
def test_query_block_extents(positions, max_context, query_block, want):
    assert query_block_extents(positions, max_context, query_block=query_block) == want
    assert query_block_extents(torch.tensor(positions, dtype=torch.int64), max_context, query_block) == want


def test_query_block_extents_refuses_device_tensor():
    with pytest.raises(ValueError, match="positions: expected a host"):
        query_block_extents(torch.zeros(3, dtype=torch.int64, device="meta"), 10)


@pytest.mark.parametrize("name,chunk,query_block", [("three-requests", 48, 5), ("four-requests-d64", 16, 7),
                                                    ("page-boundary-65-k2048", 1000, 2048)])
@pytest.mark.slow
def test_given_extents_equal_computed(backend, device, monkeypatch, name, chunk, query_block):
    monkeypatch.setenv("LAYERSPLIT_KERNEL_BACKEND", backend)
    case = CASES[name]
    args, max_ctx, _ = build(case, seed=len(name))
    extents = query_block_extents(args[5], max_ctx, query_block)
    dev_args = to_device(args, device)
    want = dsa_kernels.indexer_topk(*dev_args, max_ctx, case.topk, chunk=chunk, query_block=query_block)
    got = dsa_kernels.indexer_topk(*dev_args, max_ctx, case.topk, chunk=chunk, query_block=query_block,
                                   block_extents=extents)
    assert torch.equal(got, want)


@pytest.mark.parametrize("extents,match", [([10], "expected 3 entries"), ([10, 10, 10, 10], "expected 3 entries"),
                                           ([10, 500, 3], r"expected values in \[0, max_context=")],
                         ids=["too-few", "too-many", "past-max-context"])
def test_bad_extents_refused(extents, match):
    args, max_ctx, _ = build(CASES["three-requests"], seed=0)  # 20 query rows: 3 blocks of 7
    with pytest.raises(ValueError, match=match):
        dsa_kernels.indexer_topk(*args, max_ctx, 8, query_block=7, block_extents=extents)


def test_no_host_read_with_given_extents(monkeypatch):
    """On the GPU path (Triton scores, torch top-k merge) one call reads nothing back with
    ``block_extents``; without them it reads the extents (the documented sync) -- the teeth."""
    monkeypatch.setenv("LAYERSPLIT_KERNEL_BACKEND", "triton")
    case = CASES["three-requests"]
    args, max_ctx, _ = build(case, seed=1)
    extents = query_block_extents(args[5], max_ctx, 7)
    with count_host_reads() as given:
        dsa_kernels.indexer_topk(*args, max_ctx, case.topk, chunk=64, query_block=7, block_extents=extents)
    with count_host_reads() as computed:
        dsa_kernels.indexer_topk(*args, max_ctx, case.topk, chunk=64, query_block=7)
    assert given == [], f"host reads with block_extents: {given}"
    assert "tolist" in computed, f"the device-extents path should read them back, saw {computed}"
