"""Prefix index: match/insert/split, locks, LRU eviction device -> host -> gone, load-back."""

from __future__ import annotations

import threading

import pytest

from hicache.device_pool import DSADevicePool
from hicache.host_pool import DSAHostPool
from hicache.load_pipeline import LayerwiseLoader
from hicache.radix import PrefixIndex, load_back
from tests.hicache.conftest import SPEC, fill_random, same_pages


def toks(*blocks: int, tail: int = 0) -> list[int]:
    """Token ids: one 64-token block per value (block b = [b * 1000, ...]), plus a partial tail."""
    out = [b * 1000 + i for b in blocks for i in range(64)]
    return out + list(range(-tail, 0))


@pytest.fixture
def tree(rt, pools):
    dev, host = pools
    return PrefixIndex(rt, dev, host)


def cache(tree: PrefixIndex, tokens: list[int], seed: int) -> list[int]:
    pages = tree.device_pool.allocator.alloc(len(tokens) // 64)
    fill_random(tree.device_pool, pages, seed)
    assert tree.insert(tokens, pages) == 0
    return pages


def test_match_insert_and_split(tree):
    pages = cache(tree, toks(1, 2, 3), seed=1)
    m = tree.match_prefix(toks(1, 2, 3, tail=10))
    assert m.device_pages == pages and m.device_tokens == 192 and m.host_pages == []
    m = tree.match_prefix(toks(1, 2, 9))  # diverges inside the edge: split after 2 pages
    assert m.device_pages == pages[:2] and len(tree.root.children[tuple(toks(1))].children) == 1
    assert tree.match_prefix(toks(7)).device_pages == []
    assert tree.match_prefix(toks(1)[:63]).device_pages == []  # under one page: nothing to match


def test_insert_reports_already_cached_pages(tree):
    first = cache(tree, toks(1, 2), seed=1)
    mine = tree.device_pool.allocator.alloc(3)
    assert tree.insert(toks(1, 2, 5), mine) == 2  # the caller still owns mine[:2]
    assert tree.match_prefix(toks(1, 2, 5)).device_pages == first + mine[2:]
    with pytest.raises(ValueError, match="device_pages: expected 1 pages for 64 tokens, got 2"):
        tree.insert(toks(8), [0, 1])


def test_locked_pages_are_never_evicted(tree):
    cache(tree, toks(1, 2), seed=1)
    cache(tree, toks(3), seed=2)
    m = tree.match_prefix(toks(1, 2))
    tree.lock(m.last_node)
    assert tree.evict_device(10) == 1  # only the unlocked leaf [3]
    assert tree.match_prefix(toks(1, 2)).device_tokens == 128
    tree.unlock(m.last_node)
    with pytest.raises(ValueError, match="unbalanced unlock"):
        tree.unlock(m.last_node)


def test_lru_order_and_free_only_after_d2h(rt, tree, sanitized):
    old = cache(tree, toks(1), seed=1)
    new = cache(tree, toks(2), seed=2)
    tree.match_prefix(toks(2))  # touch [2]: [1] is now least recently used
    gate = threading.Event()
    rt.stream("offload").submit(lambda: gate.wait(10))
    free_before = tree.device_pool.allocator.available
    assert tree.evict_device(1) == 1
    assert tree.pending_device_free == 1 and tree.device_pool.allocator.available == free_before
    m = tree.match_prefix(toks(1))
    assert m.device_pages == [] and len(m.host_pages) == 1 and len(m.host_fences) == 1
    assert tree.match_prefix(toks(2)).device_pages == new
    gate.set()
    m.host_fences[0].synchronize()
    assert tree.reclaim() == 1 and tree.device_pool.allocator.available == free_before + 1
    assert same_pages(tree.device_pool, old, tree.host_pool, m.host_pages)


def test_host_eviction_and_parents(tree):
    cache(tree, toks(1, 2), seed=1)
    assert tree.evict_device(2) == 2
    for fence in tree.match_prefix(toks(1, 2)).host_fences:
        fence.synchronize()
    tree.reclaim()
    assert tree.evict_host(2) == 2
    assert tree.match_prefix(toks(1, 2)).host_pages == [] and tree.host_pool.allocator.available == 8


def test_load_back_restores_the_bytes(rt, tree, sanitized):
    pages = cache(tree, toks(4, 5, 6), seed=3)
    snapshot = DSADevicePool(SPEC, 3)
    for layer in SPEC.indexer_layers:
        snapshot.index[layer][:] = tree.device_pool.index[layer][pages]
    for layer in range(SPEC.num_layers):
        snapshot.kv_pages(layer)[:] = tree.device_pool.kv_pages(layer)[pages]
    tree.evict_device(3)
    m = tree.match_prefix(toks(4, 5, 6))
    assert m.host_tokens == 192
    loader = LayerwiseLoader(rt, tree.device_pool, tree.host_pool)
    load = load_back(tree, m, loader)
    load.kv_ready[SPEC.num_layers - 1].synchronize()
    assert same_pages(snapshot, [0, 1, 2], tree.device_pool, m.device_pages)
    assert tree.match_prefix(toks(4, 5, 6)).device_pages == m.device_pages


def test_without_host_tier_eviction_drops(rt):
    tree = PrefixIndex(rt, DSADevicePool(SPEC, 4))
    cache(tree, toks(1, 2), seed=1)
    assert tree.evict_device(2) == 2 and tree.reclaim() == 0
    assert tree.device_pool.allocator.available == 4
    assert tree.match_prefix(toks(1, 2)).device_pages == [] and not tree.root.children


def test_host_pool_subset_layers(rt):
    """A rank's host tier may hold only its owned layers: offload copies only those."""
    dev, host = DSADevicePool(SPEC, 4), DSAHostPool(SPEC, 4, layers=(1, 2))
    tree = PrefixIndex(rt, dev, host)
    pages = cache(tree, toks(1), seed=1)
    tree.evict_device(1)
    m = tree.match_prefix(toks(1))
    m.host_fences[0].synchronize()
    assert same_pages(dev, pages, host, m.host_pages, layers=(1, 2))
