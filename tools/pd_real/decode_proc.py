"""The decode worker as a real process: the protocol's :class:`~layersplit.pd.abort.decode_side.DecodeNode`, the
router of the stress (:class:`~layersplit.pd.abort.cluster.PDCluster`'s own ``submit`` / ``_finished``) and the
bootstrap registry, on a wall clock; its KV is real registered memory checked by the landing checker.

One process is one decode **life**, issued by the bootstrap registry when the process starts
(:class:`~tools.pd_real.registry_link.DurableRegistry`: above every life before, whoever started the
process). A life registers fresh memory (a new engine session), publishes its layout, then serves;
requests of a dead life are lost with it, and the next life submits again every request id that has no
final outcome in ``outcomes.jsonl`` (new rooms: ``life * ROOM_STRIDE + n``)."""

from __future__ import annotations

import json
import random
from collections import Counter
from dataclasses import replace

from layersplit.pd.abort.cluster import PDCluster
from layersplit.pd.abort.decode_side import DecodeNode
from tools.pd_real.process import Process
from layersplit.pd.abort.stress import percentiles

ROOM_STRIDE = 1_000_000  # rooms of one life; the landing checker stores a room in 32 bits


class RealDecodeNode(DecodeNode):
    """The protocol's decode node, unchanged, whose pages are decode's registered memory (a subclass only
    to put :class:`~tools.pd_real.landing_kv.RealDecodeKV` where the node keeps its KV)."""

    def __init__(self, memory, *args, **kwargs) -> None:
        self.memory = memory
        super().__init__(*args, **kwargs)

    def _new_life(self) -> None:
        from tools.pd_real.landing_kv import RealDecodeKV

        assert self.life == self.memory.life, f"life {self.life}: the memory is life {self.memory.life}'s"
        super()._new_life()
        self.kv = RealDecodeKV(self.memory, self.topology.num_layers, self.life)


class Router:
    """The stress's router (retries, client cancels), borrowed from :class:`PDCluster`, not re-written."""

    submit = PDCluster.submit
    _finished = PDCluster._finished
    leaked_pages = PDCluster.leaked_pages

    def __init__(self, cfg, loop, rng: random.Random, room_base: int, log) -> None:
        self.cfg, self.loop, self.rng, self.log = cfg, loop, rng, log
        self.decode: DecodeNode | None = None
        self.rooms, self.attempts, self.outcomes, self.retries, self.latest = room_base, {}, Counter(), 0, {}
        self.final: set[int] = set()
        self.last_outcome_s = 0.0

    def finished(self, req) -> None:
        before = sum(self.outcomes.values())
        self._finished(req)
        if sum(self.outcomes.values()) != before:  # a final outcome (not a retry)
            self.final.add(req.rid)
            self.last_outcome_s = self.loop.now
            self.log.write(json.dumps({"rid": req.rid, "room": req.room, "state": req.state,
                                       "reason": req.abort_reason, "at_s": round(self.loop.now, 4)}) + "\n")
            self.log.flush()


class DecodeProcess(Process):
    def __init__(self, run_dir, name: str) -> None:
        super().__init__(run_dir, name)
        from tools.pd_real.engine import open_engine
        from tools.pd_real.mooncake_engine import DecodeMemory
        from layersplit.pd.abort.messages import AbortAck, TransferDone, TransferFailed, TransferStarted
        from tools.pd_real.registry_link import DurableRegistry, Heartbeat, RegistryServer

        cfg = self.run.stress
        self.registry = DurableRegistry(len(cfg.topology.ranks), run_dir)
        self.life = self.registry.register_decode()  # first: the memory, its layout and the rooms are the life's
        engine, session = open_engine()
        self.memory = DecodeMemory(engine, session, self.life, cfg.decode.num_pages, self.run.page_bytes,
                                   cfg.topology.layers_by_rank,
                                   refuse_fenced="fence-refuses-writes" not in self.run.guards_off)
        self.memory.layout().save(run_dir / f"layout-{self.life}.json")
        root = random.Random(cfg.seed * 1009 + self.life)
        outcomes = run_dir / "outcomes.jsonl"
        done = {json.loads(line)["rid"] for line in outcomes.read_text().splitlines()} if outcomes.exists() else set()
        self.pending = [rid for rid in range(cfg.requests) if rid not in done]
        self.router = Router(cfg, self.loop, random.Random(root.getrandbits(64)), self.life * ROOM_STRIDE,
                             outcomes.open("a"))
        decode_cfg = replace(cfg.decode, legacy_immediate_release=cfg.legacy_immediate_release)
        self.node = RealDecodeNode(self.memory, self.loop, random.Random(root.getrandbits(64)), decode_cfg,
                                   self._send, cfg.topology, self.registry, self.router.finished,
                                   self.memory.fence, life=self.life)
        self.router.decode = self.node
        self.server = RegistryServer(self.loop, self.registry, self.memory, cfg.prefill.lease_s,
                                     lambda rank, msg: self.channel.send("bootstrap", f"bootstrap{rank}", msg))
        prefills = [f"prefill{r}" for r in cfg.topology.ranks]
        self.channel.register("decode", lambda msg, src: self.node.handle(msg, int(src[len("prefill"):])),
                              accepts=(TransferStarted, TransferDone, TransferFailed, AbortAck), senders=prefills)
        self.channel.register("bootstrap", self.server.handle, accepts=(Heartbeat,), senders=prefills)
        t = 0.0
        for rid in self.pending:
            t += self.router.rng.expovariate(1.0 / cfg.mean_arrival_s)
            self.loop.after(t, self.router.submit, rid)
        self.last_arrival_s = t
        self.loop.after(self.run.scan_s, self._scan)

    def _send(self, rank: int, msg: object) -> None:
        self.channel.send("decode", f"prefill{rank}", msg)

    def _scan(self) -> None:
        self.node.kv.scan()
        self.loop.after(self.run.scan_s, self._scan)

    def complete(self) -> bool:
        """Every request id of this life reached its outcome and no page is held (or the drain ran out)."""
        if len(self.router.final) < len(self.pending):
            return False
        return not self.node.reqs or self.loop.now - self.router.last_outcome_s > self.run.drain_s

    def main(self) -> int:
        self.ready()
        rc = self.serve(stop=self.complete)
        (self.run_dir / f"done-{self.name}").write_text("1")
        return rc

    def report(self) -> dict:
        d = self.node
        d.kv.scan()
        return {"role": "decode", "life": self.life, "pending_at_start": len(self.pending),
                "final_outcomes": len(self.router.final), "outcomes": dict(self.router.outcomes),
                "retries": self.router.retries, "stats": d.stats, "checks": d.kv.checks,
                "overwrite_log": d.kv.overwrite_log, "bad_frees": len(d.kv.bad_frees),
                "abort_to_release_s": percentiles(d.release_latencies), "release_latencies": d.release_latencies,
                "leaked_pages": self.router.leaked_pages(), "requests_still_held": len(d.reqs),
                "pages_held_at_end": sum(len(r.pages) for r in d.reqs.values()),
                "quarantined_pages_at_end": d.quarantined_pages, "peak_held_aborted_pages": d.peak_held_aborted_pages,
                "fences": d.fences, "memory": self.memory.stats, "registry": self.server.stats,
                "aborts_by_reason": dict(d.abort_reasons), "channel": self.channel.stats, "loop": self.loop.stats,
                "last_arrival_s": self.last_arrival_s, "last_outcome_s": self.router.last_outcome_s,
                "now_s": self.loop.now}
