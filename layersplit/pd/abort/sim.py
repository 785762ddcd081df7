"""A seeded discrete-event loop: the virtual clock the PD nodes, the transfer engine and the
control channel share. Same seed, same run: every race the stress test finds can be replayed.

Two ways to drive it, one implementation: ``run`` fires events in virtual-time order (the stress);
``events`` + ``fire`` let a scheduler pick *any* pending event next (the model checker in
:mod:`tools.pd_check` branches over every one of them, so time only orders the stress, never the protocol)."""

from __future__ import annotations

import heapq
import itertools
from typing import Callable


class EventLoop:
    def __init__(self) -> None:
        self.now = 0.0
        self._queue: list = []
        self._seq = itertools.count()

    def after(self, delay: float, fn: Callable, *args) -> None:
        """Run ``fn(*args)`` ``delay`` seconds of virtual time from now."""
        assert delay >= 0, f"delay must be >= 0, got {delay}"
        heapq.heappush(self._queue, (self.now + delay, next(self._seq), fn, args))

    def run(self, until: float | None = None) -> None:
        """Process events in time order (FIFO among equal times) until none is left (or ``until``)."""
        queue, pop = self._queue, heapq.heappop  # local names: this loop runs millions of times
        while queue and (until is None or queue[0][0] <= until):
            self.now, _, fn, args = pop(queue)
            fn(*args)

    def drop_owned(self, owners: tuple) -> int:
        """Drop every pending event whose function is a method of one of ``owners`` (a process that died:
        its timers die with it); returns how many."""
        kept = [e for e in self._queue if not any(getattr(e[2], "__self__", None) is o for o in owners)]
        dropped = len(self._queue) - len(kept)
        self._queue[:] = kept  # in place: ``run`` holds the list (it may be running the event that calls this)
        heapq.heapify(self._queue)
        return dropped

    @property
    def pending(self) -> int:
        return len(self._queue)

    def events(self) -> list[tuple]:
        """The pending events as ``(time, seq, fn, args)``, in no particular order."""
        return list(self._queue)

    def fire(self, event: tuple) -> None:
        """Run one pending ``event`` now, whatever its time (the clock never goes back)."""
        self._queue.remove(event)  # seq is unique: equality stops there, never compares fn or args
        heapq.heapify(self._queue)
        self.now = max(self.now, event[0])
        event[2](*event[3])
