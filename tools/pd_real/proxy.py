"""A control-plane fault proxy between real ZMQ endpoints: loss, delay and partitions you control.

The proxy binds one ROUTER per route (a *proxy address*) and forwards what arrives there to the
route's upstream address (a :class:`~tools.pd_real.zmq_channel.ZmqChannel`'s ROUTER). Every sender
connection gets its own upstream DEALER, so the proxy keeps what a TCP/ZMQ connection promises —
FIFO per connection — while it drops, delays or cuts messages:

* ``drop``: each message is lost with this probability (seeded);
* ``min_delay_s`` / ``max_delay_s``: each message is held a uniform delay, but never overtakes an
  earlier message of the same connection (the release time is at least the previous one's);
* :meth:`FaultProxy.partition`: for ``seconds`` every message from or to an endpoint name is lost —
  at arrival and again when a delayed message falls due, as a cut link loses what is on it.

The proxy decodes each :mod:`~tools.pd_real.wire` frame (never unpickles: anything local can connect) only
to learn the endpoint names; it forwards the original bytes. A frame the wire refuses is counted in
``stats["malformed_frames"]`` and never forwarded. Loopback only: it refuses any other address. It runs on one
daemon thread of the calling process, which owns all its sockets (ZMQ sockets are not thread-safe);
the control methods only touch a lock-protected table.
"""

from __future__ import annotations

import heapq
import itertools
import random
import threading
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

from tools.pd_real import wire

LOOPBACK = ("127.0.0.1", "localhost")


@dataclass(frozen=True)
class ProxyFaults:
    drop: float = 0.0  # probability a message is lost
    min_delay_s: float = 0.0
    max_delay_s: float = 0.0

    def __post_init__(self) -> None:
        if not 0 <= self.drop < 1:
            raise ValueError(f"drop: expected a probability in [0, 1), got {self.drop!r}")
        if not 0 <= self.min_delay_s <= self.max_delay_s:
            raise ValueError(f"delays: expected 0 <= min_delay_s <= max_delay_s, got {self.min_delay_s!r}, "
                             f"{self.max_delay_s!r}")


def _loopback(field: str, address: str) -> str:
    parts = urlsplit(address)
    if parts.scheme != "tcp" or parts.hostname not in LOOPBACK or parts.port is None:
        raise ValueError(f"{field}: expected a loopback address tcp://127.0.0.1:PORT, got {address!r}")
    return address


class FaultProxy:
    def __init__(self, routes: dict[str, str], faults: ProxyFaults = ProxyFaults(), seed: int = 0) -> None:
        """``routes``: proxy address (bound here) -> upstream address (the process behind it)."""
        if not routes:
            raise ValueError("routes: expected at least one proxy address -> upstream address, got none")
        self.routes = {_loopback("routes (proxy address)", p): _loopback("routes (upstream address)", u)
                       for p, u in routes.items()}
        if not isinstance(faults, ProxyFaults):
            raise ValueError(f"faults: expected a ProxyFaults, got {type(faults).__name__}")
        self.faults, self._rng = faults, random.Random(seed)
        self.stats = {"received": 0, "forwarded": 0, "dropped": 0, "cut": 0, "malformed_frames": 0}
        self._cuts: dict[str, float] = {}  # endpoint name -> monotonic end of its partition
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    # control (any thread) ---------------------------------------------------------------------------
    def start(self) -> "FaultProxy":
        """Bind every proxy address and start forwarding; raises here if a bind fails."""
        if self._thread is not None:
            raise RuntimeError("FaultProxy.start: already started")
        self._thread = threading.Thread(target=self._run, name="pd-fault-proxy", daemon=True)
        self._thread.start()
        self._ready.wait(10)
        if self._error is not None:
            raise self._error
        if not self._ready.is_set():
            raise RuntimeError("FaultProxy.start: the proxy thread did not bind within 10 s")
        return self

    def partition(self, endpoint: str, seconds: float) -> None:
        """Cut every message from or to ``endpoint`` for ``seconds`` from now (extends a running cut)."""
        if not seconds > 0:
            raise ValueError(f"seconds: expected a duration > 0, got {seconds!r}")
        end = time.monotonic() + seconds
        with self._lock:
            self._cuts[endpoint] = max(end, self._cuts.get(endpoint, 0.0))

    def heal(self, endpoint: str) -> None:
        """End ``endpoint``'s partition now."""
        with self._lock:
            self._cuts.pop(endpoint, None)

    def cut(self, endpoint: str) -> bool:
        with self._lock:
            return self._cuts.get(endpoint, 0.0) > time.monotonic()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)

    def __enter__(self) -> "FaultProxy":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # the forwarding thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        import zmq

        ctx = zmq.Context.instance()
        inboxes, upstream = {}, {}
        try:
            for proxy, up in self.routes.items():
                sock = ctx.socket(zmq.ROUTER)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.RCVHWM, 0)
                sock.setsockopt(zmq.MAXMSGSIZE, wire.MAX_FRAME_BYTES)  # ZMQ drops a larger one unread
                sock.bind(proxy)
                inboxes[sock] = up
        except BaseException as exc:  # reported to start(), which raises it in the caller
            self._error = exc
            for sock in inboxes:
                sock.close()
            self._ready.set()
            return
        self._ready.set()
        poller = zmq.Poller()
        for sock in inboxes:
            poller.register(sock, zmq.POLLIN)
        held: list = []  # (release time, seq, connection, payload, src, dst)
        last: dict[tuple, float] = {}  # connection -> latest release time (FIFO per connection)
        seq = itertools.count()
        try:
            while not self._stop.is_set():
                wait = 50 if not held else max(0, min(50, int((held[0][0] - time.monotonic()) * 1000)))
                for sock, _ in poller.poll(wait):
                    while True:
                        try:
                            parts = sock.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._arrive(held, last, seq, (inboxes[sock], parts[0]), parts[1:])
                now = time.monotonic()
                while held and held[0][0] <= now:
                    _, _, conn, payload, src, dst = heapq.heappop(held)
                    if self.cut(src) or self.cut(dst):
                        self.stats["cut"] += 1
                        continue
                    box = upstream.get(conn)
                    if box is None:
                        box = upstream[conn] = ctx.socket(zmq.DEALER)
                        box.setsockopt(zmq.LINGER, 0)
                        box.setsockopt(zmq.SNDHWM, 0)
                        box.connect(conn[0])
                    box.send(payload)
                    self.stats["forwarded"] += 1
        finally:
            for sock in [*inboxes, *upstream.values()]:
                sock.close()

    def _arrive(self, held: list, last: dict, seq, conn: tuple, frames: list[bytes]) -> None:
        """One read of a proxy ROUTER (``frames``: what followed the sender's identity; one frame)."""
        self.stats["received"] += 1
        payload = frames[0] if len(frames) == 1 else None  # decode refuses None as it refuses garbage
        try:
            src, dst, _ = wire.decode(payload)
        except wire.WireError:
            self.stats["malformed_frames"] += 1
            return
        if self.cut(src) or self.cut(dst):
            self.stats["cut"] += 1
            return
        f = self.faults
        if f.drop and self._rng.random() < f.drop:
            self.stats["dropped"] += 1
            return
        at = time.monotonic() + (self._rng.uniform(f.min_delay_s, f.max_delay_s) if f.max_delay_s else 0.0)
        at = max(at, last.get(conn, 0.0))
        last[conn] = at
        heapq.heappush(held, (at, next(seq), conn, payload, src, dst))
