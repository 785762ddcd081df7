"""Item 5: page ownership is (room, generation) — a free or a write by anyone but the current owner
is reported. Item 6: prefill's source pages stay allocated until the last write reading them
drained. Each guard proven twice."""

from __future__ import annotations

import pytest

from layersplit.pd.abort.decode_kv import DecodeKV
from layersplit.pd.abort.decode_side import DecodeConfig
from layersplit.pd.abort.pages import TaggedPages, page_payload
from layersplit.pd.abort.prefill_kv import PrefillKV, SourceRead
from layersplit.pd.abort.prefill_side import PrefillConfig, PrefillNode
from layersplit.pd.abort.transfer_engine import EngineFaults
from tests.layersplit.pd.abort.harness import Harness

ALL = (0,)  # one layer


@pytest.mark.parametrize("guarded", [True, False], ids=["guarded", "unguarded"])
def test_free_by_a_stale_owner_is_reported(guarded, monkeypatch):
    if not guarded:  # the old check: "owned by someone"
        monkeypatch.setattr(TaggedPages, "_owns", lambda self, page, tag: self.owner[page] is not None)
    kv = DecodeKV(num_pages=2)
    old = kv.alloc(2, room=1)
    old_tags = kv.tags(old)
    kv.free(old, old_tags)
    new = kv.alloc(2, room=2)  # the same pages, handed to room 2
    new_tags = kv.tags(new)
    kv.free(old, old_tags)  # room 1 frees "its" pages again
    third = kv.alloc(2, room=3)
    for page, tag in zip(new, new_tags):  # room 2's writes keep landing
        kv.land((page, ALL), tag, page_payload(2, page))
    if guarded:
        assert [(p, t.room, o.room) for p, t, o in kv.bad_frees] == [(0, 1, 2), (1, 1, 2)]
        assert third is None and kv.overwrites == []  # room 2 keeps its pages
    else:
        assert third == new and kv.overwrites  # handed out twice: room 2's writes corrupt room 3


def test_generation_tells_two_allocations_of_a_page_apart():
    kv = DecodeKV(num_pages=1)
    first = kv.alloc(1, room=5)
    stale = kv.tags(first)[0]
    kv.free(first, (stale,))
    kv.alloc(1, room=5)  # same page, same room, new generation
    kv.land((0, ALL), stale, 1)
    kv.free(first, (stale,))
    assert len(kv.overwrites) == 1 and len(kv.bad_frees) == 1 and kv.owner[0] != stale


def test_a_source_read_of_a_freed_page_is_reported():
    kv = PrefillKV(num_pages=1)
    pages = kv.alloc(1, room=1)
    kv.fill(pages, room=1)
    read = SourceRead(kv, pages[0], kv.tags(pages)[0])
    assert read() == page_payload(1, 0) and kv.stale_reads == []
    kv.free(pages, kv.tags(pages))
    kv.fill(kv.alloc(1, room=2), room=2)
    assert read() == page_payload(2, 0) and len(kv.stale_reads) == 1  # delivers room 2's bytes


@pytest.mark.parametrize("guarded", [True, False], ids=["guarded", "unguarded"])
def test_source_pages_are_held_until_their_writes_drain(guarded, monkeypatch):
    if not guarded:  # free as soon as the last batch is posted, writes still in flight
        monkeypatch.setattr(PrefillNode, "_sources_drained", lambda self, req: not req.computing)
    h = Harness(engine=EngineFaults(min_write_s=0.5, max_write_s=0.5),
                prefill=PrefillConfig(min_compute_s=0.1, max_compute_s=0.1, source_pages=2),
                decode=DecodeConfig(num_pages=4, wait_timeout_s=3.0))
    first = h.decode.submit(rid=1, room=1, n_pages=2)
    h.loop.after(0.15, h.decode.submit, 2, 2, 2)  # arrives while room 1's writes are in flight
    h.loop.run()
    kv = h.prefill.kv
    if guarded:
        assert kv.stale_reads == [] and h.decode.stats["success"] == 2 and h.decode.stats["checksum_mismatches"] == 0
        assert len(kv.free_pages) == 2 and kv.bad_frees == []
    else:
        assert kv.stale_reads and h.decode.stats["checksum_mismatches"] >= 1  # room 1 got room 2's KV
    assert first.state == "Success"
