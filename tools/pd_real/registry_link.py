"""The bootstrap registry between real processes: leases by heartbeat, and the fence on re-admission.

The :class:`~layersplit.pd.abort.bootstrap.BootstrapRegistry` itself lives in the decode process (SGLang's
bootstrap server is reliable — HTTP — so its link bypasses the control plane's fault proxy). A prefill
process's :class:`RegistryClient` is the registry its :class:`~layersplit.pd.abort.prefill_side.PrefillNode` sees:
``register`` starts the heartbeats of that incarnation. Decode's :class:`RegistryServer` turns them into
the registry's changes:

* a heartbeat of the serving incarnation renews its lease; none for ``lease_s``: the lease ``expire``s
  (decode's health then fences the rank if it stays down ``fence_after_s``);
* a heartbeat of a **newer** incarnation: the old process is dead and reaped (the supervisor starts a
  new incarnation only then), so decode fences the old one by address and registers the rank's regions
  again (:meth:`~tools.pd_real.mooncake_engine.DecodeMemory.readmit`) *before* the registry shows the
  new incarnation serving — nothing the old process left in flight can land after that;
* a heartbeat of a fenced (revoked) incarnation — a process decode wrongly took for dead, e.g. starved
  past its lease — is answered :class:`Revoked`: that process must exit and come back as a new one.

Decode's own life comes from the registry too (:meth:`~layersplit.pd.abort.bootstrap.BootstrapRegistry.register_decode`).
The registry object dies with the decode process that hosts it, so :class:`DurableRegistry` keeps the
lives it issued in a file of the run directory: a decode process started by anyone — the supervisor, or
the OS after a crash — registers a life above every one before it.
"""

from __future__ import annotations

import fcntl
import os
from dataclasses import dataclass
from pathlib import Path

from layersplit.pd.abort.bootstrap import BootstrapRegistry


@dataclass(frozen=True)
class Heartbeat:
    rank: int
    incarnation: int


@dataclass(frozen=True)
class Revoked:
    rank: int
    incarnation: int


class RegistryClient:
    """Prefill's view of the registry: ``register`` (the node serves) starts heartbeats every ``period_s``."""

    def __init__(self, loop, channel, endpoint: str, num_ranks: int, period_s: float) -> None:
        self.loop, self.channel, self.endpoint, self.period_s = loop, channel, endpoint, period_s
        self.revoked = [-1] * num_ranks  # the supervisor numbers incarnations: a new one is above any fenced
        self.rank: int | None = None
        self.incarnation: int | None = None

    def register(self, rank: int, incarnation: int) -> None:
        beating = self.incarnation is not None
        self.rank, self.incarnation = rank, incarnation
        if not beating:
            self.loop.after(0, self._beat)

    def _beat(self) -> None:
        self.channel.send(self.endpoint, "bootstrap", Heartbeat(self.rank, self.incarnation))
        self.loop.after(self.period_s, self._beat)


class RegistryServer:
    def __init__(self, loop, registry, memory, lease_s: float, send) -> None:
        """``send(rank, msg)`` reaches a prefill rank's process directly (the bootstrap link)."""
        self.loop, self.registry, self.memory, self.lease_s, self.send = loop, registry, memory, lease_s, send
        self.last: dict[int, tuple[int, float]] = {}  # rank -> (incarnation, last heartbeat time)
        self.admitted: dict[int, int] = {}  # rank -> newest incarnation admitted
        self.stats = {"heartbeats": 0, "admissions": 0, "readmissions": 0, "expiries": 0, "revoked_sent": 0,
                      "misaddressed": 0}
        self.loop.after(lease_s / 4, self._check_leases)

    def handle(self, msg: Heartbeat, src: str | None = None) -> None:
        rank, inc = msg.rank, msg.incarnation
        self.stats["heartbeats"] += 1
        if not 0 <= rank < len(self.registry.revoked) or src not in (None, f"prefill{rank}"):
            self.stats["misaddressed"] += 1  # a heartbeat names the rank whose endpoint sent it, or is ignored
            return
        if inc <= self.registry.revoked[rank]:
            self.stats["revoked_sent"] += 1
            return self.send(rank, Revoked(rank, inc))
        newest = self.admitted.get(rank, -1)
        if inc < newest:
            return  # an older process's heartbeat, delivered late
        self.last[rank] = (inc, self.loop.now)
        if inc > newest:
            if newest >= 0:  # a predecessor of this decode life's view existed: flush it by address
                self.memory.readmit(rank, inc)
                self.stats["readmissions"] += 1
            self.admitted[rank] = inc
            self.stats["admissions"] += 1
        if self.registry.serving(rank) != inc:
            self.registry.register(rank, inc)  # a new process, or one whose lease had expired

    def _check_leases(self) -> None:
        now = self.loop.now
        for rank, (inc, at) in self.last.items():
            if self.registry.serving(rank) == inc and now - at > self.lease_s:
                self.stats["expiries"] += 1
                self.registry.expire(rank, inc)
        self.loop.after(self.lease_s / 4, self._check_leases)


class DurableRegistry(BootstrapRegistry):
    """The registry a decode process hosts, whose decode lives outlive it: the newest life issued to each
    worker is kept in ``directory/decode-life-WORKER`` (written by atomic rename, under a lock, so two
    processes starting at once still get different lives and a crash mid-write loses nothing)."""

    def __init__(self, num_ranks: int, directory: Path) -> None:
        super().__init__(num_ranks)
        self.directory = directory

    def register_decode(self, worker: str = "decode") -> int:
        path = self.directory / f"decode-life-{worker}"
        with open(path.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes (or the process dies)
            life = self._read(path, -1) + 1
            tmp = path.with_suffix(".tmp")
            tmp.write_text(str(life))
            os.replace(tmp, path)
        return life

    def decode_life(self, worker: str = "decode") -> int | None:
        return self._read(self.directory / f"decode-life-{worker}", None)

    @staticmethod
    def _read(path: Path, default: int | None) -> int | None:
        return int(path.read_text()) if path.exists() else default
