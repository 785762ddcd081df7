"""(d) Per-connection order of ZMQ control messages between real processes on loopback, and what a
SIGKILL and restart of the sender does to it.

A sender process (one *incarnation*) sends ``(incarnation, seq)`` for seq = 0, 1, …; the receiver
(this process) records every arrival. Per incarnation the seqs must arrive strictly increasing (a gap
is a lost message, a repeat a duplicate); ``old_after_new`` counts messages of an earlier incarnation
that arrive after the first one of a later incarnation.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from dataclasses import dataclass

CTX = mp.get_context("spawn")
PATTERNS = {"push": ("PUSH", "PULL"), "dealer": ("DEALER", "ROUTER")}


@dataclass(frozen=True)
class Seq:
    """An order probe's message over :class:`~tools.pd_real.zmq_channel.ZmqChannel` (a wire type; the
    raw-socket probe here sends the same pair as JSON)."""

    incarnation: int
    seq: int


def sender(endpoint: str, pattern: str, incarnation: int, count: int, hold) -> None:
    """Sends ``count`` messages; with ``hold`` (a pipe end) says so on it and stays alive (to be
    SIGKILLed), else flushes and exits."""
    import zmq

    sock = zmq.Context.instance().socket(getattr(zmq, PATTERNS[pattern][0]))
    sock.setsockopt(zmq.SNDHWM, 0)  # unbounded queues: no send blocks, every message is queued
    sock.setsockopt(zmq.LINGER, 5000)
    sock.connect(endpoint)
    for seq in range(count):
        sock.send_json([incarnation, seq])
    if hold:
        hold.send("sent")
        time.sleep(3600)
    sock.close()  # LINGER: queued messages are flushed before the process exits


def _spawn(endpoint: str, pattern: str, incarnation: int, count: int, hold):
    proc = CTX.Process(target=sender, args=(endpoint, pattern, incarnation, count, hold), daemon=True)
    proc.start()
    return proc


def order(pattern: str = "push", count: int = 20000, kill_first_after: int | None = None,
          settle_s: float = 0.3, timeout_s: float = 30.0) -> dict:
    """One sender incarnation of ``count`` messages, all read. With ``kill_first_after`` the receiver
    stalls after that many arrivals; the first incarnation (alive, every message handed to ZMQ) is
    SIGKILLed ``settle_s`` after it said so, a second incarnation sends ``count`` and exits; then the
    receiver reads on. ``timeout_s``: the read gives up after that long without a message (``timed_out``:
    some never came)."""
    if pattern not in PATTERNS:
        raise ValueError(f"pattern: expected one of {sorted(PATTERNS)}, got {pattern!r}")
    import zmq

    sock = zmq.Context.instance().socket(getattr(zmq, PATTERNS[pattern][1]))
    sock.setsockopt(zmq.RCVHWM, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    endpoint = f"tcp://127.0.0.1:{port}"
    said, hold = CTX.Pipe(duplex=False) if kill_first_after is not None else (None, None)
    procs = [_spawn(endpoint, pattern, 1, count, hold)]
    arrivals: list[tuple[int, int]] = []
    want = count if kill_first_after is None else 2 * count
    deadline = time.monotonic() + timeout_s
    try:
        while len(arrivals) < want and time.monotonic() < deadline:
            if not sock.poll(100):
                continue
            arrivals.append(tuple(zmq.utils.jsonapi.loads(sock.recv_multipart()[-1])))
            deadline = time.monotonic() + timeout_s  # silence, not slowness, ends the read: a loaded machine
            if len(procs) == 1 and kill_first_after is not None and len(arrivals) == kill_first_after:
                said.poll(timeout_s)  # the receiver stalls until incarnation 1 has sent all ...
                time.sleep(settle_s)  # ... and ZMQ's I/O thread has put them on the wire
                os.kill(procs[0].pid, signal.SIGKILL)
                procs[0].join(5)
                procs.append(_spawn(endpoint, pattern, 2, count, False))
                procs[1].join(timeout_s)  # incarnation 2 sent and flushed everything, then exited
                deadline = time.monotonic() + timeout_s
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)
        sock.close(linger=0)
    out = summarize(arrivals)
    out["first_killed"] = kill_first_after is not None and procs[0].exitcode == -signal.SIGKILL
    out["timed_out"] = len(arrivals) < want
    return out


def summarize(arrivals: list[tuple[int, int]]) -> dict:
    last: dict[int, int] = {}
    out = {"received": len(arrivals), "out_of_order": 0, "duplicates": 0, "gaps": 0, "old_after_new": 0}
    seen: set[tuple[int, int]] = set()
    newest = 0
    for inc, seq in arrivals:
        if (inc, seq) in seen:
            out["duplicates"] += 1
        seen.add((inc, seq))
        prev = last.get(inc, -1)
        if seq < prev:
            out["out_of_order"] += 1
        elif seq > prev + 1:
            out["gaps"] += 1
        last[inc] = max(prev, seq)
        out["old_after_new"] += inc < newest
        newest = max(newest, inc)
    out["per_incarnation"] = {str(k): v + 1 for k, v in sorted(last.items())}  # highest seq + 1
    return out
