"""Decode's pages on real memory, checked by the landing checker (:mod:`tools.pd_real.landing`).

:class:`RealDecodeKV` is the protocol's :class:`~layersplit.pd.abort.decode_kv.DecodeKV` (same allocator, owner
tags and ``free``-by-owner check) whose bytes are decode's registered per-layer regions
(:class:`~tools.pd_real.mooncake_engine.DecodeMemory`) instead of the simulation's page records. No
write is handed to decode — Mooncake writes the bytes — so every check reads the memory:

* **read** (``intact``, when a request succeeds and decode starts): every layer of every page must be a
  whole page of the page's owner tag, checksum valid; anything else is a ``stale_read``;
* **release** (``free``): a page whose header names another tag than its owner's was written by
  someone else (an ``overwrite``); then the page is poisoned;
* **free pages** (``scan``, every ``scan_s``, and at allocation): a released page holding any byte
  that is not poison was written after its release (an ``overwrite``, a late write); it is poisoned
  again so one write is counted once.
"""

from __future__ import annotations

import numpy as np

from layersplit.pd.abort.decode_kv import DecodeKV
from tools.pd_real.engine import POISON
from tools.pd_real.landing import HEADER, check
from layersplit.pd.abort.transfer_engine import WriteTag

_POISON_WORD = int.from_bytes(bytes([POISON]) * 4, "little")


class RealDecodeKV(DecodeKV):
    def __init__(self, memory, num_layers: int, life: int) -> None:
        super().__init__(memory.num_pages, num_layers, life)
        self.memory = memory
        self.checks = {"pages_read": 0, "stale_reads": 0, "overwrites": 0, "overwrites_at_release": 0,
                       "late_writes_on_free_pages": 0, "late_writes_at_alloc": 0, "scans": 0}
        self.overwrite_log: list[dict] = []  # the first few, with the tag that wrote them

    def _regions(self) -> list[np.ndarray]:
        return self.memory.layers

    def alloc(self, n: int, room: int) -> list[int] | None:
        pages = super().alloc(n, room)
        if pages:
            self._late_on(pages, "late_writes_at_alloc")  # a released page must still be poison
        return pages

    def free(self, pages: list[int], tags: tuple[WriteTag, ...]) -> None:
        owned = [p for p, t in zip(pages, tags) if self.owner[p] == t]
        for layer, region in enumerate(self._regions()):
            for p in owned:
                found = _header_tag(region[p])
                if found is not None and found != self.owner[p]:
                    self._overwrite("overwrites_at_release", p, layer, found)
            region[owned] = POISON
        super().free(pages, tags)

    def intact(self, pages: list[int], room: int) -> bool:
        ok = True
        for region in self._regions():
            for p in pages:
                self.checks["pages_read"] += 1
                if check(region[p], self.owner[p]) != "ok":
                    self.checks["stale_reads"] += 1
                    ok = False
        return ok

    def scan(self) -> int:
        """Check every free page for bytes written after its release; returns how many were found."""
        self.checks["scans"] += 1
        return self._late_on(list(self.free_pages), "late_writes_on_free_pages")

    def _late_on(self, pages: list[int], kind: str) -> int:
        if not pages:
            return 0
        found = 0
        for layer, region in enumerate(self._regions()):
            dirty = np.asarray(pages)[(region[pages] != POISON).any(axis=1)]
            for p in dirty.tolist():
                self._overwrite(kind, p, layer, _header_tag(region[p]))
                region[p] = POISON
                found += 1
        return found

    def _overwrite(self, kind: str, page: int, layer: int, tag: WriteTag | None) -> None:
        self.checks[kind] += 1
        self.checks["overwrites"] += 1
        if len(self.overwrite_log) < 20:
            self.overwrite_log.append({"kind": kind, "page": page, "layer": layer,
                                       "writer": list(tag) if tag is not None else None,
                                       "owner": list(self.owner[page]) if self.owner[page] else None})


def _header_tag(page: np.ndarray) -> WriteTag | None:
    """The tag a page's header names (checksum or not), or None where no header byte was written."""
    room, generation, life = (int(x) for x in page[:HEADER - 4].view("<u4"))
    if room == generation == life == _POISON_WORD:
        return None if (page == POISON).all() else WriteTag(room, generation, life)
    return WriteTag(room, generation, life)
