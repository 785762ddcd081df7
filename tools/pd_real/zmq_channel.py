"""The protocol's :class:`~layersplit.pd.abort.channel.Channel` over ZMQ between real processes.

Each process owns some endpoints (``register``) and knows every endpoint's address. It binds one
ROUTER at its own address; ``send(src, dst, msg)`` puts the frame of ``(src, dst, msg)``
(:mod:`tools.pd_real.wire`: typed msgpack, never pickle) onto a DEALER connected to ``dst``'s address
(one DEALER per destination: one TCP connection, FIFO per endpoint pair, as the simulated channel
promises). ``pump`` hands arrived messages to their handlers — the transport, not the message, names the
sender. Messages are the frozen dataclasses of :mod:`layersplit.pd.abort.messages` (and the wire's others).

Any local process can reach the ROUTER, so a frame is data until it checks out: one the wire refuses
(or not ``[identity, frame]``) is counted in ``stats["malformed_frames"]`` and dropped; a well-formed one
for an endpoint not registered here, from a sender it does not take or of a type it does not take is
counted in ``stats["refused_frames"]`` and dropped. Neither raises into the loop nor reaches a handler.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from dataclasses import dataclass

from layersplit.pd.abort.channel import Channel
from tools.pd_real import wire

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Route:
    """What one local endpoint takes: message types, and sender endpoints (None: any known one)."""

    accepts: tuple[type, ...]
    senders: frozenset[str] | None


class ZmqChannel(Channel):
    def __init__(self, addresses: dict[str, str], local: str) -> None:
        """``addresses``: endpoint name -> ``tcp://host:port`` of the process that owns it; ``local``:
        this process's own address (every endpoint it registers must map to it)."""
        import zmq

        super().__init__()
        self.stats.update(malformed_frames=0, refused_frames=0)
        if local not in addresses.values():
            raise ValueError(f"local: expected one of the addresses {sorted(set(addresses.values()))}, got {local!r}")
        self.addresses, self.local = dict(addresses), local
        self._ctx = zmq.Context.instance()
        self._inbox = self._ctx.socket(zmq.ROUTER)
        self._inbox.setsockopt(zmq.LINGER, 0)
        self._inbox.setsockopt(zmq.MAXMSGSIZE, wire.MAX_FRAME_BYTES)  # ZMQ drops a larger one unread
        self._inbox.bind(local)
        self._outboxes: dict[str, object] = {}
        self._routes: dict[str, Route] = {}

    @property
    def socket(self):
        """The ROUTER messages arrive on (for an event loop's poller; ``pump`` reads it)."""
        return self._inbox

    def register(self, endpoint: str, handler, accepts: tuple[type, ...] = wire.WIRE_TYPES,
                 senders: Collection[str] | None = None) -> None:
        """``handler(msg, src)`` gets the messages of the ``accepts`` types from the ``senders`` endpoints
        (None: any endpoint in ``addresses``); anything else for ``endpoint`` is refused (counted)."""
        if self.addresses.get(endpoint) != self.local:
            raise ValueError(f"endpoint {endpoint!r}: expected an address of {self.local!r}, "
                             f"got {self.addresses.get(endpoint)!r}")
        if not set(accepts) <= set(wire.WIRE_TYPES):
            raise ValueError(f"accepts: expected wire types ({', '.join(c.__name__ for c in wire.WIRE_TYPES)}), "
                             f"got {', '.join(c.__name__ for c in accepts)}")
        super().register(endpoint, handler)
        self._routes[endpoint] = Route(tuple(accepts), None if senders is None else frozenset(senders))

    def send(self, src: str, dst: str, msg: object) -> None:
        import zmq

        if dst not in self.addresses:
            raise ValueError(f"dst: expected one of {sorted(self.addresses)}, got {dst!r}")
        frame = wire.encode(src, dst, msg)  # a message the wire refuses is the caller's error: nothing is sent
        box = self._outboxes.get(dst)
        if box is None:
            box = self._outboxes[dst] = self._ctx.socket(zmq.DEALER)
            box.setsockopt(zmq.LINGER, 1000)
            box.connect(self.addresses[dst])
        self.stats["sent"] += 1
        box.send(frame)

    def pump(self, timeout_s: float = 0.0) -> int:
        """Deliver every message that arrives within ``timeout_s`` (at least the ones already here);
        returns how many were delivered (refused and malformed frames are only counted)."""
        read = delivered = 0
        while self._inbox.poll(int(timeout_s * 1000) if read == 0 else 0):
            read += 1
            admitted = self._admit(self._inbox.recv_multipart())
            if admitted is not None:
                src, dst, msg = admitted
                self._deliver(dst, msg, src)
                delivered += 1
        return delivered

    def _admit(self, parts: list[bytes]) -> tuple[str, str, object] | None:
        """``(src, dst, msg)`` of one ROUTER read, or None (counted) for a frame no handler may see."""
        frame = parts[1] if len(parts) == 2 else None  # [identity, frame]; decode refuses None as garbage
        try:
            src, dst, msg = wire.decode(frame)
        except wire.WireError as exc:
            return self._drop("malformed_frames", str(exc))
        route = self._routes.get(dst)
        if route is None:
            return self._drop("refused_frames", f"dst: expected one of {sorted(self._routes)}, got {dst!r}")
        if src not in (self.addresses if route.senders is None else route.senders):
            return self._drop("refused_frames", f"src: {dst!r} takes no message from {src!r}")
        if not isinstance(msg, route.accepts):
            return self._drop("refused_frames", f"msg: {dst!r} takes no {type(msg).__name__}")
        return src, dst, msg

    def _drop(self, counter: str, why: str) -> None:
        self.stats[counter] += 1
        log.debug("dropped a control frame (%s): %s", counter, why)
        return None

    def close(self) -> None:
        for box in self._outboxes.values():
            box.close()
        self._inbox.close()
