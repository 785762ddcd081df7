"""Process entry points of the probes: a decode peer that registers a shared-memory page buffer with
its engine, and a prefill peer that writes pages into it. Each obeys commands on a pipe, so the test
process can stop, kill or restart either one between two steps. (Spawned, never forked: the engine
runs threads.)"""

from __future__ import annotations

import time

import numpy as np

from tools.pd_real.engine import Pages, fill, open_engine, register
from tools.pd_real.landing import stamp
from layersplit.pd.abort.transfer_engine import WriteTag


def decode_peer(conn, shm_name: str, count: int, page_bytes: int) -> None:
    """Registers the pages, answers ``(session, base address)``; then ``deregister`` / ``register`` /
    ``exit`` commands, each answered with the engine's return code."""
    pages = Pages.attach(shm_name, count, page_bytes)
    engine, session = open_engine()
    addr, nbytes = pages.addr, count * page_bytes
    register(engine, addr, nbytes)
    conn.send((session, addr))
    while True:
        cmd = conn.recv()
        if cmd == "exit":
            conn.send(0)
            return
        if cmd == "deregister":
            conn.send(engine.unregister_memory(addr))
        elif cmd == "register":
            conn.send(engine.register_memory(addr, nbytes))
        else:
            raise ValueError(f"decode peer: expected exit/deregister/register, got {cmd!r}")


def prefill_peer(conn, session: str, page_bytes: int, value: int) -> None:
    """Writes pages of ``value`` to the decode peer. Commands: ``("write", [dst addrs])`` — one
    async batch, answered ``("submitted", t)`` then ``("status", rc, t)`` once the engine reports it
    (``get_batch_transfer_status`` blocks until done, 0, or failed / timed out, negative);
    ``("sync", [dst addrs])`` the same through ``batch_transfer_sync_write``; ``("stamped", [dst
    addrs], [tags])`` an async batch of :func:`~tools.pd_real.landing.stamp` pages; ``exit``."""
    engine, _ = open_engine()
    sources = {}
    conn.send("ready")
    while True:
        cmd = conn.recv()
        if cmd == "exit":
            conn.send(0)
            return
        op, dsts, *tags = cmd
        if op == "stamped":  # landing-checker pages, one source per batch (kept: the engine reads it)
            key, make = ("stamped", len(sources)), lambda: np.concatenate([stamp(page_bytes, WriteTag(*t))
                                                                            for t in tags[0]])
            op = "write"
        else:  # one source per batch size, every page the same value
            key, make = len(dsts), lambda: fill(page_bytes * len(dsts), value)
        if key not in sources:
            sources[key] = make()
            register(engine, sources[key].ctypes.data, sources[key].nbytes)
        base = sources[key].ctypes.data
        srcs = [base + i * page_bytes for i in range(len(dsts))]
        lengths = [page_bytes] * len(dsts)
        if op == "write":
            batch = engine.batch_transfer_async_write(session, srcs, list(dsts), lengths)
            conn.send(("submitted", time.monotonic()))
            rc = engine.get_batch_transfer_status([batch]) if batch else -1
        elif op == "sync":
            rc = engine.batch_transfer_sync_write(session, srcs, list(dsts), lengths)
        else:
            raise ValueError(f"prefill peer: expected write/sync/exit, got {op!r}")
        conn.send(("status", rc, time.monotonic()))


def done_peer(addresses: dict[str, str], local: str, endpoint: str, count: int) -> None:
    """A prefill endpoint over :class:`ZmqChannel`: answers each of ``count`` ``TransferRequest``s with
    a ``TransferDone`` of the same request, then exits."""
    from layersplit.pd.abort.messages import TransferDone, TransferRequest
    from tools.pd_real.zmq_channel import ZmqChannel

    channel = ZmqChannel(addresses, local)
    answered = []

    def handle(msg, src):
        assert isinstance(msg, TransferRequest), msg
        channel.send(endpoint, src, TransferDone(msg.rid, msg.room, peer=int(endpoint[-1]),
                                                 incarnation=msg.incarnation, decode_life=msg.decode_life))
        answered.append(msg.rid)

    channel.register(endpoint, handle)
    deadline = time.monotonic() + 30
    while len(answered) < count and time.monotonic() < deadline:
        channel.pump(0.1)
    channel.close()
