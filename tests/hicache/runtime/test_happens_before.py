"""The happens-before tracker: FIFO order per stream, record/wait edges, host synchronizes, and the
CUDA rule that a wait sees the event's latest record at the time of the call."""

from __future__ import annotations

from hicache.runtime.happens_before import HBRuntime
from hicache.runtime.streams import get_runtime


def make():
    rt = HBRuntime(get_runtime("emulated"))
    return rt, rt.stream("side"), rt.compute_stream()


def test_wait_orders_only_what_came_before_the_record():
    rt, side, compute = make()
    try:
        side.submit(lambda: None, name="a")
        rt.mark("after a", side)
        ev = rt.event()
        ev.record(side)
        side.submit(lambda: None, name="b")
        rt.mark("after b", side)
        compute.submit(lambda: None, name="c")
        compute.wait_event(ev)
        rt.mark("consumer", compute)  # (a mark is a point after the ops issued so far: c here)
        assert rt.ordered("after a", "consumer")
        assert not rt.ordered("after b", "consumer")  # b was issued after the record waited for
        assert not rt.ordered("consumer", "after a")
    finally:
        rt.close()


def test_no_wait_no_order_and_fifo_within_a_stream():
    rt, side, compute = make()
    try:
        side.submit(lambda: None)
        rt.mark("side op", side)
        compute.submit(lambda: None)
        rt.mark("compute op", compute)
        assert not rt.ordered("side op", "compute op") and not rt.ordered("compute op", "side op")
        side.submit(lambda: None)
        rt.mark("later side op", side)
        assert rt.ordered("side op", "later side op")
    finally:
        rt.close()


def test_host_synchronize_orders_later_submissions_and_rerecord_moves_the_event():
    rt, side, compute = make()
    try:
        side.submit(lambda: None)
        rt.mark("first", side)
        ev = rt.event()
        ev.record(side)
        side.submit(lambda: None)
        rt.mark("second", side)
        ev.record(side)  # a wait issued now sees this record, not the first
        other = rt.stream("other")
        other.wait_event(ev)
        rt.mark("other", other)
        assert rt.ordered("second", "other")
        side.submit(lambda: None)
        rt.mark("third", side)
        side.synchronize()  # the host saw everything side did: what it issues next comes after
        compute.submit(lambda: None)
        rt.mark("after sync", compute)
        assert rt.ordered("third", "after sync")
    finally:
        rt.close()
