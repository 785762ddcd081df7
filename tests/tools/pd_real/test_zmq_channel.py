"""The protocol's Channel over ZMQ between two real processes: the protocol's own messages, in order
per endpoint pair, each delivered with the sender the transport saw."""

from __future__ import annotations

import socket
import time

import pytest

from layersplit.pd.abort.channel import Channel
from layersplit.pd.abort.messages import TransferDone, TransferRequest
from tools.pd_real.peers import done_peer
from tools.pd_real.probes import CTX
from tools.pd_real.zmq_channel import ZmqChannel

pytestmark = pytest.mark.timeout(60)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_transfer_requests_are_answered_in_order_over_zmq():
    count = 500
    addresses = {"decode": f"tcp://127.0.0.1:{_free_port()}", "prefill0": f"tcp://127.0.0.1:{_free_port()}"}
    channel = ZmqChannel(addresses, addresses["decode"])
    assert isinstance(channel, Channel)
    got = []
    channel.register("decode", lambda msg, src: got.append((src, msg)))
    proc = CTX.Process(target=done_peer, args=(addresses, addresses["prefill0"], "prefill0", count), daemon=True)
    proc.start()
    try:
        for rid in range(count):
            channel.send("decode", "prefill0", TransferRequest(rid, room=1000 + rid, epoch=rid, incarnation=3,
                                                               floor=0, pages=(rid,), generations=(0,)))
        deadline = time.monotonic() + 30
        while len(got) < count and time.monotonic() < deadline:
            channel.pump(0.2)
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
        channel.close()
    assert proc.exitcode == 0
    assert [src for src, _ in got] == ["prefill0"] * count
    assert [m for _, m in got] == [TransferDone(rid, 1000 + rid, peer=0, incarnation=3) for rid in range(count)]
    assert channel.stats["sent"] == count and channel.stats["delivered"] == count


def test_an_endpoint_of_another_process_is_refused():
    addresses = {"decode": f"tcp://127.0.0.1:{_free_port()}", "prefill0": "tcp://127.0.0.1:1"}
    channel = ZmqChannel(addresses, addresses["decode"])
    try:
        with pytest.raises(ValueError, match=r"endpoint 'prefill0': expected an address of"):
            channel.register("prefill0", print)
        with pytest.raises(ValueError, match=r"dst: expected one of \['decode', 'prefill0'\], got 'x'"):
            channel.send("decode", "x", None)
    finally:
        channel.close()
