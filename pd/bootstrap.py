"""The bootstrap server (SGLang's ``bootstrap_host``): which incarnation of each prefill rank is
serving. Decode resolves it while a request is **Bootstrapping**; the TransferRequests it then sends
are addressed to those incarnations. Reliable (HTTP in SGLang), unlike the control channel.
"""

from __future__ import annotations


class BootstrapRegistry:
    def __init__(self, num_ranks: int) -> None:
        self._serving: list[int | None] = [None] * num_ranks

    def register(self, rank: int, incarnation: int) -> None:
        self._serving[rank] = incarnation

    def unregister(self, rank: int) -> None:
        self._serving[rank] = None

    def resolve(self, ranks: tuple[int, ...]) -> tuple[int, ...] | None:
        """The serving incarnation of each rank, or None while any of them is down."""
        found = tuple(self._serving[r] for r in ranks)
        return None if None in found else found
