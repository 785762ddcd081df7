"""Decode-side KV pages: tagged pages holding every layer of a request's KV, and the invariant checker
every landing write goes through.

A write lands on ``(page, layers)``: with LayerSplit each prefill CP rank writes only the layers it
owns, so a page is complete only once every rank's layers landed. A write whose tag is not the page's
current (room, generation) is an **overwrite** — the aborted-request race this package guards against.

The pages are registered memory of one decode **life** (process): a restart deregisters them, so a
write tagged with another life is refused where it lands (``refused_dead_life``), never applied.
"""

from __future__ import annotations

from layersplit.pd.abort.pages import TaggedPages, page_payload
from layersplit.pd.abort.transfer_engine import WriteTag


class DecodeKV(TaggedPages):
    def __init__(self, num_pages: int, num_layers: int = 1, life: int = 0) -> None:
        super().__init__(num_pages, life)
        if num_layers < 1:
            raise ValueError(f"num_layers: expected an integer >= 1, got {num_layers}")
        self.num_layers = num_layers
        self.data: list[list[int | None]] = [[None] * num_layers for _ in range(num_pages)]
        self.overwrites: list[tuple[int, WriteTag, WriteTag | None]] = []  # (page, writer, real owner)
        self.refused_dead_life = 0  # writes of another decode life, refused by the (re-)registered memory

    def alloc(self, n: int, room: int) -> list[int] | None:
        pages = super().alloc(n, room)
        for p in pages or ():
            self.data[p] = [None] * self.num_layers  # nothing of the new request has landed yet
        return pages

    def land(self, dest: tuple[int, tuple[int, ...]], tag: WriteTag, payload: int) -> None:
        """A write arrives at ``dest = (page, layers)``. Flag it if the page is no longer the writer's."""
        page, layers = dest
        if not self.accepts(tag):
            self.refused_dead_life += 1
            return
        if self.owner[page] != tag:
            self.overwrites.append((page, tag, self.owner[page]))
        row = self.data[page]
        for layer in layers:
            row[layer] = payload

    def accepts(self, tag: WriteTag) -> bool:
        """Is a write of ``tag`` applied? Only this life's memory is registered (layersplit.pd.abort.guards can switch it off)."""
        return tag.life == self.life

    def intact(self, pages: list[int], room: int) -> bool:
        """Decode is about to read: does every layer of every page hold ``room``'s KV?"""
        return all(self.data[p].count(page_payload(room, i)) == self.num_layers for i, p in enumerate(pages))
