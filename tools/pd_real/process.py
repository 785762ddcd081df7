"""What every process of the real pair shares (:mod:`tools.pd_real.node` starts them): the run's
configuration (:class:`RealRun`), its files, the wall-clock loop, the ZMQ channel, the stop signal and
the stats snapshots (see :mod:`tools.pd_real.node` for the files each process writes)."""

from __future__ import annotations

import json
import os
import pickle
import signal
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path

from layersplit.pd.abort.stress_config import PDStressConfig


@dataclass(frozen=True)
class RealRun:
    """What every process of one real storm shares."""

    stress: PDStressConfig  # workload, topology, decode / prefill configuration (the simulation's)
    page_bytes: int = 16384
    snapshot_s: float = 0.5
    scan_s: float = 0.5  # decode: check the free pages for late writes this often
    heartbeat_s: float = 0.25
    drain_s: float = 20.0  # decode: after the last outcome, wait this long for held pages
    guards_off: tuple[str, ...] = ()  # UNSAFE: of REAL_GUARDS only (the storm then shows what the guard closes)

    def __post_init__(self) -> None:
        for name in self.guards_off:
            if name not in REAL_GUARDS:
                raise ValueError(f"guards_off: expected some of {', '.join(REAL_GUARDS)} on the real pair "
                                 f"(the others are simulation-only), got {name!r}")
        object.__setattr__(self, "guards_off", tuple(self.guards_off))


# the guards the real pair can switch off: decode's fence by deregistration (a real transfer engine refuses
# a fenced writer only that way; see tools.pd_real.mooncake_engine)
REAL_GUARDS = ("fence-refuses-writes",)


def write_json(path: Path, obj) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, default=_plain))
    os.replace(tmp, path)


def _plain(obj):
    if isinstance(obj, (set, frozenset, tuple)):
        return list(obj)
    raise TypeError(f"not JSON: {type(obj).__name__}")


class Process(ABC):
    """What both roles share: the run's files, the loop, the channel, the stop flag, the snapshots."""

    def __init__(self, run_dir: Path, name: str) -> None:
        from tools.pd_real.wall_loop import WallLoop
        from tools.pd_real.zmq_channel import ZmqChannel

        self.run_dir, self.name = run_dir, name
        # pickle only here: the supervisor (storm.py) wrote this file for its own children, and no socket
        # reaches it (control frames are tools.pd_real.wire's msgpack). It trusts the run dir as it trusts
        # the checkout: one other users can write (an --out DIR of theirs) is no place for a run.
        self.run: RealRun = pickle.loads((run_dir / "config.pkl").read_bytes())  # noqa: S301 - our own file
        self.me = json.loads((run_dir / f"{name}.json").read_text())
        self.loop = WallLoop()
        self.channel = ZmqChannel(self.me["addresses"], self.me["local"])
        self.loop.add_source(self.channel.socket, lambda: self.channel.pump(0))
        self.stopping = False
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._stop)

    def _stop(self, *_) -> None:
        self.stopping = True

    def ready(self) -> None:
        (self.run_dir / f"ready-{self.name}").write_text(str(os.getpid()))

    def snapshot_every(self, seconds: float) -> None:
        write_json(self.run_dir / f"{self.name}.stats.json", self.report())
        self.loop.after(seconds, self.snapshot_every, seconds)

    @abstractmethod
    def report(self) -> dict:
        """This process's stats, JSON-ready (what each snapshot writes)."""

    def serve(self, stop=lambda: False, stop_on_signal: bool = True) -> int:
        """Run until ``stop()`` (and, with ``stop_on_signal``, until SIGTERM / SIGINT); final stats."""
        self.snapshot_every(self.run.snapshot_s)
        self.loop.run(stop=lambda: (self.stopping and stop_on_signal) or stop())
        write_json(self.run_dir / f"{self.name}.stats.json", {**self.report(), "final": True})
        return 0
