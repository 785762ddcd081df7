"""Decode worker: request states, LayerSplit fan-in, and abort with deferred release.

States follow SGLang's ``KVPoll``: Bootstrapping -> WaitingForInput -> Transferring -> Success | Failed.
A request is **Bootstrapping** while it waits for pages and while decode resolves, on the bootstrap
server, the serving incarnation of every prefill rank; only then are its pages **announced**
(``TransferRequest`` to every rank, each writing the layers it owns). An abort is idempotent: only a
live request can be aborted, once. Its pages are released

* at once if no rank was told about them (still Bootstrapping);
* otherwise only when every told rank that has not reported ``TransferDone`` answered
  ``AbortAck(token)`` — or was **fenced** (below). Aborts are re-sent with capped, jittered exponential
  backoff; past the bound the request is **quarantined** (counted, logged once) and the re-sends go on
  at the cap while the rank is registered, pause while its lease is expired, and resume the moment it
  registers again. A late ack is honoured whenever it comes.

**Membership, not counts**: success needs a ``TransferDone`` from every told rank, and only a reply
that the channel delivered from the peer it names (``_from_peer``) and that comes from an owner — a
told rank, the incarnation the request was addressed to (``_record_done``) — counts; anything else is
counted (``misaddressed``, ``non_owner``) and ignored. **Fencing**: a rank whose bootstrap lease
expired and that stayed down ``fence_after_s`` is declared dead; decode tears down its registration
(the transfer engine refuses its writes from then on) and only then releases what waited on it; with
``fence_unreachable_s``, so is a rank that holds its lease but has not acknowledged an abort that long
(a cut control link).
**Decode life**: every decode process — constructed fresh (the OS started it after a crash) or
restarted in place (``restart``) — takes its life from the bootstrap registry (``register_decode``), so
it is above every life before, even one whose process died. A new life loses every request and
registers the memory anew, so the old life's writes are refused; every message carries the life.

``legacy_immediate_release``, ``unsafe_free_at_bound`` and ``unsafe_terminal_quarantine`` are UNSAFE
switches that exist to show the races and the leak (see also ``layersplit.pd.abort.guards``).
"""

from __future__ import annotations

import logging
import random
from collections import Counter, deque
from typing import Callable

from layersplit.pd.abort.bootstrap import BootstrapRegistry
from layersplit.pd.abort.decode_health import RankHealth
from layersplit.pd.abort.decode_kv import DecodeKV
from layersplit.pd.abort.decode_request import (BOOTSTRAPPING, FAILED, LIVE, SUCCESS, TRANSFERRING, WAITING,  # noqa: F401 - API
                               DecodeConfig, DecodeRequest)
from layersplit.pd.abort.messages import Abort, AbortAck, TransferDone, TransferFailed, TransferRequest, TransferStarted
from layersplit.pd.abort.sim import EventLoop
from layersplit.pd.abort.topology import PrefillTopology
from layersplit.pd.abort.watermark import LowWatermark

log = logging.getLogger(__name__)


class DecodeNode:
    """One decode worker talking to the prefill ranks of ``topology`` through ``send(rank, msg)``;
    ``fence_writer(rank, incarnation)`` tears down a dead rank's registration (refuses its writes).
    ``life``: the one ``registry`` already issued this process (a real process registers before it
    builds its memory); None: register now."""

    def __init__(self, loop: EventLoop, rng: random.Random, cfg: DecodeConfig, send: Callable[[int, object], None],
                 topology: PrefillTopology, registry: BootstrapRegistry,
                 on_finish: Callable[[DecodeRequest], None],
                 fence_writer: Callable[[int, int], None] | None = None, life: int | None = None) -> None:
        self.loop, self.rng, self.cfg, self.send = loop, rng, cfg, send
        self.topology, self.registry, self.on_finish, self.fence_writer = topology, registry, on_finish, fence_writer
        self.life = registry.register_decode() if life is None else life
        assert self.life == registry.decode_life(), f"life {self.life}: not the registry's newest"
        self.heard = [0] * len(topology.ranks)  # per rank: messages delivered from it (the link works)
        self.fenced = [-1] * len(topology.ranks)  # per rank: the highest fenced incarnation
        self.fences: list[tuple[int, int, float]] = []  # (rank, incarnation, time)
        self.release_latencies: list[float] = []  # abort -> release, virtual seconds
        self.releases: list[tuple[float, int]] = []  # (time, room) of every abort's release
        self.abort_reasons: Counter[str] = Counter()
        self.stats = dict.fromkeys((
            "aborts", "aborts_ignored", "released_at_once", "abort_sends", "abort_resends", "acks",
            "acks_from_restarted_rank", "stale_acks", "late_messages", "transfer_resends", "quarantines",
            "quarantine_released", "quarantined_pages_freed", "checksum_mismatches", "success", "failed",
            "misaddressed", "non_owner", "old_life_messages", "fences", "released_by_fence", "resumed_sends",
            "paused_sends", "decode_restarts", "unreachable_fences"), 0)
        self.held_aborted_pages = self.peak_held_aborted_pages = 0  # pages of aborted requests awaiting acks
        self._new_life()
        self.health = RankHealth(self)  # resumes re-sends, fences dead ranks (layersplit.pd.abort.decode_health)
        registry.watch(self.health.changed)

    def _new_life(self) -> None:
        self.kv = DecodeKV(self.cfg.num_pages, self.topology.num_layers, self.life)
        self.reqs: dict[int, DecodeRequest] = {}  # by room: every request decode still holds
        self.queue: deque[DecodeRequest] = deque()  # waiting for pages
        self.watermarks = [LowWatermark() for _ in self.topology.ranks]
        self._epoch = 0
        self.held_aborted_pages = 0

    def restart(self) -> None:
        """The decode process dies and a new life starts: every request is lost (reported failed, so
        the router retries it), the memory is registered anew (the old life's writes are refused where
        they land) and epochs restart at 0 (prefill resets its floor for the new life)."""
        lost = [r for r in self.reqs.values() if r.state != FAILED]
        self.life = self.registry.register_decode()
        self.stats["decode_restarts"] += 1
        self._new_life()
        self._lose(lost)

    def crash(self) -> None:
        """The decode process dies for good (a fresh DecodeNode takes over): it hears the registry no
        more and every request is lost, reported failed so the router retries it. Its pending timers
        die with it: the caller drops them from the loop."""
        lost = [r for r in self.reqs.values() if r.state != FAILED]
        self.registry.unwatch(self.health.changed)
        self.reqs, self.queue = {}, deque()
        self._lose(lost)

    def _lose(self, lost: list[DecodeRequest]) -> None:
        for req in lost:
            req.state, req.abort_reason = FAILED, "decode_restart"
            self.on_finish(req)

    def current(self, req: DecodeRequest) -> bool:
        return self.reqs.get(req.room) is req

    # admission and bootstrap -----------------------------------------------------------------------
    def submit(self, rid: int, room: int, n_pages: int) -> DecodeRequest:
        if not 1 <= n_pages <= self.kv.num_pages:
            raise ValueError(f"n_pages: expected an integer in [1, {self.kv.num_pages}], got {n_pages}")
        req = DecodeRequest(rid, room, n_pages)
        self.reqs[room] = req
        self.queue.append(req)
        if self.cfg.queue_timeout_s is not None:
            self.loop.after(self.cfg.queue_timeout_s, self._queue_timeout, req)
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

    def _queue_timeout(self, req: DecodeRequest) -> None:
        if not req.pages and self._abortable(req):  # still waiting for pages (e.g. behind an outage)
            self.abort(req, "queue_timeout")

    def _resolve(self, req: DecodeRequest) -> None:
        if req.state != BOOTSTRAPPING or not self.current(req):
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
        self.send_transfers(req, self.topology.ranks)
        self.loop.after(self.cfg.poll_s, self._poll, req)

    def send_transfers(self, req: DecodeRequest, ranks) -> None:
        pages, generations = tuple(req.pages), tuple(t.generation for t in req.tags)
        for rank in ranks:
            self.send(rank, TransferRequest(req.rid, req.room, req.epoch, req.incarnations[rank],
                                            self.watermarks[rank].floor(), pages, generations, self.life))

    def _poll(self, req: DecodeRequest) -> None:
        if req.state not in (WAITING, TRANSFERRING) or not self.current(req):
            return
        missing = [r for r in self.topology.ranks if r not in req.done_peers]
        self.stats["transfer_resends"] += len(missing)
        self.send_transfers(req, missing)  # idempotent: a done rank answers TransferDone again
        self.loop.after(self.cfg.poll_s, self._poll, req)

    # messages from prefill ---------------------------------------------------------------------------
    def handle(self, msg: object, src: int | None = None) -> None:
        """A reply from prefill; ``src``: the rank the channel delivered it from (None: not known)."""
        if src is not None and 0 <= src < len(self.heard):
            self.heard[src] += 1  # any message, even one acted on never: decode's link to src works
        if msg.decode_life != self.life:
            self.stats["old_life_messages"] += 1  # a reply to a previous life of this decode worker
            return
        if src is not None and not self._from_peer(msg, src):
            self.stats["misaddressed"] += 1  # names a peer it did not come from: never acted on
            log.debug("reply from prefill%d names peer %d: ignored", src, msg.peer)
            return
        if isinstance(msg, AbortAck):
            return self._ack(msg)
        req = self.reqs.get(msg.room)
        if req is None or req.state not in (WAITING, TRANSFERRING):
            self.stats["late_messages"] += 1
            return
        if isinstance(msg, TransferStarted) and req.state == WAITING and self._owner(req, msg):
            req.state = TRANSFERRING
        elif isinstance(msg, TransferDone) and msg.peer not in req.done_peers:
            if self._record_done(req, msg):
                self._success(req)
        elif isinstance(msg, TransferFailed) and self._owner(req, msg):
            self.abort(req, "failed")

    def _from_peer(self, msg: object, src: int) -> bool:
        """Did the channel deliver ``msg`` from the peer it names? (the transport's identity)"""
        return msg.peer == src

    def _owner(self, req: DecodeRequest, msg: object) -> bool:
        """Is the sender an owner of ``req``: a told rank, the incarnation it was addressed to?"""
        owner = msg.peer in req.told and msg.incarnation == req.incarnations[msg.peer]
        self.stats["non_owner"] += not owner
        return owner

    def _record_done(self, req: DecodeRequest, msg: TransferDone) -> bool:
        """Count an owner's ``TransferDone``; True once every told rank reported it (membership)."""
        if not self._owner(req, msg):
            return False
        req.done_peers.add(msg.peer)
        self._close(req, msg.peer)  # its writes all landed: decode never waits on it for this room again
        return req.told <= req.done_peers

    def _success(self, req: DecodeRequest) -> None:
        req.state = SUCCESS
        self.stats["success"] += 1
        if not self.kv.intact(req.pages, req.room):  # decode starts: checksum every layer it will read
            self.stats["checksum_mismatches"] += 1
        self.loop.after(self.cfg.decode_s, self._finish, req)

    def _finish(self, req: DecodeRequest) -> None:
        if self.current(req):  # not lost to a decode restart meanwhile
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
        if not req.unacked:  # no rank was told (Bootstrapping), or every told rank reported done or is fenced
            self.stats["released_at_once"] += 1
            return self._release(req)
        self.held_aborted_pages += len(req.pages)
        self.peak_held_aborted_pages = max(self.peak_held_aborted_pages, self.held_aborted_pages)
        req.abort_token = self.rng.getrandbits(63)
        self.send_aborts(req)
        if self.cfg.fence_unreachable_s is not None:
            self.health.watch_unacked(req)

    def _abortable(self, req: DecodeRequest) -> bool:
        return req.state in LIVE and self.current(req)

    def _must_ack(self, req: DecodeRequest) -> set[int]:
        """Ranks that may still write the pages: told, not reported done (a done rank drained), not fenced."""
        return {r for r in req.told - req.done_peers if req.incarnations[r] > self.fenced[r]}

    def send_aborts(self, req: DecodeRequest) -> None:
        req.resend_armed = False
        if not req.unacked or not self.current(req) or (req.quarantined and self.cfg.unsafe_terminal_quarantine):
            return
        backoff = self.cfg.abort_backoff
        if backoff.exhausted(req.sends) and not req.quarantined:
            self._give_up(req)
            if not self.current(req) or self.cfg.unsafe_terminal_quarantine:
                return  # freed at the bound (UNSAFE), or the old terminal quarantine (UNSAFE)
        registered = [r for r in sorted(req.unacked) if self.registry.serving(r) is not None]
        self.stats["paused_sends"] += len(req.unacked) - len(registered)
        if not registered:
            return  # every rank it waits for is down: resumed when one registers (or fenced)
        req.sends += 1
        for rank in registered:
            self.send_abort(req, rank)
        self.stats["abort_resends"] += req.sends > 1
        req.resend_armed = True
        self.loop.after(backoff.delay(req.sends, self.rng), self.send_aborts, req)

    def send_abort(self, req: DecodeRequest, rank: int) -> None:
        self.stats["abort_sends"] += 1
        self.send(rank, Abort(req.rid, req.room, req.abort_token, req.epoch, self.watermarks[rank].floor(), self.life))

    def _give_up(self, req: DecodeRequest) -> None:
        if self.cfg.unsafe_free_at_bound:  # UNSAFE: upstream's timeout path — a write may still land
            self.stats["quarantined_pages_freed"] += len(req.pages)
            return self._release(req)
        req.quarantined = True  # the pages stay held; re-sends go on at the cap, a late ack releases them
        self.stats["quarantines"] += 1
        log.warning("room %d: %d pages quarantined after %d abort sends; ranks %s have not acknowledged",
                    req.room, len(req.pages), req.sends, sorted(req.unacked))

    def _ack(self, ack: AbortAck) -> None:
        req = self.reqs.get(ack.room)
        if req is None or req.abort_token != ack.token or ack.peer not in req.unacked:
            self.stats["stale_acks"] += 1  # another abort's ack, a duplicate, an unknown room or a non-owner
            return
        if ack.incarnation < req.incarnations[ack.peer]:  # unacked <= told: the index is a told rank
            self.stats["non_owner"] += 1  # an older process than the one addressed cannot vouch for it
            return
        self.stats["acks"] += 1
        self.stats["acks_from_restarted_rank"] += ack.incarnation != req.incarnations[ack.peer]
        self.acked(req, ack.peer)

    def acked(self, req: DecodeRequest, rank: int) -> None:
        req.unacked.discard(rank)
        self._close(req, rank)
        if not req.unacked:  # every rank confirmed (or was fenced): its writes never started, all landed, or are refused
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
            self.releases.append((self.loop.now, req.room))
            if req.abort_token is not None and not self.cfg.legacy_immediate_release:
                self.held_aborted_pages -= len(req.pages)
        self._admit()

    def _close(self, req: DecodeRequest, rank: int) -> None:
        if rank in req.open_ranks:
            req.open_ranks.discard(rank)
            self.watermarks[rank].close(req.epoch)

    @property
    def quarantined_pages(self) -> int:
        return sum(len(r.pages) for r in self.reqs.values() if r.quarantined)
