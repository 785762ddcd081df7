"""The control-plane fault proxy, and (d) under its faults: ZMQ keeps per-connection order while the
proxy drops, delays and partitions the protocol's messages, and every message it did not lose arrives."""

from __future__ import annotations

import socket
import time

import pytest

from layersplit.pd.abort.messages import TransferDone
from tools.pd_real.proxy import FaultProxy, ProxyFaults
from tools.pd_real.proxy_order import order_through_proxy
from tools.pd_real.zmq_channel import ZmqChannel
from tools.pd_real.zmq_order import Seq

pytestmark = pytest.mark.timeout(90)


def _address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def _pump_until(channel, got, n, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while len(got) < n and time.monotonic() < deadline:
        channel.pump(0.02)


def test_order_holds_per_connection_under_drops_delays_and_a_partition():
    out = order_through_proxy(count=2000, drop=0.1, max_delay_s=0.01, partition_at=0.3, partition_s=0.2, seed=3)
    assert out["out_of_order"] == 0 and out["duplicates"] == 0
    assert out["accounted"], out  # received == sent - dropped - cut: nothing else was lost
    assert out["proxy"]["received"] == 2000
    assert out["proxy"]["dropped"] > 0 and out["proxy"]["cut"] > 0  # both faults really struck
    assert out["gaps"] > 0 and out["received"] == out["proxy"]["forwarded"]


def test_a_partition_cuts_both_directions_until_it_heals():
    decode, prefill, to_decode, to_prefill = (_address() for _ in range(4))
    got_decode, got_prefill = [], []
    d = ZmqChannel({"decode": decode, "prefill0": to_prefill}, decode)
    p = ZmqChannel({"decode": to_decode, "prefill0": prefill}, prefill)
    d.register("decode", lambda msg, src: got_decode.append((src, msg)))
    p.register("prefill0", lambda msg, src: got_prefill.append((src, msg)))
    try:
        with FaultProxy({to_decode: decode, to_prefill: prefill}) as proxy:
            proxy.partition("prefill0", 60.0)
            assert proxy.cut("prefill0") and not proxy.cut("decode")
            p.send("prefill0", "decode", TransferDone(0, room=1, peer=0))
            d.send("decode", "prefill0", TransferDone(1, room=2, peer=0))
            deadline = time.monotonic() + 5
            while proxy.stats["cut"] < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            d.pump(0.2), p.pump(0.2)
            assert proxy.stats["cut"] == 2 and not got_decode and not got_prefill
            proxy.heal("prefill0")
            p.send("prefill0", "decode", TransferDone(2, room=3, peer=0))
            d.send("decode", "prefill0", TransferDone(3, room=4, peer=0))
            _pump_until(d, got_decode, 1)
            _pump_until(p, got_prefill, 1)
    finally:
        d.close(), p.close()
    assert [(src, m.rid) for src, m in got_decode] == [("prefill0", 2)]
    assert [(src, m.rid) for src, m in got_prefill] == [("decode", 3)]
    assert proxy.stats == {"received": 4, "forwarded": 2, "dropped": 0, "cut": 2, "malformed_frames": 0}


def test_delays_never_reorder_one_connection():
    recv, via, send = (_address() for _ in range(3))
    got = []
    r = ZmqChannel({"recv": recv, "send": via}, recv)
    s = ZmqChannel({"recv": via, "send": send}, send)
    r.register("recv", lambda msg, src: got.append(msg))
    try:
        with FaultProxy({via: recv}, ProxyFaults(min_delay_s=0.0, max_delay_s=0.05), seed=1):
            for i in range(300):
                s.send("send", "recv", Seq(1, i))
            _pump_until(r, got, 300)
    finally:
        r.close(), s.close()
    assert got == [Seq(1, i) for i in range(300)]


@pytest.mark.parametrize("routes, field", [
    ({"tcp://10.0.0.1:5000": "tcp://127.0.0.1:5001"}, "proxy address"),
    ({"tcp://127.0.0.1:5000": "ipc:///tmp/x"}, "upstream address"),
    ({}, "routes"),
])
def test_bad_routes_are_refused_before_any_socket(routes, field):
    with pytest.raises(ValueError, match=field):
        FaultProxy(routes)


@pytest.mark.parametrize("kw, field", [({"drop": 1.0}, "drop"), ({"drop": -0.1}, "drop"),
                                       ({"min_delay_s": 0.2, "max_delay_s": 0.1}, "delays")])
def test_bad_faults_are_refused(kw, field):
    with pytest.raises(ValueError, match=field):
        ProxyFaults(**kw)


def test_a_partition_needs_a_positive_duration():
    proxy = FaultProxy({"tcp://127.0.0.1:5000": "tcp://127.0.0.1:5001"})
    with pytest.raises(ValueError, match="seconds"):
        proxy.partition("prefill0", 0)
