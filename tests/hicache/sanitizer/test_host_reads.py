"""Host reads the dispatcher never sees, and device-to-host copies read before their event.

Each pipeline is clean with its host-side wait and reports exactly one hazard of the right kind
without it, on every run: the sanitizer orders by happens-before, not by timing (no stall here).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hicache import sanitizer
from hicache.load_pipeline import compute_ready
from hicache.runtime.streams import EmulatedRuntime

READS = {  # how the host reads a tensor: the first two are not dispatched at all
    "tolist": lambda y: y.tolist(),
    "numpy": lambda y: y.numpy().sum(),
    "__array__": lambda y: np.asarray(y).sum(),
    "item": lambda y: y[0].item(),
    "__bool__": lambda y: bool(y[0]),
    "__int__": lambda y: int(y[0]),
    "__float__": lambda y: float(y[0]),
    "__index__": lambda y: [0, 1, 2, 3][y.long()[0]],
}


@pytest.fixture
def rt():
    runtime = EmulatedRuntime()
    yield runtime
    runtime.close()


def side_result_read_on_host(rt, read, synchronize: bool) -> sanitizer.Sanitizer:
    """A side stream writes ``y``; the host reads it, after the side stream's event or not."""
    side = rt.stream("side")
    with sanitizer.sanitized() as san:
        y = torch.zeros(4)
        side.wait_event(compute_ready(rt))  # y's zero fill is a kernel on the compute stream
        side.submit(lambda: y.add_(1), name="produce")
        done = rt.event()
        done.record(side)
        if synchronize:
            done.synchronize()  # the host waits for the side stream's write
        read(y)
        side.synchronize()  # (after the read: lets the side write be seen, orders nothing before it)
    return san


@pytest.mark.parametrize("how", list(READS))
def test_host_read_of_a_side_stream_result(rt, how):
    assert side_result_read_on_host(rt, READS[how], synchronize=True).hazards == []
    san = side_result_read_on_host(rt, READS[how], synchronize=False)
    assert len(san.hazards) == 1, san.format()
    hazard = san.hazards[0]
    assert hazard.kind == "read-write"
    sides = {(s.agent, s.write) for s in (hazard.first, hazard.second)}
    assert sides == {("stream side", True), ("host", False)}, str(hazard)


def d2h_read_before_its_event(rt, non_blocking: bool, synchronize: bool) -> sanitizer.Sanitizer:
    """The compute stream makes ``y``, the host synchronizes (the forward's end), then a D2H copy is
    issued on the compute stream and its result read on the host, after the copy's event or not.
    ``y`` itself is ordered for the host: only the copy can race."""
    compute = rt.compute_stream()
    with sanitizer.sanitized() as san:
        with compute.active():
            y = torch.arange(8.0) * 2
        compute.synchronize()
        with compute.active():
            h = y.to("cpu", non_blocking=True) if non_blocking else y.cpu()
            copied = rt.event()
            copied.record(compute)
        if synchronize:
            copied.synchronize()
        assert h.tolist() == [float(2 * i) for i in range(8)]
    return san


def test_non_blocking_d2h_read_before_its_event(rt):
    assert d2h_read_before_its_event(rt, non_blocking=True, synchronize=True).hazards == []
    san = d2h_read_before_its_event(rt, non_blocking=True, synchronize=False)
    assert len(san.hazards) == 1, san.format()
    hazard = san.hazards[0]
    assert hazard.kind == "read-write" and {hazard.first.op, hazard.second.op} == {"aten::_to_copy", "tolist"}
    assert {(s.agent, s.write) for s in (hazard.first, hazard.second)} == {("stream compute", True), ("host", False)}


def test_a_blocking_d2h_orders_the_host(rt):
    """``.cpu()`` returns finished data: the host may read it without an event."""
    assert d2h_read_before_its_event(rt, non_blocking=False, synchronize=False).hazards == []


def test_the_copy_is_a_new_host_buffer_and_the_patches_go_with_the_sanitizer(rt):
    original = torch.Tensor.tolist, torch.Tensor.to, torch.Tensor.cpu, torch.Tensor.numpy
    y = torch.arange(4.0)
    with sanitizer.sanitized():
        h = y.to("cpu", non_blocking=True)
        same = y.to(y.device)  # the runtime's device: no copy (as on a GPU for a device tensor)
    assert h.data_ptr() != y.data_ptr() and torch.equal(h, y) and same is y
    assert (torch.Tensor.tolist, torch.Tensor.to, torch.Tensor.cpu, torch.Tensor.numpy) == original
    assert y.cpu() is y  # unchanged without the sanitizer
