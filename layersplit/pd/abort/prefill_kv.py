"""Prefill-side source pages: the KV a prefill rank computed, which its transfer-engine writes read.

An RDMA write reads its local source buffer when the NIC transmits, not when the write is posted, so
a source page must stay allocated until the last write that reads it has drained. ``SourceRead`` is
the payload the engine resolves at landing time; reading a page that has since been freed (and
handed to another request) is recorded in ``stale_reads`` — and delivers the other request's bytes.
"""

from __future__ import annotations

from layersplit.pd.abort.pages import TaggedPages, page_payload
from layersplit.pd.abort.transfer_engine import WriteTag


class PrefillKV(TaggedPages):
    def __init__(self, num_pages: int) -> None:
        super().__init__(num_pages)
        self.content: list[int | None] = [None] * num_pages
        self.stale_reads: list[tuple[int, WriteTag, WriteTag | None]] = []  # (page, reader, real owner)

    def fill(self, pages: list[int], room: int) -> None:
        """The forward pass wrote ``room``'s KV into its source pages (page ``i`` of the request)."""
        for i, p in enumerate(pages):
            self.content[p] = page_payload(room, i)


class SourceRead:
    """A write's payload: the content of one source page, read when the write lands."""

    __slots__ = ("kv", "page", "tag")

    def __init__(self, kv: PrefillKV, page: int, tag: WriteTag) -> None:
        self.kv, self.page, self.tag = kv, page, tag

    def __call__(self) -> int | None:
        if self.kv.owner[self.page] != self.tag:
            self.kv.stale_reads.append((self.page, self.tag, self.kv.owner[self.page]))
        return self.kv.content[self.page]
