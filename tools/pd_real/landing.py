"""The landing checker on real memory: every page a sender writes carries its owner tag and a checksum;
decode checks a page when it reads it, and watches the pages it released.

Page layout (``page_bytes`` >= 17): bytes 0..15 are four little-endian uint32 — ``room``,
``generation``, ``life`` (the :class:`~layersplit.pd.abort.transfer_engine.WriteTag`) and the CRC32 of the body;
bytes 16.. are the body, a seeded function of the tag (so a page of one tag never equals another's).
A released page is filled with :data:`POISON`; any byte that is not poison afterwards is a late write.
"""

from __future__ import annotations

import zlib

import numpy as np

from tools.pd_real.engine import POISON
from layersplit.pd.abort.transfer_engine import WriteTag

HEADER = 16


def stamp(page_bytes: int, tag: WriteTag) -> np.ndarray:
    """The page a sender writes for ``tag``: header, then a body drawn from a generator seeded by the tag."""
    if page_bytes <= HEADER:
        raise ValueError(f"page_bytes: expected > {HEADER}, got {page_bytes}")
    body = np.random.default_rng(list(tag)).integers(0, 256, page_bytes - HEADER, dtype=np.uint8)
    header = np.array([tag.room, tag.generation, tag.life, zlib.crc32(body)], "<u4").view(np.uint8)
    return np.concatenate([header, body])


def check(page: np.ndarray, expect: WriteTag) -> str:
    """``ok`` (``expect``'s bytes, whole), ``poison`` (never written, or released), ``torn`` (the
    checksum fails: a partial or mixed write) or ``stale`` (a whole page of another tag)."""
    if (page == POISON).all():
        return "poison"
    room, generation, life, crc = (int(x) for x in page[:HEADER].view("<u4"))
    if zlib.crc32(page[HEADER:]) != crc:
        return "torn"
    return "ok" if WriteTag(room, generation, life) == expect else "stale"


def owner(page: np.ndarray) -> WriteTag | None:
    """The tag a whole (checksum-valid) page carries, else None."""
    room, generation, life, crc = (int(x) for x in page[:HEADER].view("<u4"))
    return WriteTag(room, generation, life) if zlib.crc32(page[HEADER:]) == crc else None


class ReleasedWatch:
    """Released pages of a ``[pages, page_bytes]`` uint8 array: poisoned on ``release``; ``late``
    lists the released pages holding any non-poison byte since (a write that landed after release)."""

    def __init__(self, pages: np.ndarray) -> None:
        self.pages = pages
        self.released: set[int] = set()

    def release(self, index: list[int]) -> None:
        self.pages[index] = POISON
        self.released.update(index)

    def reuse(self, index: list[int]) -> None:
        """The pages are allocated again: no longer watched."""
        self.released.difference_update(index)

    def late(self) -> list[int]:
        return sorted(i for i in self.released if not (self.pages[i] == POISON).all())
