"""(d) under faults: per-connection order of the protocol's ZMQ control messages when a
:class:`~tools.pd_real.proxy.FaultProxy` drops, delays and partitions them.

A sender process (a :class:`~tools.pd_real.zmq_channel.ZmqChannel` endpoint ``"send"``) sends
``Seq(1, seq)`` for seq = 0, 1, … at a steady pace to ``"recv"`` through the proxy; the receiver (this
process) records every arrival. Part-way through, the sender's link is cut for ``partition_s``.
What must hold: no message arrives out of order or twice, and every message the proxy did not lose
arrives (received == sent - dropped - cut); gaps are exactly where the proxy lost messages.
"""

from __future__ import annotations

import time

from tools.pd_real.probes import CTX
from tools.pd_real.proxy import FaultProxy, ProxyFaults
from tools.pd_real.zmq_channel import ZmqChannel
from tools.pd_real.zmq_order import Seq, summarize


def paced_sender(addresses: dict[str, str], count: int, pace_s: float, done) -> None:
    """Sends ``count`` messages, one per ``pace_s``; says ``"sent"`` on ``done`` and waits for ``"exit"``
    (so its sockets stay open until everything the proxy holds has been forwarded)."""
    channel = ZmqChannel(addresses, addresses["send"])
    start = time.monotonic()
    for seq in range(count):
        channel.send("send", "recv", Seq(1, seq))
        time.sleep(max(0.0, start + (seq + 1) * pace_s - time.monotonic()))
    done.send("sent")
    done.recv()
    channel.close()


def order_through_proxy(count: int = 2000, drop: float = 0.1, min_delay_s: float = 0.0, max_delay_s: float = 0.01,
                        pace_s: float = 0.0005, partition_at: float = 0.3, partition_s: float = 0.2,
                        seed: int = 0, timeout_s: float = 30.0) -> dict:
    import socket

    def port() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    recv, via, send = (f"tcp://127.0.0.1:{port()}" for _ in range(3))
    faults = ProxyFaults(drop=drop, min_delay_s=min_delay_s, max_delay_s=max_delay_s)
    arrivals: list[tuple[int, int]] = []
    channel = ZmqChannel({"recv": recv, "send": send}, recv)
    channel.register("recv", lambda msg, src: arrivals.append((msg.incarnation, msg.seq)), accepts=(Seq,))
    here, there = CTX.Pipe()
    with FaultProxy({via: recv}, faults, seed=seed) as proxy:
        proc = CTX.Process(target=paced_sender, args=({"recv": via, "send": send}, count, pace_s, there),
                           daemon=True)
        proc.start()
        try:
            deadline = time.monotonic() + timeout_s
            started, cut_done, sent = None, False, False
            while time.monotonic() < deadline:
                channel.pump(0.01)
                if started is None and proxy.stats["received"]:
                    started = time.monotonic()
                if started is not None and not cut_done and time.monotonic() - started >= partition_at:
                    proxy.partition("send", partition_s)
                    cut_done = True
                sent = sent or here.poll()
                lost = proxy.stats["dropped"] + proxy.stats["cut"]
                if sent and proxy.stats["received"] == count and len(arrivals) + lost >= count:
                    break
            here.send("exit")
        finally:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
            channel.close()
    out = summarize(arrivals)
    out.update(sent=count, proxy=dict(proxy.stats), faults={"drop": drop, "min_delay_s": min_delay_s,
               "max_delay_s": max_delay_s, "partition_s": partition_s}, seed=seed,
               accounted=len(arrivals) == count - proxy.stats["dropped"] - proxy.stats["cut"])
    return out
