"""Prefill CP rank: a process (an *incarnation*) that may crash and restart, and its NIC (the engine).

The rank owns some layers (LayerSplit); for each ``TransferRequest`` it allocates source pages, runs
the forward pass (its last owned layer is ready ``fraction`` of the way through) and posts writes of
its layers into decode's pages, counting the batches in flight (a lease per request).

On ``Abort(token)`` it stops posting and replies ``AbortAck(token)`` once every posted write has
*landed* — a batch that reported an error still counts until its writes quiesce. A room it has no
record of is answered at once and tombstoned (so a late ``TransferRequest`` for it is rejected);
below decode's floor it needs no tombstone (see ``layersplit.pd.abort.room_book``). Source pages are freed only when
the forward is over and the last write reading them drained.

A restarted process has lost all of that state. It therefore (1) rejects ``TransferRequest``s
addressed to another incarnation — the duplicates its previous life would have recognised — and
(2) serves nothing, not even aborts, until every write its previous lives posted has drained:
"never saw it" must hold for the whole rank, not just for this process. A crashed process stops
renewing its bootstrap lease, which expires ``lease_s`` later (until then the registry is stale).

Every message names the decode **life** it comes from. One from a newer life means decode restarted:
the rooms of the old life are forgotten (their writes stop being posted; those in flight are refused
by the old life's torn-down memory) and so is the old life's floor — the new life numbers its epochs
from 0 again, and an old floor would reject them as late. A message of an older life is dropped.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from functools import partial
from typing import Callable

from layersplit.pd.abort.bootstrap import BootstrapRegistry
from layersplit.pd.abort.messages import Abort, AbortAck, TransferDone, TransferFailed, TransferRequest, TransferStarted
from layersplit.pd.abort.prefill_kv import PrefillKV, SourceRead
from layersplit.pd.abort.room_book import RoomBook
from layersplit.pd.abort.sim import EventLoop
from layersplit.pd.abort.topology import PrefillTopology
from layersplit.pd.abort.transfer_engine import TransferEngine, WriteTag


@dataclass(frozen=True)
class PrefillConfig:
    min_compute_s: float = 0.01
    max_compute_s: float = 0.5
    straggler: float = 0.0  # probability the forward takes up to straggler_s (beyond decode's timeout)
    straggler_s: float = 3.0
    pages_per_batch: int = 2  # writes are posted in batches
    batch_gap_s: float = 0.01
    source_pages: int = 1024  # the rank's own KV pool: what its writes read from
    compute_seed: int = 0  # seeds each room's forward time, which every CP rank shares
    lease_s: float = 2.0  # the bootstrap lease: a dead process is still shown serving this long
    heartbeat_s: float = 0.5  # a live process renews its lease this often (a revoked one learns it so)


def forward_time(cfg: PrefillConfig, room: int) -> float:
    """The room's whole forward pass: the CP ranks run it together, so every rank draws the same time."""
    u, v = _unit(cfg.compute_seed, room, 0), _unit(cfg.compute_seed, room, 1)
    if v >= cfg.straggler:
        return cfg.min_compute_s + u * (cfg.max_compute_s - cfg.min_compute_s)
    return cfg.max_compute_s + u * (cfg.straggler_s - cfg.max_compute_s)


def _unit(seed: int, room: int, k: int) -> float:
    """A uniform draw in [0, 1) fixed by (seed, room, k): splitmix64, so no rank needs shared state."""
    mask = (1 << 64) - 1
    z = (hash((seed, room, k)) + 0x9E3779B97F4A7C15) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return (z ^ (z >> 31)) / 2**64


@dataclass(eq=False)
class PrefillRequest:
    msg: TransferRequest
    incarnation: int  # the process that accepted it; callbacks of a dead process do nothing
    sources: list[int] = field(default_factory=list)
    source_tags: tuple[WriteTag, ...] = ()
    computing: bool = False
    lease: int = 0  # posted batches whose writes have not all landed
    aborted: bool = False
    token: int | None = None
    failed: bool = False
    posted_all: bool = False
    done: bool = False
    orphaned: bool = False  # its decode life is dead: nobody waits for an answer


class PrefillNode:
    """Prefill CP rank ``rank`` of ``topology``: writes through ``engine``, answers decode via ``send``."""

    def __init__(self, rank: int, loop: EventLoop, cfg: PrefillConfig, engine: TransferEngine,
                 send: Callable[[object], None], topology: PrefillTopology, registry: BootstrapRegistry) -> None:
        self.peer, self.loop, self.cfg, self.engine, self.send = rank, loop, cfg, engine, send
        self.layers, self.fraction = topology.layers_by_rank[rank], topology.last_layer_fraction(rank)
        self.registry = registry
        self.incarnation, self.alive, self.up = 0, True, False
        self.decode_life = 0  # the newest decode life this rank has heard from
        self.on_late_reject: Callable[[int, TransferRequest], None] | None = None  # a tap (the checks)
        self.stats = dict.fromkeys(("rejected_late", "wrong_incarnation", "duplicates", "acks_sent",
                                    "lost_while_down", "crashes", "stale_decode_life", "decode_lives",
                                    "orphaned"), 0)
        self._past_peaks = (0, 0)
        self._start_life()
        self._serve(0)

    # process life ------------------------------------------------------------------------------------
    def _start_life(self) -> None:
        self.book = RoomBook()
        self.kv = PrefillKV(self.cfg.source_pages)
        self.queue: list[PrefillRequest] = []  # accepted, waiting for source pages
        self.orphans: set[PrefillRequest] = set()  # records of a dead decode life still holding sources

    def crash(self) -> None:
        """The process dies: its state is lost; writes it posted keep landing (the NIC drains them)."""
        self._past_peaks = (self.peak_records, self.peak_tombstones)
        self.alive = self.up = False
        self.loop.after(self.cfg.lease_s, self.registry.expire, self.peer, self.incarnation)  # stale till then
        self.stats["crashes"] += 1

    def restart(self) -> None:
        """A new process, incarnation + 1 (above any fenced one), with empty state; it serves once the old
        writes drained (a fence refuses what was still in flight, so that is then at once)."""
        assert not self.alive, "restart of a live process"
        self.incarnation = max(self.incarnation, self.registry.revoked[self.peer]) + 1
        self.alive = True
        self._start_life()
        self._await_old_writes(self.incarnation)

    def _await_old_writes(self, incarnation: int) -> None:
        self.engine.when_drained(partial(operator.gt, incarnation), partial(self._serve, incarnation))  # owner < incarnation

    def _serve(self, incarnation: int) -> None:
        if incarnation != self.incarnation or not self.alive:
            return  # crashed again while waiting
        self.up = True
        self.registry.register(self.peer, incarnation)

    def _live(self, req: PrefillRequest) -> bool:
        return self.alive and req.incarnation == self.incarnation

    @property
    def peak_records(self) -> int:
        return max(self._past_peaks[0], self.book.peak_records)

    @property
    def peak_tombstones(self) -> int:
        return max(self._past_peaks[1], self.book.peak_tombstones)

    # messages from decode ----------------------------------------------------------------------------
    def handle(self, msg: object, src: str | None = None) -> None:
        if not self.up:
            self.stats["lost_while_down"] += 1
            return
        if msg.decode_life < self.decode_life:
            self.stats["stale_decode_life"] += 1  # a dead decode life's message: nobody waits on it
            return
        if msg.decode_life > self.decode_life:
            self._new_decode_life(msg.decode_life)
        self.book.advance(msg.floor)
        if isinstance(msg, TransferRequest):
            self._on_transfer(msg)
        elif isinstance(msg, Abort):
            self._on_abort(msg)

    def _new_decode_life(self, life: int) -> None:
        """Decode restarted: stop working for its old life and forget the old life's rooms and floor."""
        self.stats["decode_lives"] += 1
        old = list(self.book.records.values())
        self.decode_life, self.queue = life, []
        self._reset_book()
        for req in old:
            req.aborted = req.orphaned = True  # stop posting; no answer is owed to a dead life
            self.stats["orphaned"] += 1
            if req.sources:
                self.orphans.add(req)
                self._settle(req)

    def _reset_book(self) -> None:
        self.book = RoomBook()  # the new life's epochs start at 0 (layersplit.pd.abort.guards: floor-per-decode-life)

    def _on_transfer(self, msg: TransferRequest) -> None:
        if not self._addressed_here(msg):
            self.stats["wrong_incarnation"] += 1  # meant for a previous life, whose records are gone
            return
        if self.book.below_floor(msg.epoch) or msg.room in self.book.tombstones:
            self.stats["rejected_late"] += 1  # closed or aborted: never write for it again
            if self.on_late_reject is not None:
                self.on_late_reject(self.peer, msg)
            return
        req = self.book.records.get(msg.room)
        if req is not None:
            return self._repeat(req)
        req = PrefillRequest(msg, self.incarnation)
        self.book.add_record(msg.epoch, msg.room, req)
        self.queue.append(req)
        self._start_queued()

    def _addressed_here(self, msg: TransferRequest) -> bool:
        return msg.incarnation == self.incarnation

    def _repeat(self, req: PrefillRequest) -> None:
        """A repeated request (decode's poll, or a duplicate): answer again, never post again."""
        self.stats["duplicates"] += 1
        if req.done:
            self.send(self._reply(TransferDone, req))
        elif req.failed and not req.aborted:
            self.send(self._reply(TransferFailed, req))

    def _reply(self, kind: type, req: PrefillRequest):
        return kind(req.msg.rid, req.msg.room, self.peer, self.incarnation, req.msg.decode_life)

    def _on_abort(self, msg: Abort) -> None:
        req = self.book.records.get(msg.room)
        if req is None:  # never saw it: nothing posted by this life, and earlier lives drained before we served
            if not self.book.below_floor(msg.epoch):
                self.book.add_tombstone(msg.epoch, msg.room)  # a late TransferRequest must be rejected
            return self._send_ack(msg.rid, msg.room, msg.token, msg.decode_life)
        req.aborted, req.token = True, msg.token
        if req in self.queue:
            self.queue.remove(req)
        if req.lease == 0:  # no write in flight, and none will be posted
            self._send_ack(msg.rid, msg.room, msg.token, msg.decode_life)
            self._settle(req)

    def _send_ack(self, rid: int, room: int, token: int, decode_life: int) -> None:
        self.stats["acks_sent"] += 1
        self.send(AbortAck(rid, room, token, self.peer, self.incarnation, decode_life))

    # forward and writes ------------------------------------------------------------------------------
    def _start_queued(self) -> None:
        while self.queue:
            req = self.queue[0]
            pages = self.kv.alloc(len(req.msg.pages), req.msg.room)
            if pages is None:
                return
            self.queue.pop(0)
            req.sources, req.source_tags, req.computing = pages, self.kv.tags(pages), True
            self.kv.fill(pages, req.msg.room)
            self.loop.after(forward_time(self.cfg, req.msg.room) * self.fraction, self._computed, req)

    def _computed(self, req: PrefillRequest) -> None:
        if not self._live(req):
            return
        req.computing = False
        if req.aborted:
            return self._settle(req)  # acked at abort time; now the forward no longer touches the sources
        self.send(self._reply(TransferStarted, req))
        self._post(req, 0)

    def _post(self, req: PrefillRequest, start: int) -> None:
        if not self._live(req) or req.aborted or req.failed:
            return  # stop posting; the lease still counts the writes in flight
        msg, end = req.msg, min(start + self.cfg.pages_per_batch, len(req.msg.pages))
        index = range(start, end)
        req.lease += 1
        self.engine.post([(msg.pages[i], self.layers) for i in index],
                         [WriteTag(msg.room, msg.generations[i], msg.decode_life) for i in index],
                         [SourceRead(self.kv, req.sources[i], req.source_tags[i]) for i in index],
                         partial(self._on_status, req), partial(self._on_quiesced, req), owner=self.incarnation)
        if end < len(msg.pages):
            self.loop.after(self.cfg.batch_gap_s, self._post, req, end)
        else:
            req.posted_all = True
            self._settle(req)

    def _on_status(self, req: PrefillRequest, batch: int, status: str) -> None:
        if self._live(req) and status == "failed" and not req.aborted and not req.failed:
            req.failed = True  # stop posting; decode will abort; the lease still counts in-flight writes
            self.send(self._reply(TransferFailed, req))

    def _on_quiesced(self, req: PrefillRequest, batch: int) -> None:
        if not self._live(req):
            return
        req.lease -= 1
        if req.lease:
            return
        if req.orphaned:
            pass  # its decode life is dead: nothing to answer
        elif req.aborted:
            self._send_ack(req.msg.rid, req.msg.room, req.token, req.msg.decode_life)
        elif req.posted_all and not req.failed:
            req.done = True  # its record now answers repeats with TransferDone and rejects re-posting
            self.send(self._reply(TransferDone, req))
        self._settle(req)

    def _settle(self, req: PrefillRequest) -> None:
        """Free the source pages once nothing can read them: no more posting, forward over, writes drained."""
        if req.sources and (req.aborted or req.failed or req.posted_all) and self._sources_drained(req):
            self.kv.free(req.sources, req.source_tags)
            req.sources = []
            self.orphans.discard(req)
            self._start_queued()

    def _sources_drained(self, req: PrefillRequest) -> bool:
        return req.lease == 0 and not req.computing
