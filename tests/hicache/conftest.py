from __future__ import annotations

import pytest
import torch

from hicache.device_pool import DSADevicePool
from hicache.host_pool import DSAHostPool
from hicache.paged_buffers import DSACacheSpec
from hicache.runtime.streams import EmulatedRuntime

SPEC = DSACacheSpec(num_layers=4, kv_lora_rank=128, rope_dim=16, index_head_dim=32, indexer_layers=(0, 2))


@pytest.fixture
def rt():
    runtime = EmulatedRuntime()
    yield runtime
    runtime.close()


@pytest.fixture
def pools():
    return DSADevicePool(SPEC, 8), DSAHostPool(SPEC, 8)


def fill_random(pool, pages: list[int], seed: int) -> None:
    """Random bytes in every layer's KV and indexer pages of ``pages``."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.tensor(pages)
    for layer in pool.layers:
        kv = pool.kv_pages(layer)
        kv[idx] = torch.randint(0, 255, (len(pages), kv.shape[1]), dtype=torch.uint8, generator=g)
        if layer in pool.index:
            pool.index[layer][idx] = torch.randint(0, 255, (len(pages), pool.index[layer].shape[1]), dtype=torch.uint8, generator=g)


def same_pages(a, a_pages: list[int], b, b_pages: list[int], layers=None) -> bool:
    ai, bi = torch.tensor(a_pages), torch.tensor(b_pages)
    for layer in layers if layers is not None else a.layers:
        if not torch.equal(a.kv_pages(layer)[ai], b.kv_pages(layer)[bi]):
            return False
        if layer in a.index and not torch.equal(a.index[layer][ai], b.index[layer][bi]):
            return False
    return True
