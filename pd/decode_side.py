"""Decode worker: request states, LayerSplit fan-in, and abort with deferred release.

States follow SGLang's ``KVPoll``: Bootstrapping -> WaitingForInput -> Transferring -> Success | Failed.
A request is **Bootstrapping** while it waits for pages and while decode resolves, on the bootstrap
server, the serving incarnation of every prefill rank; only then are its pages **announced**
(``TransferRequest`` to every rank, each writing the layers it owns). An abort is idempotent: only a
live request can be aborted, once. Its pages are released

* at once if no rank was told about them (still Bootstrapping);
* otherwise only when every told rank that has not reported ``TransferDone`` answered
  ``AbortAck(token)``. Aborts are re-sent with capped, jittered exponential backoff; past the bound
  the pages are **quarantined** (counted, logged once, never freed until the missing acks arrive)
  and the re-sends stop.

``legacy_immediate_release`` (free on abort) and ``unsafe_free_at_bound`` (free when the re-send
bound is reached: upstream's timeout path) are UNSAFE switches that exist to show the races.
"""

from __future__ import annotations

import logging
import random
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Callable

from pd.abort_backoff import AbortBackoff
from pd.bootstrap import BootstrapRegistry
from pd.decode_kv import DecodeKV
from pd.messages import Abort, AbortAck, TransferDone, TransferFailed, TransferRequest, TransferStarted
from pd.sim import EventLoop
from pd.topology import PrefillTopology
from pd.transfer_engine import WriteTag
from pd.watermark import LowWatermark

log = logging.getLogger(__name__)

BOOTSTRAPPING, WAITING, TRANSFERRING, SUCCESS, FAILED = (
    "Bootstrapping", "WaitingForInput", "Transferring", "Success", "Failed")
LIVE = (BOOTSTRAPPING, WAITING, TRANSFERRING)


@dataclass(frozen=True)
class DecodeConfig:
    num_pages: int = 512
    wait_timeout_s: float = 1.0  # from page allocation: the KV must arrive within this, else abort
    bootstrap_s: float = 0.01  # one bootstrap-server lookup
    poll_s: float = 0.15  # re-send TransferRequest to ranks not done; re-try a lookup while a rank is down
    decode_s: float = 0.3  # how long a successful request decodes before freeing its pages
    abort_backoff: AbortBackoff = AbortBackoff()
    legacy_immediate_release: bool = False  # UNSAFE: free pages at abort time (the old race)
    unsafe_free_at_bound: bool = False  # UNSAFE: free when the abort re-sends give up (a write may still land)


@dataclass(eq=False)
class DecodeRequest:
    rid: int
    room: int
    n_pages: int
    state: str = BOOTSTRAPPING
    pages: list[int] = field(default_factory=list)
    tags: tuple[WriteTag, ...] = ()  # the pages' owner tags: what release frees them as
    epoch: int = -1
    incarnations: tuple[int, ...] = ()  # per rank: the process its TransferRequest is addressed to
    told: frozenset[int] = frozenset()  # ranks that were given the page indices
    done_peers: set[int] = field(default_factory=set)
    open_ranks: set[int] = field(default_factory=set)  # ranks whose epoch is still open (see pd.watermark)
    abort_reason: str | None = None
    abort_token: int | None = None
    unacked: set[int] = field(default_factory=set)
    aborted_at: float = 0.0
    sends: int = 0  # abort sends so far
    quarantined: bool = False


class DecodeNode:
    """One decode worker talking to the prefill ranks of ``topology`` through ``send(rank, msg)``."""

    def __init__(self, loop: EventLoop, rng: random.Random, cfg: DecodeConfig, send: Callable[[int, object], None],
                 topology: PrefillTopology, registry: BootstrapRegistry,
                 on_finish: Callable[[DecodeRequest], None]) -> None:
        self.loop, self.rng, self.cfg, self.send = loop, rng, cfg, send
        self.topology, self.registry, self.on_finish = topology, registry, on_finish
        self.kv = DecodeKV(cfg.num_pages, topology.num_layers)
        self.reqs: dict[int, DecodeRequest] = {}  # by room: every request decode still holds
        self.queue: deque[DecodeRequest] = deque()  # waiting for pages
        self.watermarks = [LowWatermark() for _ in topology.ranks]
        self._epoch = 0
        self.release_latencies: list[float] = []  # abort -> release, virtual seconds
        self.abort_reasons: Counter[str] = Counter()
        self.stats = dict.fromkeys((
            "aborts", "aborts_ignored", "released_at_once", "abort_sends", "abort_resends", "acks",
            "acks_from_restarted_rank", "stale_acks", "late_messages", "transfer_resends", "quarantines",
            "quarantine_released", "quarantined_pages_freed", "checksum_mismatches", "success", "failed"), 0)

    # admission and bootstrap -----------------------------------------------------------------------
    def submit(self, rid: int, room: int, n_pages: int) -> DecodeRequest:
        if not 1 <= n_pages <= self.kv.num_pages:
            raise ValueError(f"n_pages: expected an integer in [1, {self.kv.num_pages}], got {n_pages}")
        req = DecodeRequest(rid, room, n_pages)
        self.reqs[room] = req
        self.queue.append(req)
        self._admit()
        return req

    def _admit(self) -> None:
        while self.queue:
            req = self.queue[0]
            pages = self.kv.alloc(req.n_pages, req.room)
            if pages is None:
                return
            self.queue.popleft()
            req.pages, req.tags = pages, self.kv.tags(pages)
            self.loop.after(self.cfg.wait_timeout_s, self._timeout, req)
            self.loop.after(self.cfg.bootstrap_s, self._resolve, req)

    def _resolve(self, req: DecodeRequest) -> None:
        if req.state != BOOTSTRAPPING or self.reqs.get(req.room) is not req:
            return  # aborted while bootstrapping
        incarnations = self.registry.resolve(self.topology.ranks)
        if incarnations is None:  # a rank is down: keep bootstrapping until it is back or we time out
            self.loop.after(self.cfg.poll_s, self._resolve, req)
        else:
            self._announce(req, incarnations)

    def _announce(self, req: DecodeRequest, incarnations: tuple[int, ...]) -> None:
        """Give every rank the page indices: from here on an abort must wait for their acks."""
        req.state, req.epoch, req.incarnations = WAITING, self._epoch, incarnations
        self._epoch += 1
        req.told = frozenset(self.topology.ranks)
        req.open_ranks = set(req.told)
        for rank in req.told:
            self.watermarks[rank].open(req.epoch)
        self._send_transfers(req, self.topology.ranks)
        self.loop.after(self.cfg.poll_s, self._poll, req)

    def _send_transfers(self, req: DecodeRequest, ranks) -> None:
        pages, generations = tuple(req.pages), tuple(t.generation for t in req.tags)
        for rank in ranks:
            self.send(rank, TransferRequest(req.rid, req.room, req.epoch, req.incarnations[rank],
                                            self.watermarks[rank].floor(), pages, generations))

    def _poll(self, req: DecodeRequest) -> None:
        if req.state not in (WAITING, TRANSFERRING) or self.reqs.get(req.room) is not req:
            return
        missing = [r for r in self.topology.ranks if r not in req.done_peers]
        self.stats["transfer_resends"] += len(missing)
        self._send_transfers(req, missing)  # idempotent: a done rank answers TransferDone again
        self.loop.after(self.cfg.poll_s, self._poll, req)

    # messages from prefill ---------------------------------------------------------------------------
    def handle(self, msg: object) -> None:
        if isinstance(msg, AbortAck):
            return self._ack(msg)
        req = self.reqs.get(msg.room)
        if req is None or req.state not in (WAITING, TRANSFERRING):
            self.stats["late_messages"] += 1
            return
        if isinstance(msg, TransferStarted) and req.state == WAITING:
            req.state = TRANSFERRING
        elif isinstance(msg, TransferDone) and msg.peer not in req.done_peers:
            req.done_peers.add(msg.peer)
            self._close(req, msg.peer)  # its writes all landed: decode never waits on it for this room again
            if len(req.done_peers) == len(req.told):
                self._success(req)
        elif isinstance(msg, TransferFailed):
            self.abort(req, "failed")

    def _success(self, req: DecodeRequest) -> None:
        req.state = SUCCESS
        self.stats["success"] += 1
        if not self.kv.intact(req.pages, req.room):  # decode starts: checksum every layer it will read
            self.stats["checksum_mismatches"] += 1
        self.loop.after(self.cfg.decode_s, self._finish, req)

    def _finish(self, req: DecodeRequest) -> None:
        self._release(req)
        self.on_finish(req)

    # abort -------------------------------------------------------------------------------------------
    def _timeout(self, req: DecodeRequest) -> None:
        if self._abortable(req):
            self.abort(req, "timeout")

    def abort(self, req: DecodeRequest, reason: str = "client") -> None:
        """Abort ``req``. Idempotent: a request that is not live (already aborted, succeeded or
        released) is left alone. Pages are released only when no rank can still write them."""
        if not self._abortable(req):
            self.stats["aborts_ignored"] += 1
            return
        self.abort_reasons[f"{reason}_{'bootstrapping' if req.state == BOOTSTRAPPING else 'announced'}"] += 1
        req.state, req.abort_reason, req.aborted_at = FAILED, reason, self.loop.now
        self.stats["aborts"] += 1
        self.stats["failed"] += 1
        self.on_finish(req)
        if self.cfg.legacy_immediate_release:  # UNSAFE: the old behaviour
            return self._release(req)
        req.unacked = self._must_ack(req)
        if not req.unacked:  # no rank was told (Bootstrapping), or every told rank reported done
            self.stats["released_at_once"] += 1
            return self._release(req)
        req.abort_token = self.rng.getrandbits(63)
        self._send_aborts(req)

    def _abortable(self, req: DecodeRequest) -> bool:
        return req.state in LIVE and self.reqs.get(req.room) is req

    def _must_ack(self, req: DecodeRequest) -> set[int]:
        """Ranks that may still write the pages: told, and not reported done (a done rank drained)."""
        return set(req.told - req.done_peers)

    def _send_aborts(self, req: DecodeRequest) -> None:
        if not req.unacked or req.quarantined or self.reqs.get(req.room) is not req:
            return
        backoff = self.cfg.abort_backoff
        if backoff.exhausted(req.sends):
            return self._give_up(req)
        req.sends += 1
        for rank in sorted(req.unacked):
            self.stats["abort_sends"] += 1
            self.stats["abort_resends"] += req.sends > 1
            self.send(rank, Abort(req.rid, req.room, req.abort_token, req.epoch, self.watermarks[rank].floor()))
        self.loop.after(backoff.delay(req.sends, self.rng), self._send_aborts, req)

    def _give_up(self, req: DecodeRequest) -> None:
        if self.cfg.unsafe_free_at_bound:  # UNSAFE: upstream's timeout path — a write may still land
            self.stats["quarantined_pages_freed"] += len(req.pages)
            return self._release(req)
        req.quarantined = True  # the pages stay held; a late ack still releases them
        self.stats["quarantines"] += 1
        log.warning("room %d: %d pages quarantined after %d abort sends; ranks %s never acknowledged",
                    req.room, len(req.pages), req.sends, sorted(req.unacked))

    def _ack(self, ack: AbortAck) -> None:
        req = self.reqs.get(ack.room)
        if req is None or req.abort_token != ack.token or ack.peer not in req.unacked:
            self.stats["stale_acks"] += 1  # another abort's ack, a duplicate, or an unknown room
            return
        self.stats["acks"] += 1
        self.stats["acks_from_restarted_rank"] += ack.incarnation != req.incarnations[ack.peer]
        req.unacked.discard(ack.peer)
        self._close(req, ack.peer)
        if not req.unacked:  # every rank confirmed: its writes never started or all landed
            self.stats["quarantine_released"] += req.quarantined
            self._release(req)

    # release -----------------------------------------------------------------------------------------
    def _release(self, req: DecodeRequest) -> None:
        self.kv.free(req.pages, req.tags)  # the checker reports a free by anyone but the pages' owner
        self.reqs.pop(req.room, None)
        if not req.pages:
            self.queue.remove(req)  # aborted while waiting for pages
        for rank in list(req.open_ranks):
            self._close(req, rank)
        if req.state == FAILED:
            self.release_latencies.append(self.loop.now - req.aborted_at)
        self._admit()

    def _close(self, req: DecodeRequest, rank: int) -> None:
        if rank in req.open_ranks:
            req.open_ranks.discard(rank)
            self.watermarks[rank].close(req.epoch)

    @property
    def quarantined_pages(self) -> int:
        return sum(len(r.pages) for r in self.reqs.values() if r.quarantined)
