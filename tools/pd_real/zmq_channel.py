"""The protocol's :class:`~layersplit.pd.abort.channel.Channel` over ZMQ between real processes.

Each process owns some endpoints (``register``) and knows every endpoint's address. It binds one
ROUTER at its own address; ``send(src, dst, msg)`` pickles ``(src, msg)`` onto a DEALER connected to
``dst``'s address (one DEALER per destination: one TCP connection, FIFO per endpoint pair, as the
simulated channel promises). ``pump`` hands arrived messages to their handlers — the transport, not
the message, names the sender. Messages are the frozen dataclasses of :mod:`layersplit.pd.abort.messages`.
"""

from __future__ import annotations

import pickle

from layersplit.pd.abort.channel import Channel


class ZmqChannel(Channel):
    def __init__(self, addresses: dict[str, str], local: str) -> None:
        """``addresses``: endpoint name -> ``tcp://host:port`` of the process that owns it; ``local``:
        this process's own address (every endpoint it registers must map to it)."""
        import zmq

        super().__init__()
        if local not in addresses.values():
            raise ValueError(f"local: expected one of the addresses {sorted(set(addresses.values()))}, got {local!r}")
        self.addresses, self.local = dict(addresses), local
        self._ctx = zmq.Context.instance()
        self._inbox = self._ctx.socket(zmq.ROUTER)
        self._inbox.setsockopt(zmq.LINGER, 0)
        self._inbox.bind(local)
        self._outboxes: dict[str, object] = {}

    @property
    def socket(self):
        """The ROUTER messages arrive on (for an event loop's poller; ``pump`` reads it)."""
        return self._inbox

    def register(self, endpoint: str, handler) -> None:
        if self.addresses.get(endpoint) != self.local:
            raise ValueError(f"endpoint {endpoint!r}: expected an address of {self.local!r}, "
                             f"got {self.addresses.get(endpoint)!r}")
        super().register(endpoint, handler)

    def send(self, src: str, dst: str, msg: object) -> None:
        import zmq

        if dst not in self.addresses:
            raise ValueError(f"dst: expected one of {sorted(self.addresses)}, got {dst!r}")
        box = self._outboxes.get(dst)
        if box is None:
            box = self._outboxes[dst] = self._ctx.socket(zmq.DEALER)
            box.setsockopt(zmq.LINGER, 1000)
            box.connect(self.addresses[dst])
        self.stats["sent"] += 1
        box.send(pickle.dumps((src, dst, msg)))

    def pump(self, timeout_s: float = 0.0) -> int:
        """Deliver every message that arrives within ``timeout_s`` (at least the ones already here)."""
        delivered = 0
        while self._inbox.poll(int(timeout_s * 1000) if delivered == 0 else 0):
            _, payload = self._inbox.recv_multipart()
            # noqa below: only loopback peers this process started send here; never bind beyond loopback
            src, dst, msg = pickle.loads(payload)  # noqa: S301
            self._deliver(dst, msg, src)
            delivered += 1
        return delivered

    def close(self) -> None:
        for box in self._outboxes.values():
            box.close()
        self._inbox.close()
