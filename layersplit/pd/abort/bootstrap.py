"""The bootstrap server (SGLang's ``bootstrap_host``): which incarnation of each prefill rank is
serving. Decode resolves it while a request is **Bootstrapping**; the TransferRequests it then sends
are addressed to those incarnations. Reliable (HTTP in SGLang), unlike the control channel.

It is also the failure detector's source: a serving process holds a **lease** it renews by heartbeat.
A process that dies stops renewing, so the registry still shows it serving — *stale* — until the lease
expires (``expire``, ``lease_s`` after the crash). Watchers (decode) hear every change: a rank that
registers again (resume the abort re-sends), a lease that expired (suspect the rank; fence it if it
stays down). ``revoke`` records a fenced incarnation: that rank may only come back as a newer one.

It also numbers the decode worker's **lives**: ``register_decode`` issues each decode process (a fresh one
as well as a restart) a life strictly greater than any issued before. The number lives here, not in the
process, so a process the OS starts anew after a crash cannot reuse its predecessor's life: prefill and
the new memory registration refuse what the old life left in flight.
"""

from __future__ import annotations

from typing import Callable


class BootstrapRegistry:
    def __init__(self, num_ranks: int) -> None:
        self._serving: list[int | None] = [None] * num_ranks
        self.revoked: list[int] = [-1] * num_ranks  # per rank: the highest fenced incarnation
        self._watchers: list[Callable[..., None]] = []
        self._decode_lives: dict[str, int] = {}  # decode worker -> the newest life issued

    def watch(self, fn: Callable[..., None]) -> None:
        """Call ``fn(rank, incarnation)`` on every registration and ``fn(rank, None, expired)`` on every
        expiry (``expired``: the incarnation whose lease ran out)."""
        self._watchers.append(fn)

    def unwatch(self, fn: Callable[..., None]) -> None:
        """A watcher's process died: it hears nothing more."""
        self._watchers.remove(fn)

    def register_decode(self, worker: str = "decode") -> int:
        """A decode process of ``worker`` starts: its life, above every life issued to ``worker`` before."""
        life = self._decode_lives.get(worker, -1) + 1
        self._decode_lives[worker] = life
        return life

    def decode_life(self, worker: str = "decode") -> int | None:
        """The newest life issued to ``worker`` (None: none yet)."""
        return self._decode_lives.get(worker)

    def register(self, rank: int, incarnation: int) -> None:
        assert incarnation > self.revoked[rank], f"rank {rank}: incarnation {incarnation} was fenced"
        self._serving[rank] = incarnation
        self._notify(rank, incarnation)

    def expire(self, rank: int, incarnation: int) -> None:
        """The lease of ``incarnation`` ran out (a no-op if the rank has registered a newer one since)."""
        if self._serving[rank] == incarnation:
            self._serving[rank] = None
            self._notify(rank, None, incarnation)

    def unregister(self, rank: int) -> None:
        """A clean shutdown: the lease is given up at once."""
        if self._serving[rank] is not None:
            self.expire(rank, self._serving[rank])

    def revoke(self, rank: int, incarnation: int) -> None:
        """Fence ``rank``'s processes up to ``incarnation``: none of them may serve again. A revoked process
        that still holds its lease (decode fenced it as unreachable) is no longer shown serving: nobody
        resolves it any more, and its next heartbeat is answered *revoked* (it exits)."""
        self.revoked[rank] = max(self.revoked[rank], incarnation)
        if self._serving[rank] is not None and self._serving[rank] <= incarnation:
            self._serving[rank] = None

    def serving(self, rank: int) -> int | None:
        return self._serving[rank]

    def resolve(self, ranks: tuple[int, ...]) -> tuple[int, ...] | None:
        """The serving incarnation of each rank, or None while any of them is down."""
        found = tuple(self._serving[r] for r in ranks)
        return None if None in found else found

    def _notify(self, rank: int, *change) -> None:
        for fn in self._watchers:
            fn(rank, *change)
