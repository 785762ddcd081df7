"""The checker's control channel: messages wait in one FIFO queue per (sender, receiver) pair until
the checker chooses what happens to one — deliver the head, or (each costing a fault) drop it,
duplicate it, or deliver a later message ahead of the head (reorder). A duplicate is delivered now
and its copy re-sent *some time later* (as the stress's channel does): the copy waits in ``late``,
outside the FIFO order, and may be delivered at any later step."""

from __future__ import annotations

from collections import deque

from layersplit.pd.abort.channel import Channel


class ChoiceChannel(Channel):
    def __init__(self) -> None:
        super().__init__()
        self.queues: dict[tuple[str, str], deque] = {}
        self.late: list[tuple[tuple[str, str], object]] = []  # re-sent duplicates: (pair, message)

    def send(self, src: str, dst: str, msg: object) -> None:
        self.stats["sent"] += 1
        self.queues.setdefault((src, dst), deque()).append(msg)

    def in_flight(self) -> int:
        return sum(len(q) for q in self.queues.values()) + len(self.late)

    def deliver(self, pair: tuple[str, str], index: int = 0) -> None:
        queue = self.queues[pair]
        msg = queue[index]
        del queue[index]
        self._deliver(pair[1], msg, pair[0])

    def drop(self, pair: tuple[str, str]) -> None:
        self.queues[pair].popleft()
        self.stats["dropped"] += 1

    def duplicate(self, pair: tuple[str, str]) -> None:
        self.late.append((pair, self.queues[pair][0]))
        self.stats["duplicated"] += 1
        self.deliver(pair, 0)

    def deliver_late(self, index: int) -> None:
        pair, msg = self.late.pop(index)
        self._deliver(pair[1], msg, pair[0])
