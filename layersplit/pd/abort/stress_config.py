"""The configuration of the PD abort stress (:mod:`layersplit.pd.abort.stress`): workload, faults, topology."""

from __future__ import annotations

from dataclasses import dataclass, field

from layersplit.pd.abort.channel import ChannelFaults
from layersplit.pd.abort.decode_side import DecodeConfig
from layersplit.pd.abort.prefill_side import PrefillConfig
from layersplit.pd.abort.topology import PrefillTopology
from layersplit.pd.abort.transfer_engine import EngineFaults


@dataclass(frozen=True)
class PDStressConfig:
    requests: int = 1000
    seed: int = 0
    legacy_immediate_release: bool = False
    topology: PrefillTopology = PrefillTopology(((0, 1, 2, 3), (4, 5, 6, 7)))  # LayerSplit ownership, as data
    max_retries: int = 2  # the router retries an aborted request (same rid, new room)
    retry_backoff_s: float = 0.05
    mean_arrival_s: float = 0.015
    min_pages: int = 1
    max_pages: int = 8
    cancel: float = 0.03  # probability a client cancels a request (half of those are aborted twice)
    cancel_within_s: float = 1.5
    restart_mean_s: float | None = 60.0  # per rank, mean virtual time between crashes (None: never)
    restart_down_s: tuple[float, float] = (0.2, 1.5)
    kill: tuple[tuple[int, float], ...] = ()  # (rank, time): crash and never come back (a dead peer)
    partition: tuple[tuple[int, float, float], ...] = ()  # (rank, time, seconds): its control link is cut
    outage: tuple[tuple[int, float, float], ...] = ()  # (rank, time, seconds): crashed, restarted after (a reload)
    lease_loss: tuple[tuple[int, float, float], ...] = ()  # (rank, time, seconds): a live rank's lease expires,
    # it heartbeats again that much later (a false suspicion: fenced meanwhile if seconds > lease_s + fence_after_s)
    restart_decode: tuple[float, ...] = ()  # times the decode worker crashes and restarts (a new life)
    fresh_decode: tuple[float, ...] = ()  # times the decode process crashes and the OS starts a fresh one
    # (a new DecodeNode on the same registry and pages: its life is the registry's, as a restart's)
    misaddress: float = 0.0  # probability a prefill reply is also delivered naming another (or no) peer
    channel: ChannelFaults = field(default_factory=lambda: ChannelFaults(drop=0.05, duplicate=0.05))
    engine: EngineFaults = field(default_factory=lambda: EngineFaults(slow_write=0.02, error=0.02))
    prefill: PrefillConfig = field(default_factory=lambda: PrefillConfig(straggler=0.05))
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    until_s: float | None = None  # stop the clock here (None: run until no event is left)

    def __post_init__(self) -> None:
        if self.requests < 1:
            raise ValueError(f"requests: expected an integer >= 1, got {self.requests}")
        if not 0 <= self.cancel < 1:
            raise ValueError(f"cancel: expected a probability in [0, 1), got {self.cancel}")
        if self.restart_mean_s is not None and self.restart_mean_s <= 0:
            raise ValueError(f"restart_mean_s: expected seconds > 0 (or None: no restarts), got {self.restart_mean_s}")
        if not 0 <= self.misaddress < 1:
            raise ValueError(f"misaddress: expected a probability in [0, 1), got {self.misaddress}")
        for name in ("kill", "partition", "outage", "lease_loss"):
            for fault in getattr(self, name):
                if fault[0] not in self.topology.ranks:
                    raise ValueError(f"{name}: expected ranks in {self.topology.ranks}, got {fault[0]}")
                if any(v < 0 for v in fault[1:]):
                    raise ValueError(f"{name}: expected times and durations >= 0, got {fault}")
