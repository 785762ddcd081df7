"""One prefill CP rank as a real process: the protocol's :class:`~layersplit.pd.abort.prefill_side.PrefillNode`,
unchanged, writing through Mooncake (:class:`~tools.pd_real.mooncake_engine.MooncakeEngine`).

A process is one *incarnation*, numbered by the supervisor (which starts incarnation ``k`` only after
it reaped ``k - 1``). Incarnation 0 is the node as constructed; a later one is started through the
node's own ``restart`` (fresh state, serves once the writes of its previous lives drained — here its
own engine has none: what the dead process left in flight is fenced by decode, by address, when this
one registers; see :mod:`tools.pd_real.registry_link`)."""

from __future__ import annotations

from dataclasses import replace

from tools.pd_real.process import Process

DRAIN_S = 5.0  # longer than the longest forward (PrefillConfig.straggler_s)


class PrefillProcess(Process):
    def __init__(self, run_dir, name: str) -> None:
        super().__init__(run_dir, name)
        from layersplit.pd.abort.messages import Abort, TransferRequest
        from layersplit.pd.abort.prefill_side import PrefillNode
        from tools.pd_real.engine import open_engine
        from tools.pd_real.mooncake_engine import MooncakeEngine
        from tools.pd_real.registry_link import RegistryClient, Revoked

        cfg = self.run.stress
        self.rank, self.incarnation, self.endpoint = self.me["rank"], self.me["incarnation"], self.me["endpoint"]
        self._layouts: dict[int, object] = {}
        engine, _ = open_engine()
        self.engine = MooncakeEngine(self.loop, engine, self._layout, cfg.prefill.source_pages, self.run.page_bytes,
                                     on_timeout=self._timed_out)
        self.exit_code = 0  # 3: decode fenced this process; 4: a batch timed out (both: come back as a new one)
        self.registry = RegistryClient(self.loop, self.channel, self.endpoint, len(cfg.topology.ranks),
                                       self.run.heartbeat_s)
        self.node = PrefillNode(self.rank, self.loop, replace(cfg.prefill, compute_seed=cfg.seed), self.engine,
                                self._send, cfg.topology, self.registry)
        if self.incarnation > 0:  # a new process of the rank: the protocol's own restart path
            self.node.alive, self.node.incarnation = False, self.incarnation - 1
            self.node.restart()
        assert self.node.incarnation == self.incarnation, (self.node.incarnation, self.incarnation)
        self.must_exit = False
        self.channel.register(self.endpoint, self.node.handle, accepts=(TransferRequest, Abort), senders=("decode",))
        self.channel.register(f"bootstrap{self.rank}", self._bootstrap, accepts=(Revoked,), senders=("bootstrap",))

    def _send(self, msg: object) -> None:
        self.channel.send(self.endpoint, "decode", msg)

    def _bootstrap(self, msg, src=None) -> None:
        from tools.pd_real.registry_link import Revoked

        assert isinstance(msg, Revoked), msg
        if msg.incarnation == self.incarnation:
            self.must_exit, self.exit_code = True, 3  # decode fenced this process: exit, a new one starts

    def _timed_out(self, batch: int) -> None:
        """A batch may still be landing and nothing will say when it stops: only this process's death
        (and decode's fence by address when its successor registers) ends it."""
        self.must_exit, self.exit_code = True, 4

    def _layout(self, life: int):
        """Decode life ``life``'s session and regions (published before it sent anything)."""
        if life not in self._layouts:
            from tools.pd_real.mooncake_engine import DecodeLayout

            path = self.run_dir / f"layout-{life}.json"
            if not path.exists():
                return None
            self._layouts[life] = DecodeLayout.load(path)
        return self._layouts[life]

    def _settled(self) -> bool:
        """Asked to stop: wait (at most ``DRAIN_S``) until no write is in flight and no source page is
        allocated — an aborted request's forward may still be running — so what is left is a leak."""
        if self.must_exit:
            return True
        if not self.stopping:
            return False
        self._stop_at = getattr(self, "_stop_at", None) or self.loop.now
        idle = not self.engine.in_flight(lambda owner: True) and all(t is None for t in self.node.kv.owner)
        return idle or self.loop.now - self._stop_at > DRAIN_S

    def main(self) -> int:
        self.ready()
        rc = self.serve(stop=self._settled, stop_on_signal=False)
        self.engine.close()
        return self.exit_code or rc

    def report(self) -> dict:
        node = self.node
        records = list(node.book.records.values()) + node.queue + list(node.orphans)
        held = {p for rec in records for p in rec.sources}
        return {"role": "prefill", "rank": self.rank, "incarnation": self.incarnation, "serving": node.up,
                "must_exit": self.must_exit, "exit_code": self.exit_code, "stats": node.stats,
                "engine": self.engine.stats,
                "in_flight": self.engine.in_flight(lambda owner: True),
                "source_stale_reads": len(node.kv.stale_reads), "bad_frees": len(node.kv.bad_frees),
                "prefill_leaked_pages": sum(1 for p, tag in enumerate(node.kv.owner)
                                            if tag is not None and p not in held),
                "source_pages_allocated": sum(t is not None for t in node.kv.owner), "records": len(node.book.records), "peak_records": node.peak_records,
                "channel": self.channel.stats, "loop": self.loop.stats, "now_s": self.loop.now}
