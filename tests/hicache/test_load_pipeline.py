"""Layer-wise loader: per-layer events, indexer keys first, host pages held, reuse fences."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
import torch

from dsa_kernels.layout import mla_row_bytes
from hicache.device_pool import DSADevicePool
from hicache.host_pool import DSAHostPool
from hicache.load_pipeline import LayerwiseLoader
from tests.hicache.conftest import SPEC, fill_random, same_pages


def gate_stream(stream) -> threading.Event:
    gate = threading.Event()
    stream.submit(lambda: gate.wait(10), name="gate")
    return gate


def test_events_per_layer_and_data(rt, pools, sanitized):
    dev, host = pools
    host_pages = host.allocator.alloc(3)
    fill_random(host, host_pages, seed=1)
    dev_pages = dev.allocator.alloc(3)
    loader = LayerwiseLoader(rt, dev, host)
    load = loader.start_loading(host_pages, dev_pages)
    assert sorted(load.indexer_ready) == [0, 2] and sorted(load.kv_ready) == [0, 1, 2, 3]
    load.kv_ready[3].synchronize()
    assert all(e.query() for e in [*load.indexer_ready.values(), *load.kv_ready.values()])
    assert same_pages(host, host_pages, dev, dev_pages)


def test_fp8_rows_reload_as_bytes(rt, sanitized):
    """An fp8 tier (uint8 656-byte-layout rows) reloads byte for byte, and moves fewer bytes than bf16."""
    spec = dataclasses.replace(SPEC, kv_dtype="fp8")
    dev, host = DSADevicePool(spec, 8), DSAHostPool(spec, 8)
    host_pages, dev_pages = host.allocator.alloc(3), dev.allocator.alloc(3)
    fill_random(host, host_pages, seed=2)
    load = LayerwiseLoader(rt, dev, host).start_loading(host_pages, dev_pages)
    load.kv_ready[3].synchronize()
    assert same_pages(host, host_pages, dev, dev_pages)
    index = 2 * 3 * spec.index_page_bytes  # two indexer layers
    assert load.bytes_copied == 4 * 3 * 64 * mla_row_bytes(128, 16, "fp8") + index
    assert load.bytes_copied < 4 * 3 * 64 * mla_row_bytes(128, 16, "bf16") + index


def test_indexer_keys_land_before_kv(rt, pools, sanitized):
    dev, host = pools
    hp, dp = host.allocator.alloc(2), dev.allocator.alloc(2)
    fill_random(host, hp, seed=2)
    order = []
    rt.delay_hook = lambda stream, op: order.append(op) or 0.0
    LayerwiseLoader(rt, dev, host).start_loading(hp, dp).kv_ready[3].synchronize()
    copies = [op for op in order if op.startswith(("index[", "kv["))]
    assert copies == ["index[0]", "kv[0]", "kv[1]", "index[2]", "kv[2]", "kv[3]"]


def test_forward_waits_only_for_its_layer(rt, pools, sanitized):
    """wait_indexer(l) lets the forward read layer l's keys while later layers still load."""
    dev, host = pools
    hp, dp = host.allocator.alloc(2), dev.allocator.alloc(2)
    fill_random(host, hp, seed=3)
    loader = LayerwiseLoader(rt, dev, host)
    load = loader.start_loading(hp, dp)
    fwd = rt.stream("forward")
    seen = {}
    load.wait_indexer(0, fwd)
    fwd.submit(lambda: seen.setdefault("index0", torch.equal(dev.index[0][dp], host.index[0][hp])))
    load.wait_kv(3, fwd)
    fwd.submit(lambda: seen.setdefault("kv3", torch.equal(dev.kv_pages(3)[dp], host.kv_pages(3)[hp])))
    fwd.synchronize()
    assert seen == {"index0": True, "kv3": True}


def test_host_pages_held_until_load_completes(rt, pools, sanitized):
    dev, host = pools
    hp, dp = host.allocator.alloc(2), dev.allocator.alloc(2)
    loader = LayerwiseLoader(rt, dev, host)
    gate = gate_stream(loader.stream)
    load = loader.start_loading(hp, dp)
    host.allocator.free(hp)  # the caller lets go; the load still holds them
    assert [host.allocator.refcount(p) for p in hp] == [1, 1]
    assert loader.reclaim() == 0 and host.allocator.available == 6
    gate.set()
    load.kv_ready[3].synchronize()
    assert loader.reclaim() == 1 and host.allocator.available == 8 and loader.inflight == 0


@pytest.mark.parametrize("unsafe", [False, True], ids=["fenced", "unsafe-skip-fence"])
def test_reallocated_pages_fenced_behind_forward(rt, pools, unsafe):
    """A load into pages freed by a still-running forward must wait for it (SGLang #36738)."""
    dev, host = pools
    dp = dev.allocator.alloc(8)
    fill_random(dev, dp, seed=4)
    before = dev.kv_pages(0)[dp[:2]].clone()
    fwd = rt.stream("forward")
    gate = gate_stream(fwd)  # the forward still reads dp[:2]
    done = rt.event()
    done.record(fwd)
    dev.allocator.free(dp[:2], fence=done)
    hp = host.allocator.alloc(2)
    fill_random(host, hp, seed=5)
    again = dev.allocator.alloc(2)
    loader = LayerwiseLoader(rt, dev, host, unsafe_skip={"fence"} if unsafe else set())
    load = loader.start_loading(hp, again, dev.allocator.fences(again))
    deadline = time.monotonic() + (5.0 if unsafe else 0.1)  # unsafe: nothing holds the copy back, give it time
    while time.monotonic() < deadline and not load.kv_ready[0].query():
        time.sleep(0.005)
    overwritten = not torch.equal(dev.kv_pages(0)[torch.tensor(again)], before)
    gate.set()
    load.kv_ready[3].synchronize()
    assert overwritten is unsafe, "the fence must hold the load back (and only the unsafe flag lets it through)"
    assert same_pages(host, hp, dev, again)


def test_errors(rt, pools):
    dev, host = pools
    loader = LayerwiseLoader(rt, dev, host)
    with pytest.raises(ValueError, match="device_pages: expected 2 pages"):
        loader.start_loading([0, 1], [0])
    with pytest.raises(ValueError, match="incref: expected an allocated page, got free page 0"):
        loader.start_loading([0], [0])  # host pages must be allocated (held by the caller)
    load = loader.start_loading(host.allocator.alloc(1), dev.allocator.alloc(1))
    with pytest.raises(ValueError, match=r"expected an indexer layer of this load \[0, 2\], got 1"):
        load.wait_indexer(1, rt.stream("forward"))
    with pytest.raises(ValueError, match="unsafe_skip: expected a subset of"):
        LayerwiseLoader(rt, dev, host, unsafe_skip={"everything"})
    load.kv_ready[3].synchronize()
