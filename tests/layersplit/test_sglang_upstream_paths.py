"""Where the plug-in pool meets upstream's own paths: SGLang's unit tests call the layer-split pool's
methods on stand-in objects (the plug-in's class then answers with upstream's methods); the one
intended difference, the no-communicator prefetch waiting for HiCache's layer; the inherited
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


def test_standin_prefetch_without_communicator_is_upstreams():
    """A stand-in holding upstream's attributes only (no communicator): one synchronous broadcast,
    no wait, the layer marked as landed: upstream's method ran."""
    sent = []
    standin = SimpleNamespace(remote_kv_layer_id=None, pending_remote_kv_broadcast=False,
                              pending_remote_kv_layer_id=None, layer_broadcast_comm=None, remote_kv_buffer=object(),
                              kv_buffer=[object()], start_layer=0, _local_layer_idx=lambda i: i,
                              _is_layer_owned=lambda _: True)
    standin._broadcast_tensor_from_owner = lambda t, i, *, src_tensor, use_layer_broadcast_comm: sent.append(i)
    counter = SimpleNamespace(wait_until=lambda _: pytest.fail("a stand-in gets upstream's (unwaited) prefetch"))
    Plus.prefetch_kv_buffer(standin, layer_id=0, layer_transfer_counter=counter, layer_transfer_idx=3)
    assert sent == [0] and standin.remote_kv_layer_id == 0


def test_standin_read_returns_the_owners_bytes():
    owner = {i: torch.full((3, 1, 8), float(i + 1)) for i in range(4)}
    standin = SimpleNamespace(start_layer=0, remote_kv_layer_id=None, pending_remote_kv_broadcast=False,
                              pending_remote_kv_layer_id=None, remote_kv_buffer=torch.zeros(3, 1, 8),
                              kv_buffer=[owner[i] for i in range(4)], _local_layer_idx=lambda i: i,
                              _is_layer_owned=lambda _: True)
    standin._broadcast_tensor_from_owner = lambda t, i, **kw: t.copy_(owner[i])
    for i in range(4):
        assert torch.equal(Plus._get_broadcastable_kv_buffer(standin, i), owner[i])
        assert standin.remote_kv_layer_id == i


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
