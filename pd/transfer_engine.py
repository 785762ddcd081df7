"""Transfer-engine model: posted RDMA writes into the decode worker's KV pages.

A posted batch writes its pages one by one after random delays; a write cannot be cancelled. Each
batch has a status (``pending`` / ``done`` / ``failed``) for polling. An injected error makes the
status ``failed`` *before* the remaining writes have landed — as a NIC may report a failed work
request while earlier-posted data is still in flight — so only ``on_quiesced`` (every write of the
batch landed) says the pages are no longer being written.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable

from pd.sim import EventLoop


@dataclass(frozen=True)
class WriteTag:
    """Who a write belongs to: the request incarnation and the page generation it was given."""

    room: int
    generation: int


@dataclass(frozen=True)
class EngineFaults:
    min_write_s: float = 0.001
    max_write_s: float = 0.05
    slow_write: float = 0.0  # probability a page write takes up to slow_write_s (a congested link)
    slow_write_s: float = 2.0
    error: float = 0.0  # probability a batch reports failure while its writes still land


class TransferEngine:
    def __init__(self, loop: EventLoop, rng: random.Random, land: Callable, faults: EngineFaults) -> None:
        self.loop, self.rng, self.land, self.faults = loop, rng, land, faults
        self._status: dict[int, str] = {}
        self._next = 0
        self.stats = {"batches": 0, "writes": 0, "errors": 0}

    def post(self, pages: list[int], tags: list[WriteTag], payloads: list[int],
             on_status: Callable[[int, str], None], on_quiesced: Callable[[int], None]) -> int:
        """Post one batch of page writes; returns its id. Callbacks: status change, all writes landed."""
        batch, self._next = self._next, self._next + 1
        self._status[batch] = "pending"
        self.stats["batches"] += 1
        f = self.faults
        times = [self.rng.uniform(f.min_write_s, f.max_write_s) if self.rng.random() >= f.slow_write
                 else self.rng.uniform(f.max_write_s, f.slow_write_s) for _ in pages]
        last = max(times, default=0.0)
        remaining = [len(pages)]

        def write(page: int, tag: WriteTag, payload: int) -> None:
            self.stats["writes"] += 1
            self.land(page, tag, payload)
            remaining[0] -= 1
            if remaining[0] == 0:
                if self._status[batch] == "pending":
                    self._status[batch] = "done"
                    on_status(batch, "done")
                on_quiesced(batch)

        for page, tag, payload, t in zip(pages, tags, payloads, times):
            self.loop.after(t, write, page, tag, payload)
        if self.rng.random() < f.error:  # the error is reported before the last write lands
            self.stats["errors"] += 1
            self.loop.after(self.rng.uniform(0, last), self._fail, batch, on_status)
        if not pages:
            self.loop.after(0, lambda: (self._set_done(batch, on_status), on_quiesced(batch)))
        return batch

    def _set_done(self, batch: int, on_status) -> None:
        self._status[batch] = "done"
        on_status(batch, "done")

    def _fail(self, batch: int, on_status) -> None:
        if self._status[batch] == "pending":
            self._status[batch] = "failed"
            on_status(batch, "failed")

    def poll(self, batch: int) -> str:
        return self._status[batch]
