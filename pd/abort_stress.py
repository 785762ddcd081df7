"""PD abort stress: abort storms over a faulty control channel and a transfer engine whose writes
cannot be cancelled, with the safe-release protocol on (default) or the legacy immediate release.

Checks: (1) the invariant checker — every landing write must hit a page whose current
(owner, generation) is the writer's; (2) a checksum of every successful request's KV when decode
starts; (3) a final leak check — every page is free or held by a request decode still tracks.
All randomness comes from one seed; the run is a discrete-event simulation (virtual time).
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field

from pd.channel import ChannelFaults, ControlChannel
from pd.decode_side import FAILED, DecodeConfig, DecodeNode, DecodeRequest
from pd.prefill_side import PrefillConfig, PrefillNode
from pd.sim import EventLoop
from pd.transfer_engine import EngineFaults, TransferEngine


@dataclass(frozen=True)
class PDStressConfig:
    requests: int = 1000
    seed: int = 0
    legacy_immediate_release: bool = False
    prefill_peers: int = 2  # each request's KV comes from this many prefill workers
    max_retries: int = 2  # the router retries an aborted request (same rid, new room)
    retry_backoff_s: float = 0.05
    mean_arrival_s: float = 0.015
    min_pages: int = 1
    max_pages: int = 8
    channel: ChannelFaults = field(default_factory=lambda: ChannelFaults(drop=0.05, duplicate=0.05))
    engine: EngineFaults = field(default_factory=lambda: EngineFaults(slow_write=0.02, error=0.02))
    prefill: PrefillConfig = field(default_factory=lambda: PrefillConfig(straggler=0.05))
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    until_s: float | None = None  # stop the clock here (None: run until no event is left)


class PDCluster:
    """One decode worker and ``prefill_peers`` prefill workers wired through the faulty channel."""

    def __init__(self, cfg: PDStressConfig) -> None:
        self.cfg = cfg
        root = random.Random(cfg.seed)
        self.loop = EventLoop()
        self.channel = ControlChannel(self.loop, random.Random(root.getrandbits(64)), cfg.channel)
        decode_cfg = DecodeConfig(**{**asdict(cfg.decode), "legacy_immediate_release": cfg.legacy_immediate_release})
        self.rng = random.Random(root.getrandbits(64))
        self.decode = DecodeNode(self.loop, random.Random(root.getrandbits(64)), decode_cfg,
                                 lambda peer, msg: self.channel.send("decode", f"prefill{peer}", msg),
                                 lambda rid: tuple(range(cfg.prefill_peers)), self._finished)
        self.channel.register("decode", self.decode.handle)
        self.prefills = []
        for k in range(cfg.prefill_peers):
            engine = TransferEngine(self.loop, random.Random(root.getrandbits(64)), self.decode.kv.land, cfg.engine)
            node = PrefillNode(k, self.loop, random.Random(root.getrandbits(64)), cfg.prefill, engine,
                               lambda msg, k=k: self.channel.send(f"prefill{k}", "decode", msg))
            self.channel.register(f"prefill{k}", node.handle)
            self.prefills.append(node)
        self._room = 0
        self.attempts: dict[int, int] = {}
        self.retries = 0

    def submit(self, rid: int) -> None:
        self._room += 1
        self.attempts[rid] = self.attempts.get(rid, 0) + 1
        self.decode.submit(rid, self._room, self.rng.randint(self.cfg.min_pages, self.cfg.max_pages))

    def _finished(self, req: DecodeRequest) -> None:
        if req.state == FAILED and self.attempts[req.rid] <= self.cfg.max_retries:
            self.retries += 1
            self.loop.after(self.cfg.retry_backoff_s * self.attempts[req.rid], self.submit, req.rid)

    def leaked_pages(self) -> int:
        held = {p for r in self.decode.reqs.values() for p in r.pages}
        free = set(self.decode.kv.free_pages)
        return sum(1 for p in range(self.cfg.decode.num_pages) if p not in held and p not in free)


def run_pd_stress(cfg: PDStressConfig) -> dict:
    """Run the storm; returns the report (counts only, JSON-ready)."""
    cluster = PDCluster(cfg)
    t = 0.0
    for rid in range(cfg.requests):
        t += cluster.rng.expovariate(1.0 / cfg.mean_arrival_s)
        cluster.loop.after(t, cluster.submit, rid)
    cluster.loop.run(cfg.until_s)
    d = cluster.decode
    return {
        "requests": cfg.requests, "seed": cfg.seed, "legacy_immediate_release": cfg.legacy_immediate_release,
        "incarnations": cluster._room, "retries": cluster.retries, "success": d.stats["success"],
        "aborts": d.stats["aborts"], "abort_sends": d.stats["abort_sends"],
        "abort_resends": d.stats["abort_sends"] - d.stats["aborts"] * cfg.prefill_peers * (not cfg.legacy_immediate_release),
        "acks": d.stats["acks"],
        "stale_acks_ignored": d.stats["stale_acks"], "late_messages_ignored": d.stats["late_messages"],
        "late_transfers_rejected": sum(p.stats["rejected_late"] for p in cluster.prefills),
        "quarantines": d.stats["quarantines"], "quarantined_pages_at_end": d.quarantined_pages,
        "overwrites": len(d.kv.overwrites), "checksum_mismatches": d.stats["checksum_mismatches"],
        "leaked_pages": cluster.leaked_pages(), "requests_still_held": len(d.reqs),
        "channel": dict(cluster.channel.stats),
        "engine": {k: sum(p.engine.stats[k] for p in cluster.prefills) for k in ("batches", "writes", "errors")},
        "sim_seconds": cluster.loop.now,
    }
