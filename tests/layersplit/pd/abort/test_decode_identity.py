"""Issue 25, item 3: a decode restart is fenced — the old life's writes still in flight are refused by
the new life's memory (no overwrite of the new life's pages), and prefill resets its floor for the new
life (no false "late" rejection of the new life's first requests). Each guard off shows the failure."""

from __future__ import annotations

import pytest

from layersplit.pd.abort.decode_side import FAILED, SUCCESS
from layersplit.pd.abort.guards import guards_off
from layersplit.pd.abort.messages import TransferDone, TransferRequest
from layersplit.pd.abort.transfer_engine import EngineFaults
from tests.layersplit.pd.abort.harness import Harness

SLOW_WRITES = EngineFaults(min_write_s=0.5, max_write_s=0.5)


@pytest.mark.parametrize("guarded", [True, False], ids=["guarded", "decode-life-fence_off"])
def test_old_life_writes_in_flight_never_land_on_the_new_life(guarded):
    with guards_off([] if guarded else ["decode-life-fence"]):
        h = Harness(engine=SLOW_WRITES)
        old = h.decode.submit(rid=1, room=1, n_pages=2)
        h.loop.run(until=0.2)  # posted at ~0.11, landing at ~0.61
        assert h.engines[0].in_flight(lambda owner: True) == 1  # one batch, two page writes
        h.decode.restart()
        new = h.decode.submit(rid=2, room=2, n_pages=2)  # the new life hands out the same pages
        h.loop.run()
    assert old.state == FAILED and old.abort_reason == "decode_restart" and old in h.finished
    assert new.pages == [0, 1] and h.decode.life == 1
    if guarded:
        assert h.decode.kv.overwrites == [] and h.decode.kv.refused_dead_life == 2
        assert new.state == SUCCESS and h.decode.stats["checksum_mismatches"] == 0
        assert h.prefill.stats["decode_lives"] == 1 and h.prefill.stats["orphaned"] == 1
    else:
        assert h.decode.kv.overwrites, "an old life's write landed on the new life's pages"


@pytest.mark.parametrize("guarded", [True, False], ids=["guarded", "floor-per-decode-life_off"])
def test_new_life_requests_are_not_rejected_as_late(guarded):
    with guards_off([] if guarded else ["floor-per-decode-life"]):
        h = Harness()
        rejected = h.close_epoch_zero()
        h.decode.restart()
        third = h.decode.submit(rid=3, room=3, n_pages=1)  # the new life: epoch 0 again
        h.loop.run()
    assert third.epoch == 0
    if guarded:
        assert rejected == [] and third.state == SUCCESS and h.prefill.stats["rejected_late"] == 0
    else:
        assert 3 in rejected and third.state == FAILED and third.abort_reason == "timeout"


def test_a_message_of_an_older_life_is_dropped_both_ways():
    h = Harness(engine=SLOW_WRITES)
    h.decode.submit(rid=1, room=1, n_pages=1)
    h.loop.run(until=0.05)
    stale = h.sent(TransferRequest)[0]  # life 0's TransferRequest
    h.decode.restart()
    h.decode.submit(rid=2, room=2, n_pages=1)
    h.loop.run(until=0.1)  # the new life's request reached prefill
    h.prefill.handle(stale)  # a late duplicate from the dead life
    h.loop.run()
    assert h.prefill.stats["stale_decode_life"] == 1
    assert h.prefill.stats["orphaned"] == 1 and h.sent(TransferRequest)[-1].decode_life == 1
    h.decode.handle(TransferDone(2, 2, 0, 0, decode_life=0), 0)  # a reply addressed to the dead life
    assert h.decode.stats["old_life_messages"] == 1 and h.decode.reqs == {}
    assert h.decode.kv.overwrites == [] and h.decode.stats["success"] == 1
