"""Decode's per-rank low watermark: the smallest epoch decode may still wait on a prefill rank for.

Decode opens an epoch for a rank when it announces a room to it and closes it when that rank can no
longer matter for the room (it reported all writes done, acknowledged the abort, or the room was
released). ``floor()`` — every epoch below it is closed — travels on each message to the rank and
lets the rank prune its records and tombstones without ever forgetting a room decode still waits on.
"""

from __future__ import annotations

import heapq


class LowWatermark:
    def __init__(self) -> None:
        self._open: list[int] = []  # heap of open epochs (closed ones are dropped lazily)
        self._closed: set[int] = set()
        self._next = 0  # one past the largest epoch ever opened

    def open(self, epoch: int) -> None:
        assert epoch >= self._next, f"epochs must be opened in increasing order, got {epoch} after {self._next - 1}"
        heapq.heappush(self._open, epoch)
        self._next = epoch + 1

    def close(self, epoch: int) -> None:
        self._closed.add(epoch)

    def floor(self) -> int:
        while self._open and self._open[0] in self._closed:
            self._closed.discard(heapq.heappop(self._open))
        return self._open[0] if self._open else self._next

    @property
    def open_count(self) -> int:
        return len(self._open) - len(self._closed)
