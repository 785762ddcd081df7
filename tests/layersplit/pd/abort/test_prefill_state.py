"""Item 3: bounded prefill state. Records and tombstones are pruned below decode's floor; a restarted
prefill process (new incarnation, empty state) neither acts on requests meant for its previous life
nor answers an abort before that life's writes drained. Each guard proven twice."""

from __future__ import annotations

import pytest

from layersplit.pd.abort.stress import PDStressConfig, failures, run_pd_stress
from layersplit.pd.abort.decode_side import SUCCESS, DecodeConfig
from layersplit.pd.abort.messages import AbortAck, TransferRequest
from layersplit.pd.abort.prefill_side import PrefillNode
from layersplit.pd.abort.room_book import RoomBook
from layersplit.pd.abort.transfer_engine import EngineFaults
from layersplit.pd.abort.watermark import LowWatermark
from tests.layersplit.pd.abort.harness import Harness


def test_low_watermark_is_the_smallest_open_epoch():
    w = LowWatermark()
    assert w.floor() == 0
    for e in range(4):
        w.open(e)
    w.close(1)
    w.close(2)
    assert w.floor() == 0
    w.close(0)
    assert w.floor() == 3 and w.open_count == 1
    w.close(3)
    assert w.floor() == 4  # nothing open: everything ever opened is closed


def test_room_book_prunes_below_the_floor_and_ignores_old_floors():
    book = RoomBook()
    book.add_record(0, 10, "r10")
    book.add_tombstone(1, 11)
    book.add_record(2, 12, "r12")
    book.advance(2)
    assert list(book.records) == [12] and book.tombstones == {} and book.below_floor(1)
    book.advance(1)  # a duplicated old message
    assert book.floor == 2 and book.peak_records == 2 and book.peak_tombstones == 1


def ghost_of_a_finished_room(h: Harness) -> TransferRequest:
    """Room 1 succeeds and is freed, room 2 reuses its pages; returns room 1's TransferRequest."""
    h.decode.submit(rid=1, room=1, n_pages=2)
    h.loop.run(until=0.5)  # success at ~0.13, decode done at ~0.43: pages free
    second = h.decode.submit(rid=2, room=2, n_pages=2)
    h.loop.run(until=0.52)  # room 2 announced: the rank's floor is past room 1's epoch
    assert tuple(second.pages) == h.sent(TransferRequest)[0].pages
    return h.sent(TransferRequest)[0]


@pytest.mark.parametrize("guarded", [True, False], ids=["guarded", "unguarded"])
def test_floor_rejects_a_late_duplicate_of_a_pruned_room(guarded, monkeypatch):
    if not guarded:
        monkeypatch.setattr(RoomBook, "below_floor", lambda self, epoch: False)
    h = Harness(decode=DecodeConfig(num_pages=2))
    ghost = ghost_of_a_finished_room(h)
    pruned_room = 1
    assert pruned_room not in h.prefill.book.records  # below the floor: dropped
    h.prefill.handle(ghost)  # the channel delivers a duplicate of room 1's request, late
    h.loop.run()
    if guarded:
        assert h.prefill.stats["rejected_late"] == 1 and h.decode.kv.overwrites == []
        assert h.decode.stats["success"] == 2 and h.decode.stats["checksum_mismatches"] == 0
    else:
        assert h.decode.kv.overwrites, "room 1's ghost wrote into room 2's pages unnoticed"


@pytest.mark.parametrize("guarded", [True, False], ids=["guarded", "unguarded"])
def test_restarted_prefill_rejects_requests_for_its_previous_life(guarded, monkeypatch):
    if not guarded:
        monkeypatch.setattr(PrefillNode, "_addressed_here", lambda self, msg: True)
    h = Harness()
    h.decode.submit(rid=1, room=1, n_pages=2)
    h.loop.run(until=0.45)  # room 1 done and freed
    ghost = h.sent(TransferRequest)[0]
    h.prefill.crash()
    h.loop.after(0.05, h.prefill.restart)  # nothing in flight: serves at once, with empty state
    h.decode.submit(rid=2, room=2, n_pages=2)  # same pages; bootstrapping until the rank is back
    h.loop.after(0.0501, h.prefill.handle, ghost)  # the duplicate beats room 2's request (and its floor)
    h.loop.run()
    if guarded:
        assert h.prefill.stats["wrong_incarnation"] == 1 and h.decode.kv.overwrites == []
        assert h.decode.stats["success"] == 2
    else:
        assert h.decode.kv.overwrites, "the new life wrote for a room of its previous life"


@pytest.mark.parametrize("guarded", [True, False], ids=["guarded", "unguarded"])
def test_restarted_prefill_acks_only_after_its_previous_life_drained(guarded, monkeypatch):
    if not guarded:
        monkeypatch.setattr(PrefillNode, "_await_old_writes", lambda self, inc: self._serve(inc))
    h = Harness(engine=EngineFaults(min_write_s=3.0, max_write_s=3.0), decode=DecodeConfig(num_pages=2))
    first = h.decode.submit(rid=1, room=1, n_pages=2)
    h.loop.run(until=0.3)  # writes posted at ~0.11, landing at ~3.11
    h.prefill.crash()
    h.loop.after(0.05, h.decode.abort, first)  # the client gives up while the rank is down
    h.loop.after(0.1, h.prefill.restart)
    second = h.decode.submit(rid=2, room=2, n_pages=2)  # queued behind room 1's pages
    h.loop.run()
    assert first.state != SUCCESS
    ack_time = h.received(AbortAck)[0][0]
    if guarded:
        assert ack_time >= max(t for t, _, _, tag in h.landed if tag.room == 1) and h.decode.kv.overwrites == []
        assert h.decode.stats["acks_from_restarted_rank"] == 1 and second.pages == first.pages  # reused, safely
    else:
        assert h.decode.kv.overwrites, "the restarted process vouched for writes still in flight"


def peak_records(requests: int) -> int:
    report = run_pd_stress(PDStressConfig(requests=requests, seed=4))
    assert failures(report) == []
    return report["peak_prefill_records"]


@pytest.mark.parametrize("guarded", [True, False], ids=["guarded", "unguarded"])
@pytest.mark.slow
def test_prefill_memory_stays_flat(guarded, monkeypatch):
    if not guarded:
        monkeypatch.setattr(RoomBook, "advance", lambda self, floor: None)  # never prune
    small, large = peak_records(500), peak_records(2500)
    if guarded:
        assert large < 2 * small and large < 500, (small, large)  # the in-flight window, not the run length
    else:
        assert large > 2000, (small, large)  # one record per room ever seen


def test_storm_with_frequent_restarts_stays_clean():
    report = run_pd_stress(PDStressConfig(requests=1500, seed=6, restart_mean_s=3.0))
    assert failures(report) == [], failures(report)
    assert report["prefill_crashes"] >= 10 and report["acks_from_restarted_rank"] > 0
    assert report["prefill_lost_while_down"] > 0
