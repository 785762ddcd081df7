"""Transfer-engine model: posted RDMA writes into the decode worker's KV pages.

A posted batch writes its pages one by one after random delays; a write cannot be cancelled. Each
batch has a status (``pending`` / ``done`` / ``failed``) for polling. An injected error makes the
status ``failed`` *before* the remaining writes have landed — as a NIC may report a failed work
request while earlier-posted data is still in flight — so only ``on_quiesced`` (every write of the
batch landed) says the pages are no longer being written.

The engine is the NIC: it outlives the process that posted a batch. Each batch names its ``owner``
(a prefill process incarnation) and ``when_drained`` tells a restarted process when every write
its previous lives posted has landed. A payload may be a zero-argument callable (a source-page
read): it is called when the write lands, because the NIC reads local memory when it transmits.

**Fencing** (``fence(upto)``): decode tears down the registration of a dead prefill process — as a
deregistered RDMA memory region / destroyed queue pair refuses remote writes — so from then on a
write of an owner (incarnation) ``<= upto`` is *refused* where it would land (counted, never applied)
and its batch still quiesces. Only then may decode release the pages that process was told.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable, Hashable, NamedTuple

from layersplit.pd.abort.sim import EventLoop


class WriteTag(NamedTuple):
    """Who a write belongs to: the request incarnation, the page generation it was given and the decode
    life (memory registration) the page belongs to.
    (A named tuple: every landing write compares one, so equality must be cheap.)"""

    room: int
    generation: int
    life: int = 0


@dataclass(frozen=True)
class EngineFaults:
    min_write_s: float = 0.001
    max_write_s: float = 0.05
    slow_write: float = 0.0  # probability a page write takes up to slow_write_s (a congested link)
    slow_write_s: float = 2.0
    error: float = 0.0  # probability a batch reports failure while its writes still land


@dataclass(eq=False)
class _Batch:
    owner: Hashable
    remaining: int  # writes not yet landed
    on_status: Callable[[int, str], None]
    on_quiesced: Callable[[int], None]


class OwnerBook:
    """What every transfer engine keeps, whatever moves the bytes (this model, or Mooncake in
    ``tools.pd_real.mooncake_engine``): each batch's status, batches in flight per owner (a prefill process
    incarnation), the drain waiters and the fence. A subclass sets ``_status``, ``_batches``, ``_in_flight``
    (owner -> batches not yet quiesced), ``_drain_waiters`` and ``fenced_upto`` (None: nothing fenced), and
    calls ``_wake_drained`` whenever an owner's count drops to 0. ``fail`` reports a batch failed while its
    writes may still land; it quiesces only when they have (or never will)."""

    _status: dict  # batch -> pending / done / failed
    _batches: dict  # batch -> its record (``on_status``), while not quiesced
    _in_flight: dict
    _drain_waiters: list
    fenced_upto: int | None

    def fail(self, batch: int) -> None:
        """The NIC reports ``batch`` failed; its writes still land (a no-op once it is done)."""
        if self._status[batch] == "pending":
            self._status[batch] = "failed"
            self._batches[batch].on_status(batch, "failed")

    def poll(self, batch: int) -> str:
        return self._status[batch]

    def fence(self, upto: int) -> None:
        """Fence every owner (incarnation) ``<= upto``: from now on their writes are refused."""
        self.fenced_upto = upto if self.fenced_upto is None else max(self.fenced_upto, upto)

    def fenced(self, owner: Hashable) -> bool:
        return isinstance(owner, int) and self.fenced_upto is not None and owner <= self.fenced_upto

    def in_flight(self, owners: Callable[[Hashable], bool]) -> int:
        """Batches posted by owners matching ``owners`` whose writes have not all landed."""
        return sum(n for owner, n in self._in_flight.items() if owners(owner))

    def when_drained(self, owners: Callable[[Hashable], bool], fn: Callable[[], None]) -> None:
        """Call ``fn()`` (now or later) once no batch of an owner matching ``owners`` is in flight."""
        self._drain_waiters.append((owners, fn))
        self._wake_drained()

    def _wake_drained(self) -> None:
        ready = [(owners, fn) for owners, fn in self._drain_waiters if not self.in_flight(owners)]
        self._drain_waiters = [w for w in self._drain_waiters if w not in ready]
        for _, fn in ready:
            fn()


class TransferEngine(OwnerBook):
    def __init__(self, loop: EventLoop, rng: random.Random, land: Callable, faults: EngineFaults) -> None:
        self.loop, self.rng, self.land, self.faults = loop, rng, land, faults
        self._status: dict[int, str] = {}
        self._next = 0
        self._in_flight: dict[Hashable, int] = {}  # owner -> batches not yet quiesced
        self._batches: dict[int, _Batch] = {}  # batches whose writes have not all landed
        self._drain_waiters: list[tuple[Callable[[Hashable], bool], Callable[[], None]]] = []
        self.fenced_upto: int | None = None  # owners <= this are fenced: their writes are refused
        self.stats = {"batches": 0, "writes": 0, "errors": 0, "fenced_refused": 0, "fenced_landed": 0}

    def post(self, pages: list, tags: list[WriteTag], payloads: list,
             on_status: Callable[[int, str], None], on_quiesced: Callable[[int], None], owner: Hashable = None) -> int:
        """Post one batch of page writes; returns its id. Callbacks: status change, all writes landed."""
        batch, self._next = self._next, self._next + 1
        self._status[batch] = "pending"
        self._in_flight[owner] = self._in_flight.get(owner, 0) + 1
        self._batches[batch] = _Batch(owner, len(pages), on_status, on_quiesced)
        self.stats["batches"] += 1
        f = self.faults
        times = [self.rng.uniform(f.min_write_s, f.max_write_s) if self.rng.random() >= f.slow_write
                 else self.rng.uniform(f.max_write_s, f.slow_write_s) for _ in pages]
        last = max(times, default=0.0)
        for page, tag, payload, t in zip(pages, tags, payloads, times):
            self.loop.after(t, self._write, batch, page, tag, payload)
        if self.rng.random() < f.error:  # the error is reported before the last write lands
            self.stats["errors"] += 1
            self.loop.after(self.rng.uniform(0, last), self.fail, batch)
        if not pages:
            self.loop.after(0, self._quiesce, batch)
        return batch

    def _write(self, batch: int, page, tag: WriteTag, payload) -> None:
        """One write of ``batch`` lands (events, not closures: a checker copies the whole state)."""
        record = self._batches[batch]
        if self._refuses(record.owner):  # the registration is torn down: the write never reaches the page
            self.stats["fenced_refused"] += 1
        else:
            self.stats["fenced_landed"] += self.fenced(record.owner)  # only with the fence guard off
            self.stats["writes"] += 1
            self.land(page, tag, payload() if callable(payload) else payload)
        record.remaining -= 1
        if record.remaining == 0:
            self._quiesce(batch)

    def _quiesce(self, batch: int) -> None:
        record = self._batches.pop(batch)
        if self._status[batch] == "pending":
            self._status[batch] = "done"
            record.on_status(batch, "done")
        self._in_flight[record.owner] -= 1
        record.on_quiesced(batch)
        if self._drain_waiters and not self._in_flight[record.owner]:
            self._wake_drained()

    def _refuses(self, owner: Hashable) -> bool:
        """Is a landing write of ``owner`` refused? (The fence guard: layersplit.pd.abort.guards switches it off.)"""
        return self.fenced(owner)


