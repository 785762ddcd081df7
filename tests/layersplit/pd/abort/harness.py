"""A scripted PD cluster for the protocol tests: one decode node and the prefill ranks of a topology,
fixed delays on a quiet channel, taps on every message and every landing write."""

from __future__ import annotations

import random

from layersplit.pd.abort.bootstrap import BootstrapRegistry
from layersplit.pd.abort.channel import ChannelFaults, ControlChannel
from layersplit.pd.abort.decode_side import DecodeConfig, DecodeNode
from layersplit.pd.abort.prefill_side import PrefillConfig, PrefillNode
from layersplit.pd.abort.sim import EventLoop
from layersplit.pd.abort.topology import PrefillTopology
from layersplit.pd.abort.transfer_engine import EngineFaults, TransferEngine

FIXED_WRITE = EngineFaults(min_write_s=0.01, max_write_s=0.01)


class Harness:
    def __init__(self, topology: PrefillTopology = PrefillTopology(((0,),)), engine: EngineFaults = FIXED_WRITE,
                 prefill: PrefillConfig = PrefillConfig(min_compute_s=0.1, max_compute_s=0.1),
                 decode: DecodeConfig = DecodeConfig(num_pages=8, wait_timeout_s=1.0),
                 channel: ChannelFaults = ChannelFaults(min_delay_s=0.001, max_delay_s=0.001),
                 engine_for_rank: dict[int, EngineFaults] | None = None) -> None:
        self.loop = EventLoop()
        self.channel = ControlChannel(self.loop, random.Random(0), channel)
        self.registry = BootstrapRegistry(len(topology.ranks))
        self.finished, self.landed, self.to_decode, self.to_prefill = [], [], [], []
        self.decode = DecodeNode(self.loop, random.Random(1), decode, self._from_decode, topology, self.registry,
                                 self.finished.append, self._fence)
        self.channel.register("decode", self._to_decode)
        self.prefills, self.engines = [], []
        for rank in topology.ranks:
            faults = (engine_for_rank or {}).get(rank, engine)
            eng = TransferEngine(self.loop, random.Random(2 + rank), lambda d, t, p, r=rank: self._land(r, d, t, p), faults)
            node = PrefillNode(rank, self.loop, prefill, eng,
                               lambda msg, r=rank: self.channel.send(f"prefill{r}", "decode", msg), topology, self.registry)
            self.channel.register(f"prefill{rank}", node.handle)
            self.prefills.append(node)
            self.engines.append(eng)

    @property
    def prefill(self) -> PrefillNode:
        return self.prefills[0]

    def _from_decode(self, rank: int, msg: object) -> None:
        self.to_prefill.append((self.loop.now, rank, msg))
        self.channel.send("decode", f"prefill{rank}", msg)

    def _land(self, rank: int, dest, tag, payload) -> None:
        self.landed.append((self.loop.now, rank, dest, tag))
        self.decode.kv.land(dest, tag, payload)  # the current decode life's memory

    def _fence(self, rank: int, incarnation: int) -> None:
        self.engines[rank].fence(incarnation)

    def _to_decode(self, msg: object, src: str | None = None) -> None:
        self.to_decode.append((self.loop.now, msg))
        self.decode.handle(msg, int(src[len("prefill"):]) if src else None)

    def sent(self, kind: type, rank: int | None = None) -> list:
        """Messages of ``kind`` decode sent (to ``rank``), in order."""
        return [m for _, r, m in self.to_prefill if isinstance(m, kind) and rank in (None, r)]

    def received(self, kind: type) -> list:
        """(time, message) of ``kind`` that reached decode."""
        return [(t, m) for t, m in self.to_decode if isinstance(m, kind)]

    def close_epoch_zero(self) -> list:
        """Two rooms, the first finished (epoch 0 closed) and the second's request carrying floor 1 to
        prefill; returns the rooms prefill rejects as late from here on."""
        rejected = []
        self.prefill.on_late_reject = lambda rank, msg: rejected.append(msg.room)
        self.decode.submit(rid=1, room=1, n_pages=1)
        self.loop.run(until=0.6)  # room 1 done and finished: epoch 0 closed
        self.decode.submit(rid=2, room=2, n_pages=1)  # its TransferRequest carries floor 1 to prefill
        self.loop.run(until=0.7)
        assert self.prefill.book.floor == 1
        return rejected
