"""The simulated PD cluster the abort stress drives: one decode worker and the prefill CP ranks of a
LayerSplit topology, wired through the faulty control channel, plus the router (retries) and the
injected faults — client cancels (some delivered twice), prefill restarts, dead ranks, partitions of
a rank's control link, long prefill outages (a model reload), decode restarts (in place, or a crash
after which a fresh decode process takes over the same registry and pages), misaddressed replies and
false suspicions (a live rank's lease expires: its heartbeat is starved or cut from the bootstrap server)."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import replace
from functools import partial
from typing import TYPE_CHECKING

from layersplit.pd.abort.bootstrap import BootstrapRegistry
from layersplit.pd.abort.channel import Channel, ControlChannel
from layersplit.pd.abort.decode_side import SUCCESS, DecodeNode, DecodeRequest
from layersplit.pd.abort.outages import OutageWatch
from layersplit.pd.abort.prefill_side import PrefillNode
from layersplit.pd.abort.sim import EventLoop
from layersplit.pd.abort.transfer_engine import TransferEngine

if TYPE_CHECKING:
    from layersplit.pd.abort.stress_config import PDStressConfig


class PDCluster:
    """The nodes, the channel, the bootstrap server and the router of one stress run."""

    def __init__(self, cfg: PDStressConfig, channel: Channel | None = None) -> None:
        """``channel``: the seeded faulty channel of ``cfg.channel`` by default; the model checker passes
        its own, whose deliveries and faults it chooses (the nodes are the same either way)."""
        self.cfg = cfg
        root = random.Random(cfg.seed)
        self.loop = EventLoop()
        channel_rng = random.Random(root.getrandbits(64))  # drawn either way: a seed's run never changes
        self.channel = channel if channel is not None else ControlChannel(self.loop, channel_rng, cfg.channel)
        self.registry = BootstrapRegistry(len(cfg.topology.ranks))
        self.rng = random.Random(root.getrandbits(64))
        self.fault_rng = random.Random(root.getrandbits(64))
        self.decode = self._new_decode(random.Random(root.getrandbits(64)))
        self.past_decodes: list[DecodeNode] = []  # decode processes that crashed (their counts stay reported)
        self.channel.register("decode", self._decode_receives)
        prefill_cfg = replace(cfg.prefill, compute_seed=cfg.seed)
        self.prefills: list[PrefillNode] = []
        for rank in cfg.topology.ranks:
            engine = TransferEngine(self.loop, random.Random(root.getrandbits(64)), self._land, cfg.engine)
            node = PrefillNode(rank, self.loop, prefill_cfg, engine,
                               partial(self._prefill_sends, rank),
                               cfg.topology, self.registry)
            node.on_late_reject = self._late_reject
            self.channel.register(f"prefill{rank}", node.handle)
            self.prefills.append(node)
        self.misaddress_rng = random.Random(root.getrandbits(64))  # drawn last: earlier streams unchanged
        self.rooms = 0  # request incarnations submitted (the last room number)
        self.attempts: dict[int, int] = {}
        self.outcomes: Counter[str] = Counter()  # per rid: success, cancelled, gave_up
        self.retries = 0
        self.latest: dict[int, DecodeRequest] = {}  # rid -> its latest incarnation (what a client cancels)
        self.partitioned: set[int] = set()  # ranks whose control link is cut
        self.stats = dict.fromkeys(("partition_dropped", "misaddressed_injected", "false_late_rejections",
                                    "leases_lost", "revoked_exits", "fresh_decodes"), 0)
        self.watch = OutageWatch(self)

    def _new_decode(self, rng: random.Random) -> DecodeNode:
        """A decode process: its life is the registry's next (``DecodeNode`` registers it)."""
        decode_cfg = replace(self.cfg.decode, legacy_immediate_release=self.cfg.legacy_immediate_release)
        return DecodeNode(self.loop, rng, decode_cfg, self._decode_sends, self.cfg.topology, self.registry,
                          self._finished, self._fence)

    # wiring (methods, not closures: the model checker copies a whole cluster) -------------------------
    def _decode_sends(self, rank: int, msg: object) -> None:
        if rank in self.partitioned:
            self.stats["partition_dropped"] += 1
            return
        self.channel.send("decode", f"prefill{rank}", msg)

    def _prefill_sends(self, rank: int, msg: object) -> None:
        if rank in self.partitioned:
            self.stats["partition_dropped"] += 1
            return
        self.channel.send(f"prefill{rank}", "decode", msg)
        if self.cfg.misaddress and self.misaddress_rng.random() < self.cfg.misaddress:
            self._misaddress(rank, msg)

    def _misaddress(self, rank: int, msg: object) -> None:
        """Also deliver ``msg`` naming another peer: half from ``rank``'s own link (a misaddressed
        reply), half naming a rank that owns nothing, from that rank's link (a misrouted one)."""
        self.stats["misaddressed_injected"] += 1
        ranks = len(self.prefills)
        if self.misaddress_rng.random() < 0.5 and ranks > 1:
            other = self.misaddress_rng.choice([r for r in range(ranks) if r != rank])
            self.channel.send(f"prefill{rank}", "decode", replace(msg, peer=other))
        else:
            self.channel.send(f"prefill{ranks}", "decode", replace(msg, peer=ranks))

    def _decode_receives(self, msg: object, src: str | None) -> None:
        self.decode.handle(msg, int(src[len("prefill"):]) if src else None)

    def _land(self, dest, tag, payload) -> None:
        self.decode.kv.land(dest, tag, payload)  # the decode life's current memory

    def _fence(self, rank: int, incarnation: int) -> None:
        """Decode fences ``rank`` up to ``incarnation``: the engine refuses those writes from now on. A fenced
        process still holding its lease (fenced as unreachable: only decode's link to it was cut) hears
        *revoked* at its next heartbeat and exits (``renew``); one whose heartbeats are starved hears it
        when they come back (``lose_lease`` scheduled that)."""
        node = self.prefills[rank]
        node.engine.fence(incarnation)
        if node.up and node.incarnation <= incarnation and self.registry.serving(rank) == node.incarnation:
            self.loop.after(node.cfg.heartbeat_s, self.renew, rank, node.incarnation)

    def _late_reject(self, rank: int, msg) -> None:
        """A prefill rank rejected a TransferRequest as late: false if decode still waits on it for that room."""
        req = self.decode.reqs.get(msg.room)
        if (msg.decode_life == self.decode.life and req is not None and req.epoch == msg.epoch
                and rank in req.open_ranks and req.state not in ("Failed", SUCCESS)):
            self.stats["false_late_rejections"] += 1

    # the router ----------------------------------------------------------------------------------------
    def submit(self, rid: int) -> None:
        self.rooms += 1
        self.attempts[rid] = self.attempts.get(rid, 0) + 1
        req = self.decode.submit(rid, self.rooms, self.rng.randint(self.cfg.min_pages, self.cfg.max_pages))
        self.latest[rid] = req
        if self.rng.random() < self.cfg.cancel:
            self.loop.after(self.rng.uniform(0, self.cfg.cancel_within_s), self.decode.abort, req)
            if self.rng.random() < 0.5:  # the client and the router both abort it
                self.loop.after(self.rng.uniform(0, self.cfg.cancel_within_s), self.decode.abort, req)

    def _finished(self, req: DecodeRequest) -> None:
        if req.state == SUCCESS:
            self.outcomes["success"] += 1
        elif req.abort_reason == "client":
            self.outcomes["cancelled"] += 1
        elif self.attempts[req.rid] <= self.cfg.max_retries:  # same rid, new room
            self.retries += 1
            self.loop.after(self.cfg.retry_backoff_s * self.attempts[req.rid], self.submit, req.rid)
        else:
            self.outcomes["gave_up"] += 1

    # injected faults -----------------------------------------------------------------------------------
    def lose_lease(self, rank: int, seconds: float = 0.0) -> None:
        """A false suspicion: ``rank``'s serving process is alive, but its lease expires (its heartbeats are
        starved — a GC pause, an overloaded host — or cut from the bootstrap server). Decode suspects it and,
        if it stays unregistered ``fence_after_s``, fences a *live* writer. The process heartbeats again
        ``seconds`` later (the checker: at any later moment)."""
        node = self.prefills[rank]
        if not node.up:
            return
        self.stats["leases_lost"] += 1
        self.registry.expire(rank, node.incarnation)
        self.loop.after(seconds, self.renew, rank, node.incarnation)

    def fresh_decode(self) -> None:
        """The decode process crashes and the OS starts a fresh one — a new ``DecodeNode``, not a
        ``restart``: it takes over the same registry and pages (the same memory, registered anew), and
        its life is the registry's, so what the dead life left in flight (writes, replies) is refused.
        The dead process's timers die with it; its lost requests are retried by the router."""
        old = self.decode
        old.crash()
        self.loop.drop_owned((old, old.health))
        self.past_decodes.append(old)
        self.decode = self._new_decode(random.Random(old.rng.getrandbits(64)))  # no other stream moves
        self.stats["fresh_decodes"] += 1

    def renew(self, rank: int, incarnation: int) -> None:
        """``incarnation``'s heartbeat reaches the bootstrap server again. Fenced meanwhile: the server
        answers *revoked* and the process exits; its supervisor starts a new incarnation (the real pair does
        exactly this: ``tools.pd_real.registry_link``). Not fenced: the lease is renewed and the rank serves."""
        node = self.prefills[rank]
        if not (node.up and node.incarnation == incarnation):
            return  # that process is gone: nothing heartbeats
        if self.registry.revoked[rank] >= incarnation:
            self.stats["revoked_exits"] += 1
            node.crash()
            self.loop.after(0.0, node.restart)
        else:
            self.registry.register(rank, incarnation)

    def schedule_faults(self, until: float) -> None:
        """Restarts of every rank while requests arrive (so the run still ends), the dead ranks, the
        partitions, the long outages and the decode restarts."""
        special = {rank for rank, _ in self.cfg.kill} | {f[0] for f in self.cfg.outage + self.cfg.partition
                                                          + self.cfg.lease_loss}
        for rank, at in self.cfg.kill:
            self.loop.after(at, self.prefills[rank].crash)
        for rank, at, seconds in self.cfg.partition:
            self.loop.after(at, self.partitioned.add, rank)
            self.loop.after(at + seconds, self.partitioned.discard, rank)
        for rank, at, seconds in self.cfg.outage:
            self.loop.after(at, self.prefills[rank].crash)
            self.loop.after(at + seconds, self.prefills[rank].restart)
        for at in self.cfg.restart_decode:
            self.loop.after(at, self._restart_decode)
        for at in self.cfg.fresh_decode:
            self.loop.after(at, self.fresh_decode)
        for rank, at, seconds in self.cfg.lease_loss:
            self.loop.after(at, self.lose_lease, rank, seconds)
        self.watch.schedule()
        if self.cfg.restart_mean_s:
            for node in self.prefills:
                if node.peer not in special:
                    self._schedule_restarts(node, until)

    def _restart_decode(self) -> None:
        self.decode.restart()  # whichever decode process serves then

    def _schedule_restarts(self, node: PrefillNode, until: float) -> None:
        t = self.fault_rng.expovariate(1.0 / self.cfg.restart_mean_s)
        while t < until:
            down = self.fault_rng.uniform(*self.cfg.restart_down_s)
            self.loop.after(t, node.crash)
            self.loop.after(t + down, node.restart)
            t += down + self.fault_rng.expovariate(1.0 / self.cfg.restart_mean_s)

    # end-of-run checks -----------------------------------------------------------------------------------
    def leaked_pages(self) -> int:
        """Decode pages neither free nor held by a request decode still tracks."""
        held = {p for r in self.decode.reqs.values() for p in r.pages}
        free = set(self.decode.kv.free_pages)
        return sum(1 for p in range(self.decode.kv.num_pages) if p not in held and p not in free)

    def prefill_leaked_pages(self) -> int:
        """Source pages of the live prefill processes that are allocated but held by no record."""
        leaked = 0
        for node in self.prefills:
            if node.alive:
                records = list(node.book.records.values()) + node.queue + list(node.orphans)
                held = {p for rec in records for p in rec.sources}
                leaked += sum(1 for p, tag in enumerate(node.kv.owner) if tag is not None and p not in held)
        return leaked
