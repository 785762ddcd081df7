"""Control channels. The nodes see one interface (:class:`Channel`: ``register`` an endpoint, ``send``
a message); a subclass decides when, and whether, a message arrives. :class:`ControlChannel` is the
stress's: seeded faults — delay, drop, duplicate (a later re-send), and reordering across endpoints;
each (sender, receiver) endpoint pair stays FIFO, as a TCP/ZMQ socket does. The model checker plugs
in its own (``tools.pd_check.choice_channel``), where every delivery and every fault is a choice."""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable

from layersplit.pd.abort.sim import EventLoop


@dataclass(frozen=True)
class ChannelFaults:
    min_delay_s: float = 0.0005
    max_delay_s: float = 0.02
    drop: float = 0.0  # probability a message is lost
    duplicate: float = 0.0  # probability a message is sent again later
    duplicate_after_s: float = 0.5  # the re-send happens up to this much later

    def __post_init__(self) -> None:
        for name in ("drop", "duplicate"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"{name}: expected a probability in [0, 1), got {getattr(self, name)}")
        if not 0 <= self.min_delay_s <= self.max_delay_s:
            raise ValueError(f"delays: expected 0 <= min_delay_s <= max_delay_s, got {self.min_delay_s}, {self.max_delay_s}")


class Channel(ABC):
    """Endpoints by name; ``send`` is the subclass's, ``_deliver`` hands a message (and its sender's
    endpoint name, as a socket knows its peer) to its endpoint."""

    def __init__(self) -> None:
        self._handlers: dict[str, Callable] = {}
        self.stats = {"sent": 0, "dropped": 0, "duplicated": 0, "delivered": 0}

    def register(self, endpoint: str, handler: Callable) -> None:
        self._handlers[endpoint] = handler

    @abstractmethod
    def send(self, src: str, dst: str, msg: object) -> None:
        """Deliver ``msg`` from ``src`` to ``dst`` (each subclass decides how and when)."""

    def _deliver(self, dst: str, msg: object, src: str | None = None) -> None:
        """Hand ``msg`` to ``dst``'s handler as ``handler(msg, src)``: the transport knows the sender."""
        self.stats["delivered"] += 1
        self._handlers[dst](msg, src)


class ControlChannel(Channel):
    def __init__(self, loop: EventLoop, rng: random.Random, faults: ChannelFaults) -> None:
        super().__init__()
        self.loop, self.rng, self.faults = loop, rng, faults
        self._last: dict[tuple[str, str], float] = {}  # latest delivery time per endpoint pair

    def send(self, src: str, dst: str, msg: object, duplicate_ok: bool = True) -> None:
        f = self.faults
        self.stats["sent"] += 1
        if duplicate_ok and self.rng.random() < f.duplicate:
            self.stats["duplicated"] += 1
            self.loop.after(self.rng.uniform(0, f.duplicate_after_s), self.send, src, dst, msg, False)
        if self.rng.random() < f.drop:
            self.stats["dropped"] += 1
            return
        at = self.loop.now + self.rng.uniform(f.min_delay_s, f.max_delay_s)
        at = max(at, self._last.get((src, dst), 0.0))  # FIFO per endpoint pair
        self._last[(src, dst)] = at
        self.loop.after(at - self.loop.now, self._deliver, dst, msg, src)
