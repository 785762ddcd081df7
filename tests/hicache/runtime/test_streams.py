"""Emulated device runtime: FIFO order, stream-only waits, record/query/synchronize, errors, delays."""

from __future__ import annotations

import threading
import time

import pytest

from hicache.runtime.streams import EmulatedRuntime, get_runtime


@pytest.fixture
def rt():
    runtime = EmulatedRuntime()
    yield runtime
    runtime.close()


def test_fifo_order(rt):
    s, seen = rt.stream("a"), []
    for i in range(200):
        s.submit(lambda i=i: seen.append(i))
    s.synchronize()
    assert seen == list(range(200))


def test_wait_event_blocks_the_stream_not_the_host(rt):
    load, fwd = rt.stream("load"), rt.stream("forward")
    gate, order = threading.Event(), []
    load.submit(lambda: gate.wait(5))
    load.submit(lambda: order.append("load"))
    ready = rt.event()
    ready.record(load)
    fwd.wait_event(ready)
    fwd.submit(lambda: order.append("forward"))
    t0 = time.perf_counter()
    assert not ready.query()  # the host got here while the load stream is still blocked
    assert time.perf_counter() - t0 < 1.0
    time.sleep(0.05)
    assert order == [], "forward ran before the event it waits on"
    gate.set()
    fwd.synchronize()
    assert order == ["load", "forward"] and ready.query()


def test_wait_uses_the_latest_record_at_call_time(rt):
    a, b = rt.stream("a"), rt.stream("b")
    gate, order = threading.Event(), []
    ev = rt.event()
    ev.record(a)  # first record: completes at once
    a.synchronize()
    a.submit(lambda: gate.wait(5))
    ev.record(a)  # second record: behind the gate
    b.wait_event(ev)
    b.submit(lambda: order.append("b"))
    time.sleep(0.05)
    assert order == []
    gate.set()
    b.synchronize()
    assert order == ["b"]


def test_unrecorded_event_is_ready(rt):
    ev = rt.event()
    assert ev.query()
    ev.synchronize()
    rt.stream("a").wait_event(ev)
    rt.stream("a").synchronize()


def test_error_surfaces_at_next_synchronize_and_stream_keeps_running(rt):
    s, seen = rt.stream("a"), []
    s.submit(lambda: 1 / 0, name="bad")
    s.submit(lambda: seen.append("after"))
    ev = rt.event()
    ev.record(s)
    with pytest.raises(RuntimeError, match="stream 'a': an operation failed: ZeroDivisionError"):
        ev.synchronize()
    s.synchronize()  # the error was reported once
    assert seen == ["after"]


def test_delay_hook_stalls_before_the_op(rt):
    calls = []
    rt.delay_hook = lambda stream, op: calls.append((stream, op)) or (0.05 if op == "slow" else 0.0)
    s = rt.stream("a")
    t0 = time.perf_counter()
    s.submit(lambda: None, name="slow")
    s.synchronize()
    assert time.perf_counter() - t0 >= 0.05 and ("a", "slow") in calls


def test_get_runtime_choice():
    assert get_runtime("emulated").kind == "emulated"
    with pytest.raises(ValueError, match="runtime: expected 'auto', 'cuda' or 'emulated'"):
        get_runtime("rocm")
