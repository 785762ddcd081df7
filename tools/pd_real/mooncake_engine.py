"""The protocol's transfer engine on Mooncake (TCP transport, ``P2PHANDSHAKE``), in two halves.

:class:`MooncakeEngine` is what a prefill rank's :class:`~layersplit.pd.abort.prefill_side.PrefillNode` posts
through — the interface of :class:`layersplit.pd.abort.transfer_engine.TransferEngine` (``post`` / ``poll`` /
``fail`` / ``fence`` / ``fenced`` / ``in_flight`` / ``when_drained`` / ``stats``, ``on_status`` and
``on_quiesced`` callbacks). Each ``post`` is one ``batch_transfer_async_write`` of its pages, from the
rank's registered source pool into decode's registered KV regions; a small pool of threads waits on
``get_batch_transfer_status`` (it blocks, with the GIL released) and hands each result to the event
loop through a pipe, so every callback runs on the loop's thread. A batch's status is final: the
engine reports a batch complete only once every byte landed (measured, probe (a)), so ``done`` and a
failure (a refused write, a dead peer: reported within about a second) both quiesce it.

**A timed-out status is not a quiescence.** ``get_batch_transfer_status`` gives up after Mooncake's
transfer timeout (``MC_TRANSFER_TIMEOUT``, 30 s by default, at least 5) and returns -1 while the
batch still runs; its bytes land later (measured, probe ``a-timeout``: 255 of 256 pages landed after the
report), and no later call says when they stop. So a timed-out batch is reported ``failed`` but never
quiesced — its request's abort is never acknowledged by this process — and ``on_timeout`` is called:
the process must die (its rank then comes back as a new incarnation, which decode admits only after
fencing the old one by address, below). ``unsafe_quiesce_on_timeout`` (UNSAFE, for the test) quiesces it.

:class:`DecodeMemory` is decode's side: per-layer KV buffers laid out like SGLang's (one registered
region per layer, ``num_pages`` pages of ``page_bytes``), and the fence.

**The fence is by address, not by writer.** A real engine cannot refuse one process's writes and
accept another's into the same memory (measured, probes (b) and (c)): a write to deregistered memory
is refused; a write to re-registered memory lands, whoever posted it; a dead writer's bytes still
buffered in decode's sockets landed before ``unregister_memory`` returned. So:

* fencing a dead rank (:meth:`DecodeMemory.fence`) deregisters the regions that rank writes and returns
  only once ``unregister_memory`` returned — only then may decode release the pages it was told;
* the regions are registered again (:meth:`DecodeMemory.readmit`) only for a *new* incarnation of the
  rank, and only once the old process is certainly dead: the supervisor starts a new incarnation only
  after it reaped the old one. If the old incarnation was not fenced yet (it restarted within its
  lease), ``readmit`` fences it first — deregistration flushes what it left in flight.

``refuse_fenced=False`` (UNSAFE: the real pair's ``--guard-off fence-refuses-writes``, for the storm that shows
the fence has teeth) keeps a fenced rank's regions registered: decode still releases what it was told, and
whatever the fenced process posts afterwards lands on those released pages.

The writer-side ``MooncakeEngine.fence`` keeps the simulated engine's meaning for posts not yet made
(a fenced owner's post is refused and quiesces at once); bytes already handed to Mooncake are fenced
only by decode's deregistration.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Hashable

import numpy as np

from tools.pd_real.engine import POISON, register
from tools.pd_real.landing import stamp
from layersplit.pd.abort.transfer_engine import OwnerBook, WriteTag


TIMEOUT_MARGIN_S = 0.25  # a status this close to the transfer timeout is the timeout's


def transfer_timeout_s() -> float:
    """Mooncake's wait limit in ``get_batch_transfer_status``, as its Python binding reads it."""
    value = os.environ.get("MC_TRANSFER_TIMEOUT")
    if not value:
        return 30.0
    digits = re.match(r"\s*[+-]?\d+", value)  # C's atoi: the leading integer, 0 when there is none
    return float(max(5, int(digits.group()) if digits else 0))


@dataclass(frozen=True)
class DecodeLayout:
    """Where one decode life's KV lives: its engine session and each layer region's base address."""

    life: int
    session: str
    bases: tuple[int, ...]  # per layer
    num_pages: int
    page_bytes: int

    def address(self, page: int, layer: int) -> int:
        if not 0 <= page < self.num_pages:
            raise ValueError(f"page: expected an index in [0, {self.num_pages}), got {page}")
        return self.bases[layer] + page * self.page_bytes

    def save(self, path: Path) -> None:
        """Publish as JSON at ``path``, atomically (a reader never sees half a layout)."""
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self)))
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path) -> "DecodeLayout":
        fields = json.loads(path.read_text())
        return cls(**{**fields, "bases": tuple(fields["bases"])})


class DecodeMemory:
    """Decode's KV: ``layers[l]`` is a ``[num_pages, page_bytes]`` uint8 region, registered with
    ``engine``; rank ``r`` of ``layers_by_rank`` writes only its own layers' regions."""

    def __init__(self, engine, session: str, life: int, num_pages: int, page_bytes: int,
                 layers_by_rank: tuple[tuple[int, ...], ...], refuse_fenced: bool = True) -> None:
        self.engine, self.session, self.life = engine, session, life
        self.refuse_fenced = refuse_fenced
        self.num_pages, self.page_bytes, self.layers_by_rank = num_pages, page_bytes, layers_by_rank
        num_layers = sum(len(ls) for ls in layers_by_rank)
        self.layers = [np.full((num_pages, page_bytes), POISON, np.uint8) for _ in range(num_layers)]
        for region in self.layers:
            register(engine, region.ctypes.data, region.nbytes)
        self.registered = [True] * num_layers
        self.fenced_upto = [-1] * len(layers_by_rank)  # per rank: the highest incarnation fenced
        self.stats = {"deregistrations": 0, "reregistrations": 0, "deregister_s_max": 0.0,
                      "unsafe_fences_kept_registered": 0}

    def layout(self) -> DecodeLayout:
        return DecodeLayout(self.life, self.session, tuple(r.ctypes.data for r in self.layers),
                            self.num_pages, self.page_bytes)

    def fence(self, rank: int, incarnation: int) -> None:
        """Deregister ``rank``'s regions; returns once ``unregister_memory`` returned, so nothing an
        incarnation ``<= incarnation`` posted can land from then on (the DecodeNode's ``fence_writer``).
        With ``refuse_fenced`` off (UNSAFE) the regions stay registered: the fence is only a record."""
        if not self.refuse_fenced:
            self.stats["unsafe_fences_kept_registered"] += 1
            self.fenced_upto[rank] = max(self.fenced_upto[rank], incarnation)
            return
        for layer in self.layers_by_rank[rank]:
            if self.registered[layer]:
                start = time.monotonic()
                rc = self.engine.unregister_memory(self.layers[layer].ctypes.data)
                if rc != 0:
                    raise RuntimeError(f"unregister_memory(layer {layer}): expected 0, got {rc}")
                self.registered[layer] = False
                self.stats["deregistrations"] += 1
                self.stats["deregister_s_max"] = max(self.stats["deregister_s_max"], time.monotonic() - start)
        self.fenced_upto[rank] = max(self.fenced_upto[rank], incarnation)

    def readmit(self, rank: int, incarnation: int) -> None:
        """A new ``incarnation`` of ``rank`` serves (its predecessor was reaped): fence the older ones,
        then register the rank's regions again."""
        assert incarnation > self.fenced_upto[rank], f"rank {rank}: incarnation {incarnation} was fenced"
        self.fence(rank, incarnation - 1)
        for layer in self.layers_by_rank[rank]:
            if self.registered[layer]:  # only where the (UNSAFE) fence left it registered
                continue
            region = self.layers[layer]
            register(self.engine, region.ctypes.data, region.nbytes)
            self.registered[layer] = True
            self.stats["reregistrations"] += 1


class _NoLayout(Exception):
    """A write names a decode life that published no layout (none is sent)."""


@dataclass(eq=False)
class _Batch:
    owner: Hashable
    on_status: Callable[[int, str], None]
    on_quiesced: Callable[[int], None]
    writes: int
    posted_at: float = field(default_factory=time.monotonic)


class MooncakeEngine(OwnerBook):
    """A prefill rank's engine: writes ``source_pages`` registered source pages (``page_bytes`` each)
    into the decode life's regions that ``layout(life)`` names. ``loop`` is the process's
    :class:`~tools.pd_real.wall_loop.WallLoop`; completions are drained on its thread."""

    def __init__(self, loop, engine, layout: Callable[[int], DecodeLayout | None], source_pages: int,
                 page_bytes: int, status_threads: int = 4, on_timeout: Callable[[int], None] | None = None,
                 unsafe_quiesce_on_timeout: bool = False) -> None:
        self.loop, self.engine, self.layout, self.page_bytes = loop, engine, layout, page_bytes
        self.on_timeout, self.unsafe_quiesce_on_timeout = on_timeout, unsafe_quiesce_on_timeout
        self.timeout_s = transfer_timeout_s()
        self.sources = np.full((source_pages, page_bytes), POISON, np.uint8)
        register(engine, self.sources.ctypes.data, self.sources.nbytes)
        self._status: dict[int, str] = {}
        self._batches: dict[int, _Batch] = {}
        self._next = 0
        self._in_flight: dict[Hashable, int] = {}
        self._drain_waiters: list[tuple[Callable[[Hashable], bool], Callable[[], None]]] = []
        self._results: list[tuple[int, int]] = []  # (batch, rc), appended by the status threads
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._pool = concurrent.futures.ThreadPoolExecutor(status_threads, thread_name_prefix="mooncake-status")
        loop.add_source(self._wake_r, self.drain)
        self.fenced_upto: int | None = None
        self.stats = {"batches": 0, "writes": 0, "errors": 0, "post_failures": 0, "fenced_refused": 0,
                      "fenced_landed": 0, "timeouts": 0, "status_s_max": 0.0}

    # posting ------------------------------------------------------------------------------------------
    def post(self, pages: list, tags: list[WriteTag], payloads: list, on_status: Callable[[int, str], None],
             on_quiesced: Callable[[int], None], owner: Hashable = None) -> int:
        """One batch: ``pages[i] = (decode page, layers)`` gets ``payloads[i]``'s source page, stamped
        with ``tags[i]`` (owner tag + CRC32, :func:`tools.pd_real.landing.stamp`). Returns its id."""
        batch, self._next = self._next, self._next + 1
        self._status[batch] = "pending"
        self._in_flight[owner] = self._in_flight.get(owner, 0) + 1
        self._batches[batch] = _Batch(owner, on_status, on_quiesced, 0)
        self.stats["batches"] += 1
        if self.fenced(owner):  # a fenced owner posts nothing more
            self.stats["fenced_refused"] += len(pages)
            self.loop.after(0, self._complete, batch, -1)
            return batch
        srcs, dsts, handle = [], [], None
        try:
            for (page, layers), tag, payload in zip(pages, tags, payloads):
                slot = payload.page  # a SourceRead: the NIC reads this source page
                payload()  # the protocol's source check (a freed source page is a stale read)
                self.sources[slot] = stamp(self.page_bytes, tag)
                where = self.layout(tag.life)
                if where is None:
                    raise _NoLayout(tag.life)
                for layer in layers:
                    srcs.append(self.sources[slot].ctypes.data)
                    dsts.append(where.address(page, layer))
            handle = self.engine.batch_transfer_async_write(where.session, srcs, dsts, [self.page_bytes] * len(srcs)) \
                if srcs else None
        except _NoLayout:  # no layout for the life: nothing is sent
            srcs, handle = [None], 0
        self._batches[batch].writes = len(srcs)
        if not srcs:
            self.loop.after(0, self._complete, batch, 0)
        elif not handle or handle < 0:  # the engine refused the batch (no session): nothing was sent
            self.stats["post_failures"] += 1
            self.loop.after(0, self._complete, batch, -1)
        else:
            self._pool.submit(self._wait, batch, handle)
        return batch

    def _wait(self, batch: int, handle: int) -> None:
        """A status thread: block until Mooncake reports the batch, then wake the loop."""
        rc = self.engine.get_batch_transfer_status([handle])
        self._results.append((batch, rc))  # list.append is atomic under the GIL
        os.write(self._wake_w, b"x")

    def drain(self) -> int:
        """On the loop's thread: hand every reported batch to the protocol."""
        with contextlib.suppress(BlockingIOError):  # woken by a result already drained: nothing to read
            os.read(self._wake_r, 4096)
        done = 0
        while self._results:
            batch, rc = self._results.pop(0)
            self._complete(batch, rc)
            done += 1
        return done

    def _complete(self, batch: int, rc: int) -> None:
        waited = time.monotonic() - self._batches[batch].posted_at
        self.stats["status_s_max"] = max(self.stats["status_s_max"], waited)
        if rc < 0 and waited >= self.timeout_s - TIMEOUT_MARGIN_S and not self.unsafe_quiesce_on_timeout:
            return self._timed_out(batch)
        record = self._batches.pop(batch)
        if rc == 0:
            self.stats["writes"] += record.writes
        else:
            self.stats["errors"] += 1
        if self._status[batch] == "pending":
            self._status[batch] = "done" if rc == 0 else "failed"
            record.on_status(batch, self._status[batch])
        self._in_flight[record.owner] -= 1
        record.on_quiesced(batch)  # reported = every byte landed or none will (probe a)
        if self._drain_waiters and not self._in_flight[record.owner]:
            self._wake_drained()

    def _timed_out(self, batch: int) -> None:
        """Mooncake gave up waiting, not the batch: report it failed, keep it in flight for good."""
        self.stats["timeouts"] += 1
        if self._status[batch] == "pending":
            self._status[batch] = "failed"
            self._batches[batch].on_status(batch, "failed")
        if self.on_timeout is not None:
            self.on_timeout(batch)

    # (fail, poll, fence, in_flight, when_drained: layersplit.pd.abort.transfer_engine.OwnerBook) -------------------------
    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
