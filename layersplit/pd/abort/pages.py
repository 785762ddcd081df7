"""Page ownership: an allocator whose pages carry the (room, generation) of their current owner.

Both sides use it: decode for the KV pages prefill writes into, prefill for the source pages those
writes read from. ``free`` must name the owner it frees for: freeing a page that was already handed
to another room (or to a later allocation of the same room) is an error the checker reports
(``bad_frees``) instead of a silent corruption of the new owner.
"""

from __future__ import annotations

from collections import deque

from layersplit.pd.abort.transfer_engine import WriteTag


def page_payload(room: int, index: int) -> int:
    """The KV content of a request's ``index``-th page (what prefill computes and decode checksums)."""
    return hash((room, index)) & 0xFFFFFFFFFFFF


class TaggedPages:
    """Pages 0..n-1, each free or owned by one ``WriteTag(room, generation)``; FIFO reuse."""

    def __init__(self, num_pages: int, life: int = 0) -> None:
        if num_pages < 1:
            raise ValueError(f"num_pages: expected an integer >= 1, got {num_pages}")
        self.owner: list[WriteTag | None] = [None] * num_pages
        self.free_pages: deque[int] = deque(range(num_pages))
        self._generation = 0
        self.life = life  # the owning process's life: part of every tag it hands out
        self.bad_frees: list[tuple[int, WriteTag, WriteTag | None]] = []  # (page, freed as, real owner)

    @property
    def num_pages(self) -> int:
        return len(self.owner)

    def alloc(self, n: int, room: int) -> list[int] | None:
        """``n`` pages for ``room`` (each with a fresh generation), or None when fewer are free."""
        if n > len(self.free_pages):
            return None
        pages = [self.free_pages.popleft() for _ in range(n)]
        for p in pages:
            self._generation += 1
            self.owner[p] = WriteTag(room, self._generation, self.life)
        return pages

    def tags(self, pages: list[int]) -> tuple[WriteTag, ...]:
        return tuple(self.owner[p] for p in pages)

    def free(self, pages: list[int], tags: tuple[WriteTag, ...]) -> None:
        """Return ``pages`` to the pool; each must still be owned by the matching tag."""
        assert len(pages) == len(tags), f"free: {len(pages)} pages but {len(tags)} tags"
        for page, tag in zip(pages, tags):
            if not self._owns(page, tag):  # a stale free: the page belongs to someone else now
                self.bad_frees.append((page, tag, self.owner[page]))
                continue
            self.owner[page] = None
            self.free_pages.append(page)

    def _owns(self, page: int, tag: WriteTag) -> bool:
        return self.owner[page] == tag  # room AND generation: a later allocation of the page is another owner
