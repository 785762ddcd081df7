"""The init race: a device pool zero-filled by a kernel on the compute stream, then written by the
non-blocking load stream with no event between them (PyTorch's CUDA sanitizer: ``aten::index_put_``
on the load stream vs ``aten::zeros`` on stream 0).

Our sanitizer books a host thread's tensor creation as a write by the compute stream, so the race
is reported on a CPU, on every run. Each fix is proven twice: clean with it, reported without it
(``unsafe_skip={'init'}`` for the loader; the overlap benchmark's forward wait removed).
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

import pytest
import torch

from hicache import sanitizer
from hicache.device_pool import DSADevicePool
from hicache.host_pool import DSAHostPool
from hicache.load_pipeline import LayerwiseLoader
from tests.hicache.conftest import SPEC, fill_random, same_pages
from tests.hicache.sanitizer.test_sanitizer import _stress

ZERO_FILL = ("stream compute", "aten::zeros", "paged_buffers.py")


def _init_hazards(hazards: list[str]) -> list[str]:
    return [h for h in hazards if all(word in h for word in ZERO_FILL)]


def test_creation_on_a_host_thread_is_compute_stream_work(rt):
    """A factory op of the host thread is a kernel on the compute stream: later ops of the same
    host thread follow it, a side stream does not; host work (:func:`sanitizer.host_work`, memory
    declared host memory) is not booked so."""
    side = rt.stream("side")
    with sanitizer.sanitized() as san:
        x = torch.zeros(8)  # the compute stream's zero fill
        x.add_(1)  # the creating host thread: ordered after it
        with sanitizer.host_work():
            h = torch.zeros(8)
        p = torch.empty(8)
        sanitizer.mark_host_memory(p)  # pinned staging: its creation was host work
        side.submit(lambda: (h.add_(1), torch.zeros(8).copy_(p, non_blocking=True)), "host-made")  # p: a DMA read
        side.synchronize()
        assert san.hazards == [], san.format()
        side.submit(lambda: x.mul_(2), "device-made")
        side.synchronize()
    assert [(h.kind, h.first.op, h.first.agent, h.second.agent) for h in san.hazards] == [
        ("write-write", "aten::zeros", "stream compute", "stream side")], san.format()


def _load_once(rt, unsafe: frozenset[str]) -> tuple[sanitizer.Sanitizer, bool]:
    with sanitizer.sanitized() as san:
        dev, host = DSADevicePool(SPEC, 8), DSAHostPool(SPEC, 8)  # zero-filled under the sanitizer
        host_pages, dev_pages = host.allocator.alloc(3), dev.allocator.alloc(3)
        fill_random(host, host_pages, seed=0)
        load = LayerwiseLoader(rt, dev, host, unsafe).start_loading(host_pages, dev_pages, poison=0xFF)
        load.kv_ready[SPEC.num_layers - 1].synchronize()
        same = same_pages(host, host_pages, dev, dev_pages)
    return san, same


def test_loader_waits_for_the_pools_zero_fill(rt):
    san, same = _load_once(rt, frozenset())
    assert same and san.hazards == [], san.format()


def test_teeth_loader_without_its_init_wait(rt):
    san, same = _load_once(rt, frozenset({"init"}))
    assert same  # the data is right on a CPU: only the sanitizer sees the missing edge
    hits = _init_hazards([str(h) for h in san.hazards])
    assert hits and all("stream load" in h and h.startswith("write-write") for h in hits), san.format()
    print(hits[0])


@pytest.mark.slow
def test_teeth_stress_without_the_init_wait():
    """The stress under the sanitizer: clean with the loader's init wait
    (``test_stress_is_clean_under_the_sanitizer``), the zero fill reported without it, every run."""
    reports = [_stress(frozenset({"init"})) for _ in range(2)]
    hits = [_init_hazards(r.sanitizer_hazard_list) for r in reports]
    assert hits[0] and sorted(hits[0]) == sorted(hits[1]), reports[0].sanitizer_hazard_list
    assert all("stream load" in h for h in hits[0]) and any("fill_pages" in h for h in hits[0]), hits[0]
    assert reports[0].corrupted_outputs == 0  # no stall can expose it: the sanitizer needs no luck


def _bench_module():
    from layersplit.gpu_check.run import _overlap_bench  # benchmarks/hicache_overlap.py, loaded from the checkout

    return _overlap_bench()


EDGES = {  # id: (the loader's init wait, the benchmark forward's wait)
    "both-edges": (True, True),
    "no-loader-init": (False, True),
    "neither": (False, False),
}


@pytest.mark.parametrize("loader_init, forward_wait", list(EDGES.values()), ids=list(EDGES))
def test_overlap_benchmark_streams_wait_for_its_setup(monkeypatch, loader_init, forward_wait):
    """The benchmark's setup (pools, page table, inputs) is compute-stream work. Clean with both
    edges; without the loader's, the load stream races the zero fill; the forward stays ordered by
    its own wait (with the loader's edge, the host's sync on the first load also orders it)."""
    bench = _bench_module()
    if not loader_init:
        monkeypatch.setattr(bench, "LayerwiseLoader", functools.partial(LayerwiseLoader, unsafe_skip={"init"}))
    if not forward_wait:
        monkeypatch.setattr(bench, "compute_ready", lambda rt: rt.event())  # never recorded: orders nothing
    args = bench.parse(["--layers", "2", "--pages", "2", "--queries", "2", "--heads", "2", "--index-heads", "2",
                        "--repeats", "1", "--runtime", "emulated"])
    with sanitizer.sanitized() as san:
        bench.Bench(args).run()
    hazards = [str(h) for h in san.hazards]
    assert bool(hazards) == (not loader_init), san.format()
    assert all("stream compute" in h for h in hazards), san.format()
    assert any("stream forward" in h for h in hazards) == (not forward_wait), san.format()
