"""Where the plug-in pool meets upstream's own paths, on real plug-in pools: SGLang's unit tests of
the layer-split pool's whole-buffer prefetch and read (adapted: upstream calls the methods on
stand-in objects; here a plug-in pool without batch pages runs upstream's methods); the one intended
difference, the no-communicator prefetch waiting for HiCache's layer; the inherited
``LayerSplitIndexKeyCache.move`` bug, overridden. Real sglang package, CPU."""

from __future__ import annotations

import os
import socket
from types import SimpleNamespace

import pytest
import torch

if os.environ.get("CI"):
    import sglang  # noqa: F401
else:
    pytest.importorskip("sglang")

from layersplit.sglang_plugin import compat, startup  # noqa: E402
from layersplit.sglang_plugin.pool import make_pool_class  # noqa: E402
from layersplit.sglang_plugin.stress import PAGE, SIZE, dsa_pool_kwargs, published  # noqa: E402

Plus = make_pool_class()


def _whole_buffer_pool(group, monkeypatch):
    """A real plug-in pool of rank 0 of 2 on a one-rank gloo group (rank 0's broadcasts of its own
    layers are real collectives), ``pool`` landing, no batch pages: upstream's whole-buffer path."""
    monkeypatch.setenv("LAYERSPLIT_SGLANG_LANDING", "pool")  # upstream's landing layer kept
    with published(world=2, group=group):
        pool = Plus(SIZE, **dsa_pool_kwargs(), layer_shard_rank=0, layer_shard_size=2)
    assert pool.layer_broadcast_comm is None and pool.forward_pages is None
    for i in range(3):  # rank 0 owns layers 0, 1, 2
        pool.kv_buffer[i].copy_(torch.full_like(pool.kv_buffer[i], float(i + 1)))
    return pool


def test_whole_buffer_prefetch_without_communicator(one_rank_group, monkeypatch):
    """SGLang's prefetch test without a communicator: one synchronous broadcast of the owner's
    buffer into the landing layer, the layer marked as landed; the plug-in waits for HiCache's layer
    first (upstream broadcasts at once: test_prefetch_without_communicator_waits_for_the_hicache_layer)."""
    pool = _whole_buffer_pool(one_rank_group, monkeypatch)
    calls, broadcast = [], pool._broadcast_tensor_from_owner
    pool._broadcast_tensor_from_owner = lambda t, i, **kw: calls.append(("broadcast", i)) or broadcast(t, i, **kw)
    counter = SimpleNamespace(wait_until=lambda idx: calls.append(("wait", idx)))
    with published(world=2, group=one_rank_group):
        pool.prefetch_kv_buffer(layer_id=0, layer_transfer_counter=counter, layer_transfer_idx=3)
    assert calls == [("wait", 3), ("broadcast", 0)] and pool.remote_kv_layer_id == 0
    assert torch.equal(pool.remote_kv_buffer.view(torch.uint8), pool.kv_buffer[0].view(torch.uint8))


def test_whole_buffer_read_returns_the_owners_bytes(one_rank_group, monkeypatch):
    """SGLang's read test: each layer read through upstream's landing layer holds the owner's bytes.
    Upstream's stand-in owns every layer; here rank 0 reads its own layers (a single process cannot
    receive rank 1's layers: the two-rank reads are test_non_owned_layers_after_gloo_broadcast)."""
    pool = _whole_buffer_pool(one_rank_group, monkeypatch)
    with published(world=2, group=one_rank_group):
        for i in range(3):
            read = pool._get_broadcastable_kv_buffer(i)
            assert read.data_ptr() == pool.remote_kv_buffer.data_ptr() and pool.remote_kv_layer_id == i
            assert torch.equal(read.view(torch.uint8), pool.kv_buffer[i].view(torch.uint8))


class LoadingCounter:
    """HiCache's layer counter where the layer's host->device copy completes when it is waited for
    (what a stream wait on the load event means): before that the owner's rows are stale."""

    def __init__(self, pool, layer: int, rows: torch.Tensor) -> None:
        self.pool, self.layer, self.rows, self.loaded = pool, layer, rows, False

    def wait_until(self, idx: int) -> None:
        if idx == self.layer and not self.loaded:
            self.pool.kv_buffer[idx].copy_(self.rows)
            self.loaded = True


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def one_rank_group():
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_port()}", rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("cls", ["upstream", "plugin", "plugin-unsafe"])
def test_prefetch_without_communicator_waits_for_the_hicache_layer(cls, one_rank_group, monkeypatch):
    """The owner prefetches its layer 0 (upstream's synchronous path: no broadcast communicator)
    while HiCache is still loading it. Upstream broadcasts the stale rows and later reads return them
    (read-before-ready); the plug-in waits for the layer first, and with that wait switched off
    (``LAYERSPLIT_SGLANG_UNSAFE_SKIP=load_wait``) reads stale rows too."""
    if cls == "plugin-unsafe":
        monkeypatch.setenv("LAYERSPLIT_SGLANG_UNSAFE_SKIP", "load_wait")
    startup.publish(startup.Plan("pool", (), 2, PAGE, 576 * 2, PAGE * 132))  # upstream's landing layer kept
    try:
        with published(world=2, group=one_rank_group):
            base = compat.resolve("layer_split_pool") if cls == "upstream" else Plus
            pool = base(SIZE, **dsa_pool_kwargs(), layer_shard_rank=0, layer_shard_size=2)
            loaded = torch.randn(SIZE + PAGE, 1, 576, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
            counter = LoadingCounter(pool, 0, loaded)
            pool.register_layer_transfer_counter(counter)
            if cls != "upstream":
                pool.set_forward_pages(None)  # upstream's whole-buffer path (what a graph replay runs)
            pool.prefetch_kv_buffer(0, counter, 0)
            read = pool.get_key_buffer(0)  # waits for the layer (now loaded), then reads the landing
    finally:
        startup.forget()
    fresh = torch.equal(read.view(torch.uint8), loaded.view(torch.uint8))
    assert fresh == (cls == "plugin"), f"{cls}: read {'loaded' if fresh else 'stale'} rows"


def test_index_key_move_is_by_token_not_by_page():
    """Moving token rows (``move_kv_cache``): upstream's layer-split cache indexes page rows by token
    location (IndexError past the page count); the plug-in's moves each token's key and scale bytes
    inside their pages, like SGLang's plain pool."""
    src, tgt = torch.tensor([3, 70, 130]), torch.tensor([200, 10, 66])
    moved = {}
    with published(world=2):
        for name, cls in (("plain", compat.resolve("dsa_pool")), ("upstream", compat.resolve("layer_split_pool")),
                          ("plugin", Plus)):
            split = {} if name == "plain" else dict(layer_shard_rank=0, layer_shard_size=2)
            pool = cls(SIZE, **dsa_pool_kwargs(), **split)
            for buf in pool.index_key_cache.buffer:
                if buf.shape[0]:
                    buf.copy_(torch.randint(0, 255, buf.shape, generator=torch.Generator().manual_seed(9),
                                            dtype=torch.uint8).view(buf.dtype))
            try:
                pool.move_kv_cache(tgt, src)
            except IndexError:
                moved[name] = "IndexError"
                continue
            moved[name] = [b.clone() for b in pool.index_key_cache.buffer]
    assert moved["upstream"] == "IndexError"
    owned = [i for i, b in enumerate(moved["plugin"]) if b.shape[0]]
    assert owned and all(torch.equal(moved["plugin"][i].view(torch.uint8), moved["plain"][i].view(torch.uint8))
                         for i in owned)
