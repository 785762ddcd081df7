"""A prefill process's memory of rooms: records of the transfer requests it accepted, tombstones of
rooms aborted before their request arrived, and the floor below which it forgets both.

Forgetting is safe because the floor comes from decode (see ``layersplit.pd.abort.watermark``): decode raises a rank's
floor past an epoch only once it no longer waits on that rank for the room, and the rank rejects
every ``TransferRequest`` below the floor — so a pruned room can never be written again, and an
abort for it ("never saw it") is answered without a tombstone.
"""

from __future__ import annotations

import heapq
from typing import Any


class RoomBook:
    def __init__(self) -> None:
        self.records: dict[int, Any] = {}  # room -> the rank's record of an accepted request
        self.tombstones: dict[int, int] = {}  # room -> epoch, for rooms aborted before their request came
        self.floor = 0
        self._by_epoch: list[tuple[int, int]] = []  # heap of (epoch, room) for both kinds
        self.peak_records = 0
        self.peak_tombstones = 0

    def below_floor(self, epoch: int) -> bool:
        return epoch < self.floor

    def add_record(self, epoch: int, room: int, record: Any) -> None:
        self.records[room] = record
        heapq.heappush(self._by_epoch, (epoch, room))
        self.peak_records = max(self.peak_records, len(self.records))

    def add_tombstone(self, epoch: int, room: int) -> None:
        self.tombstones[room] = epoch
        heapq.heappush(self._by_epoch, (epoch, room))
        self.peak_tombstones = max(self.peak_tombstones, len(self.tombstones))

    def advance(self, floor: int) -> None:
        """Decode says every epoch below ``floor`` is closed: forget those rooms."""
        if floor <= self.floor:
            return  # floors only rise; an old (duplicated or reordered) message carries an old one
        self.floor = floor
        while self._by_epoch and self._by_epoch[0][0] < floor:
            _, room = heapq.heappop(self._by_epoch)
            self.records.pop(room, None)
            self.tombstones.pop(room, None)
