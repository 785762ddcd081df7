"""Prefill worker: posts a request's KV writes, counts the ones in flight (a lease per request),
and answers an abort with "safe to release" only once that count is zero.

On ``Abort(token)`` it stops posting, tombstones the room (a late or duplicated ``TransferRequest``
for it is rejected, so no write for it is ever posted again), and replies ``AbortAck(token)`` as
soon as every posted write has *landed* — a batch that reported an error still counts until its
writes quiesce. An abort for a room it never saw is acknowledged at once (nothing was posted, and
the tombstone keeps it that way).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable

from pd.decode_side import page_payload
from pd.messages import Abort, AbortAck, TransferDone, TransferFailed, TransferRequest, TransferStarted
from pd.sim import EventLoop
from pd.transfer_engine import TransferEngine, WriteTag


@dataclass(frozen=True)
class PrefillConfig:
    min_compute_s: float = 0.01
    max_compute_s: float = 0.5
    straggler: float = 0.0  # probability the compute takes up to straggler_s (beyond decode's timeout)
    straggler_s: float = 3.0
    pages_per_batch: int = 2  # writes are posted in batches, layer group by layer group
    batch_gap_s: float = 0.01


@dataclass
class PrefillRequest:
    rid: int
    room: int
    pages: tuple[int, ...]
    msg: TransferRequest
    lease: int = 0  # posted batches whose writes have not all landed
    aborted: bool = False
    token: int | None = None
    failed: bool = False
    posted_all: bool = False


class PrefillNode:
    def __init__(self, peer: int, loop: EventLoop, rng: random.Random, cfg: PrefillConfig, engine: TransferEngine,
                 send: Callable[[object], None]) -> None:
        self.peer, self.loop, self.rng, self.cfg, self.engine, self.send = peer, loop, rng, cfg, engine, send
        self.reqs: dict[int, PrefillRequest] = {}
        self.tombstones: set[int] = set()
        self.stats = {"rejected_late": 0, "duplicates": 0, "acks_sent": 0}

    def handle(self, msg: object) -> None:
        if isinstance(msg, TransferRequest):
            self._on_transfer(msg)
        elif isinstance(msg, Abort):
            self._on_abort(msg)

    def _on_transfer(self, msg: TransferRequest) -> None:
        if msg.room in self.tombstones:
            self.stats["rejected_late"] += 1  # the request was aborted: never write for it again
            return
        if msg.room in self.reqs:
            self.stats["duplicates"] += 1
            return
        req = PrefillRequest(msg.rid, msg.room, msg.pages, msg)
        self.reqs[msg.room] = req
        c = self.cfg
        compute = (self.rng.uniform(c.min_compute_s, c.max_compute_s) if self.rng.random() >= c.straggler
                   else self.rng.uniform(c.max_compute_s, c.straggler_s))
        self.loop.after(compute, self._post, req, 0)

    def _post(self, req: PrefillRequest, start: int) -> None:
        if req.aborted or req.failed:
            return  # stop posting
        if start == 0:
            self.send(TransferStarted(req.rid, req.room, self.peer))
        chunk = list(range(start, min(start + self.cfg.pages_per_batch, len(req.pages))))
        pages = [req.pages[i] for i in chunk]
        tags = [WriteTag(req.room, req.msg.generations[i]) for i in chunk]
        payloads = [page_payload(req.room, req.msg.first_index + i * req.msg.stride) for i in chunk]
        req.lease += 1
        self.engine.post(pages, tags, payloads, lambda b, s: self._on_status(req, s),
                         lambda b: self._on_quiesced(req))
        if chunk and chunk[-1] + 1 < len(req.pages):
            self.loop.after(self.cfg.batch_gap_s, self._post, req, chunk[-1] + 1)
        else:
            req.posted_all = True

    def _on_status(self, req: PrefillRequest, status: str) -> None:
        if status == "failed" and not req.aborted and not req.failed:
            req.failed = True  # stop posting; decode will abort; the lease still counts in-flight writes
            self.send(TransferFailed(req.rid, req.room, self.peer))

    def _on_quiesced(self, req: PrefillRequest) -> None:
        req.lease -= 1
        if req.lease == 0:
            if req.aborted:
                self._ack(req)
            elif req.posted_all and not req.failed:
                self.send(TransferDone(req.rid, req.room, self.peer))
                self.tombstones.add(req.room)  # finished: a late duplicate request must not rewrite

    def _on_abort(self, msg: Abort) -> None:
        self.tombstones.add(msg.room)
        req = self.reqs.get(msg.room)
        if req is None:  # never saw the request: nothing posted, and the tombstone keeps it so
            self.stats["acks_sent"] += 1
            self.send(AbortAck(msg.rid, msg.room, msg.token, self.peer))
            return
        req.aborted, req.token = True, msg.token
        if req.lease == 0:
            self._ack(req)

    def _ack(self, req: PrefillRequest) -> None:
        self.stats["acks_sent"] += 1
        self.send(AbortAck(req.rid, req.room, req.token, self.peer))
