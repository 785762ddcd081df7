"""Page allocator with reference counts (shared prefix pages) and stream fences for reuse.

A page is free when its count drops to 0. ``free(pages, fence=e)`` may pass the event recorded
after the last stream work that read the pages: whoever allocates them again gets the fences
(:meth:`PageAllocator.fences`) and must make its writing stream wait on them (hazard: a load into
a re-allocated page must not overtake the forward work still reading the page's old content).
"""

from __future__ import annotations

from collections import deque

from hicache.runtime.streams import Event


class OutOfPages(RuntimeError):
    """Not enough free pages; nothing was allocated."""


class PageAllocator:
    """``reserved``: the first page ids are never handed out (page 0 as a padding page: page-table
    padding and masked top-k entries point there, so they never read a page another batch owns)."""

    def __init__(self, num_pages: int, name: str = "pool", reserved: int = 0) -> None:
        if num_pages < 1:
            raise ValueError(f"{name}: num_pages: expected an integer >= 1, got {num_pages}")
        if not 0 <= reserved < num_pages:
            raise ValueError(f"{name}: reserved: expected 0 <= reserved < num_pages ({num_pages}), got {reserved}")
        self.name = name
        self.num_pages = num_pages
        self._refs = [0] * num_pages
        self._free: deque[int] = deque(range(reserved, num_pages))
        self._fence: dict[int, Event] = {}

    @property
    def available(self) -> int:
        return len(self._free)

    def refcount(self, page: int) -> int:
        self._check(page)
        return self._refs[page]

    def alloc(self, n: int) -> list[int]:
        """``n`` pages with count 1, or :class:`OutOfPages` (all or nothing)."""
        if n < 0:
            raise ValueError(f"{self.name}: alloc: expected n >= 0, got {n}")
        if n > len(self._free):
            raise OutOfPages(f"{self.name}: alloc: expected {n} free pages, got {len(self._free)} of {self.num_pages}")
        pages = [self._free.popleft() for _ in range(n)]
        for p in pages:
            self._refs[p] = 1
        return pages

    def fences(self, pages: list[int]) -> list[Event]:
        """Events that writes into freshly allocated ``pages`` must wait on (consumed by this call)."""
        found = {id(e): e for e in (self._fence.pop(p, None) for p in pages) if e is not None}
        return list(found.values())

    def incref(self, pages: list[int]) -> None:
        for p in pages:
            self._check(p)
            if self._refs[p] == 0:
                raise ValueError(f"{self.name}: incref: expected an allocated page, got free page {p}")
        for p in pages:
            self._refs[p] += 1

    def free(self, pages: list[int], fence: Event | None = None) -> None:
        """Drop one reference per page; pages reaching 0 return to the free list (with ``fence``)."""
        for p in pages:
            self._check(p)
        counts: dict[int, int] = {}
        for p in pages:
            counts[p] = counts.get(p, 0) + 1
            if counts[p] > self._refs[p]:
                raise ValueError(f"{self.name}: free: expected an allocated page, got page {p} freed more often than referenced (double free)")
        for p in pages:
            self._refs[p] -= 1
            if self._refs[p] == 0:
                self._free.append(p)
                if fence is not None:
                    self._fence[p] = fence

    def _check(self, page: int) -> None:
        if not 0 <= page < self.num_pages:
            raise ValueError(f"{self.name}: page: expected 0 <= page < {self.num_pages}, got {page}")
