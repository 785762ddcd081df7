"""The :class:`~layersplit.pd.abort.sim.EventLoop` interface on the wall clock, for one real process.

The protocol's nodes only call ``loop.after(delay, fn, *args)`` and read ``loop.now``; here ``now`` is
seconds of ``time.monotonic()`` since the loop started and ``after`` arms a timer. ``run`` fires due
timers and, in between, waits on every *source* it was given — the control channel's ZMQ socket, the
transfer engine's completion pipe — without spinning: one ``zmq.Poller`` wait that ends at the next
timer, the next message or the next completed batch, whichever comes first. Everything runs on the
calling thread, so the nodes see the same single-threaded world as in the simulation.
"""

from __future__ import annotations

import heapq
import itertools
import time
from typing import Callable

MAX_WAIT_S = 0.05  # the longest poll, so ``stop`` is looked at this often


class WallLoop:
    def __init__(self) -> None:
        self._t0 = time.monotonic()
        self._queue: list = []
        self._seq = itertools.count()
        self._sources: list[tuple[object, Callable[[], int]]] = []  # (pollable, drain)
        self.stats = {"timers": 0, "drained": 0, "late_timers_s_max": 0.0}

    @property
    def now(self) -> float:
        return time.monotonic() - self._t0

    def after(self, delay: float, fn: Callable, *args) -> None:
        """Run ``fn(*args)`` ``delay`` wall-clock seconds from now (FIFO among equal deadlines)."""
        assert delay >= 0, f"delay must be >= 0, got {delay}"
        heapq.heappush(self._queue, (self.now + delay, next(self._seq), fn, args))

    def add_source(self, pollable, drain: Callable[[], int]) -> None:
        """Wait on ``pollable`` (a ZMQ socket or a file descriptor); when it is readable call ``drain()``,
        which handles everything that arrived without blocking and returns how much it handled."""
        self._sources.append((pollable, drain))

    @property
    def pending(self) -> int:
        return len(self._queue)

    def run(self, until: float | None = None, stop: Callable[[], bool] = lambda: False) -> None:
        """Fire timers and drain sources until ``stop()`` is true or ``now`` passes ``until``."""
        import zmq

        poller = zmq.Poller()
        for pollable, _ in self._sources:
            poller.register(pollable, zmq.POLLIN)
        drains = dict(self._sources)  # a socket or an int fd: poll hands back the object registered
        while not stop() and (until is None or self.now < until):
            self._fire_due()
            wait = MAX_WAIT_S if not self._queue else min(MAX_WAIT_S, max(0.0, self._queue[0][0] - self.now))
            for pollable, _ in poller.poll(int(wait * 1000)):
                self.stats["drained"] += drains[pollable]()

    def _fire_due(self) -> None:
        queue, pop = self._queue, heapq.heappop
        now = self.now
        while queue and queue[0][0] <= now:
            at, _, fn, args = pop(queue)
            self.stats["timers"] += 1
            self.stats["late_timers_s_max"] = max(self.stats["late_timers_s_max"], now - at)
            fn(*args)
            now = self.now
