"""Decode worker: KV pages tagged (owner room, generation), request states, abort with deferred release.

States follow SGLang's ``KVPoll``: Bootstrapping -> WaitingForInput -> Transferring -> Success | Failed.
When a request's KV does not arrive in time (or a peer reports failure) decode **aborts** it: it
sends ``Abort(token)`` to every prefill peer that was given the request's page indices and moves the
pages to a **deferred-release** queue. The pages return to the allocator only when every such peer
has answered ``AbortAck`` with that token. Aborts are re-sent on a timer; past a deadline the pages
are **quarantined** (counted and logged, still never handed out) until the acks arrive.

``legacy_immediate_release=True`` restores the old behaviour — free on abort — and with it the race
in which a reused page receives the aborted request's late writes.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field
from typing import Callable

from pd.messages import Abort, AbortAck, TransferDone, TransferFailed, TransferRequest, TransferStarted
from pd.sim import EventLoop
from pd.transfer_engine import WriteTag

log = logging.getLogger(__name__)

BOOTSTRAPPING, WAITING, TRANSFERRING, SUCCESS, FAILED = (
    "Bootstrapping", "WaitingForInput", "Transferring", "Success", "Failed")


@dataclass(frozen=True)
class DecodeConfig:
    num_pages: int = 512
    wait_timeout_s: float = 1.0  # KV must arrive within this, else abort
    abort_retry_s: float = 0.2  # re-send unacknowledged aborts this often
    release_deadline_s: float = 5.0  # past this, unacknowledged pages are quarantined
    decode_s: float = 0.3  # how long a successful request decodes before freeing its pages
    legacy_immediate_release: bool = False  # UNSAFE: free pages at abort time (the old race)


class DecodeKV:
    """Decode-side KV pages: an allocator whose pages carry (owner room, generation), the page
    payloads, and the invariant checker every landing write goes through."""

    def __init__(self, num_pages: int) -> None:
        self.owner: list[WriteTag | None] = [None] * num_pages
        self.data: list[int | None] = [None] * num_pages
        self.free_pages = list(range(num_pages))
        self._generation = 0
        self.overwrites: list[tuple[int, WriteTag, WriteTag | None]] = []

    def alloc(self, n: int, room: int) -> list[int] | None:
        if n > len(self.free_pages):
            return None
        pages, self.free_pages = self.free_pages[:n], self.free_pages[n:]
        for p in pages:
            self._generation += 1
            self.owner[p] = WriteTag(room, self._generation)
            self.data[p] = None
        return pages

    def free(self, pages: list[int]) -> None:
        for p in pages:
            assert self.owner[p] is not None, f"double free of page {p}"
            self.owner[p] = None
        self.free_pages.extend(pages)

    def land(self, page: int, tag: WriteTag, payload: int) -> None:
        """A write arrives. Flag it if the page is no longer the writer's (owner or generation differ)."""
        if self.owner[page] != tag:
            self.overwrites.append((page, tag, self.owner[page]))
        self.data[page] = payload


def page_payload(room: int, index: int) -> int:
    """The KV content prefill writes into a request's ``index``-th page (what decode checksums)."""
    return hash((room, index)) & 0xFFFFFFFFFFFF


@dataclass
class DecodeRequest:
    rid: int
    room: int
    n_pages: int
    state: str = BOOTSTRAPPING
    pages: list[int] = field(default_factory=list)
    peers: tuple[int, ...] = ()
    done_peers: set[int] = field(default_factory=set)
    abort_token: int | None = None
    unacked: set[int] = field(default_factory=set)
    aborted_at: float = 0.0
    quarantined: bool = False


class DecodeNode:
    def __init__(self, loop: EventLoop, rng: random.Random, cfg: DecodeConfig, send: Callable[[int, object], None],
                 peers_for: Callable[[int], tuple[int, ...]], on_finish: Callable[[DecodeRequest], None]) -> None:
        self.loop, self.rng, self.cfg, self.send = loop, rng, cfg, send
        self.peers_for, self.on_finish = peers_for, on_finish
        self.kv = DecodeKV(cfg.num_pages)
        self.reqs: dict[int, DecodeRequest] = {}  # by room: live, or waiting for abort acks
        self.queue: list[DecodeRequest] = []
        self.stats = {"aborts": 0, "abort_sends": 0, "acks": 0, "stale_acks": 0, "late_messages": 0,
                      "quarantines": 0, "checksum_mismatches": 0, "success": 0, "failed": 0}

    # admission --------------------------------------------------------------------------------------
    def submit(self, rid: int, room: int, n_pages: int) -> None:
        self.queue.append(DecodeRequest(rid, room, n_pages))
        self._admit()

    def _admit(self) -> None:
        while self.queue:
            req = self.queue[0]
            pages = self.kv.alloc(req.n_pages, req.room)
            if pages is None:
                return
            self.queue.pop(0)
            req.pages, req.peers, req.state = pages, self.peers_for(req.rid), WAITING
            self.reqs[req.room] = req
            n = len(req.peers)
            for i, peer in enumerate(req.peers):  # each prefill peer writes a share of the pages
                share = tuple(pages[i::n])
                gens = tuple(self.kv.owner[p].generation for p in share)
                self.send(peer, TransferRequest(req.rid, req.room, share, gens, i, n))
            self.loop.after(self.cfg.wait_timeout_s, self._timeout, req)

    # messages from prefill ---------------------------------------------------------------------------
    def handle(self, msg: object) -> None:
        req = self.reqs.get(msg.room)
        if isinstance(msg, AbortAck):
            return self._ack(req, msg)
        if req is None or req.state in (SUCCESS, FAILED):
            self.stats["late_messages"] += 1
            return
        if isinstance(msg, TransferStarted) and req.state == WAITING:
            req.state = TRANSFERRING
        elif isinstance(msg, TransferDone):
            req.done_peers.add(msg.peer)
            if req.done_peers == set(req.peers):
                self._success(req)
        elif isinstance(msg, TransferFailed):
            self.abort(req)

    def _success(self, req: DecodeRequest) -> None:
        req.state = SUCCESS
        self.stats["success"] += 1
        expected = [page_payload(req.room, i) for i in range(len(req.pages))]
        got = [self.kv.data[p] for p in req.pages]
        if got != expected:  # decode starts: checksum the KV it is about to read
            self.stats["checksum_mismatches"] += 1
        self.loop.after(self.cfg.decode_s, self._finish, req)

    def _finish(self, req: DecodeRequest) -> None:
        self.kv.free(req.pages)
        del self.reqs[req.room]
        self.on_finish(req)
        self._admit()

    # abort -------------------------------------------------------------------------------------------
    def _timeout(self, req: DecodeRequest) -> None:
        if req.state in (WAITING, TRANSFERRING):
            self.abort(req)

    def abort(self, req: DecodeRequest) -> None:
        """Abort ``req``: notify every peer that got its page indices; release only after their acks."""
        req.state, req.aborted_at = FAILED, self.loop.now
        self.stats["aborts"] += 1
        self.stats["failed"] += 1
        self.on_finish(req)
        if self.cfg.legacy_immediate_release:  # UNSAFE: the old behaviour
            self.kv.free(req.pages)
            del self.reqs[req.room]
            self._admit()
            return
        req.abort_token = self.rng.getrandbits(63)
        req.unacked = set(req.peers)
        self._send_aborts(req)

    def _send_aborts(self, req: DecodeRequest) -> None:
        if not req.unacked or self.reqs.get(req.room) is not req:
            return
        for peer in sorted(req.unacked):
            self.stats["abort_sends"] += 1
            self.send(peer, Abort(req.rid, req.room, req.abort_token))
        if not req.quarantined and self.loop.now - req.aborted_at >= self.cfg.release_deadline_s:
            req.quarantined = True  # escalate: count and log; the pages stay held
            self.stats["quarantines"] += 1
            log.warning("room %d: %d pages quarantined, peers %s never acknowledged abort",
                        req.room, len(req.pages), sorted(req.unacked))
        self.loop.after(self.cfg.abort_retry_s, self._send_aborts, req)

    def _ack(self, req: DecodeRequest | None, ack: AbortAck) -> None:
        if req is None or req.abort_token != ack.token or ack.peer not in req.unacked:
            self.stats["stale_acks"] += 1  # another abort's ack, a duplicate, or an unknown room
            return
        self.stats["acks"] += 1
        req.unacked.discard(ack.peer)
        if not req.unacked:  # every peer confirmed: its writes never started or all landed
            self.kv.free(req.pages)
            del self.reqs[req.room]
            self._admit()

    @property
    def quarantined_pages(self) -> int:
        return sum(len(r.pages) for r in self.reqs.values() if r.quarantined)
