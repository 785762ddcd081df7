"""Issue 25, item 4: success and release need the owners, not a count. A ``TransferDone`` or an
``AbortAck`` naming a non-owner (a rank that was not told) or a peer it did not come from is counted
and ignored: no success, no release. Each guard off lets the forged reply complete the request while
an owner is still writing (a corrupt read)."""

from __future__ import annotations

import pytest

from layersplit.pd.abort.decode_side import SUCCESS, WAITING, DecodeConfig
from layersplit.pd.abort.guards import guards_off
from layersplit.pd.abort.messages import AbortAck, TransferDone
from layersplit.pd.abort.topology import PrefillTopology
from layersplit.pd.abort.transfer_engine import EngineFaults
from tests.layersplit.pd.abort.harness import FIXED_WRITE, Harness

TWO = PrefillTopology(((0,), (1,)))
NON_OWNER, MISADDRESSED = (2, 2), (1, 0)  # (peer named, rank the channel delivered it from)


def rank1_still_writing() -> Harness:
    h = Harness(topology=TWO, engine_for_rank={1: EngineFaults(min_write_s=2.0, max_write_s=2.0), 0: FIXED_WRITE},
                decode=DecodeConfig(num_pages=8, wait_timeout_s=5.0))
    h.decode.submit(rid=1, room=1, n_pages=2)
    h.loop.run(until=0.5)  # rank 0 reported done; rank 1's writes land at ~2.1
    assert h.decode.reqs[1].done_peers == {0}
    return h


@pytest.mark.parametrize("forged", [NON_OWNER, MISADDRESSED], ids=["non_owner", "misaddressed"])
def test_a_forged_transfer_done_is_counted_and_ignored(forged):
    h = rank1_still_writing()
    peer, src = forged
    h.decode.handle(TransferDone(1, 1, peer), src)
    req = h.decode.reqs[1]
    assert req.state != SUCCESS and req.done_peers == {0}
    assert h.decode.stats["non_owner" if forged == NON_OWNER else "misaddressed"] == 1
    h.loop.run()
    assert req.state == SUCCESS and h.decode.stats["checksum_mismatches"] == 0  # on rank 1's real report


@pytest.mark.parametrize("guard,forged", [("owners-only", NON_OWNER), ("reply-from-its-peer", MISADDRESSED)])
def test_with_the_guard_off_the_forged_report_completes_a_request_still_being_written(guard, forged):
    h = rank1_still_writing()
    with guards_off([guard]):
        h.decode.handle(TransferDone(1, 1, forged[0]), forged[1])
    assert h.decode.stats["success"] == 1 and h.decode.stats["checksum_mismatches"] == 1  # a corrupt read


@pytest.mark.parametrize("forged", [NON_OWNER, MISADDRESSED], ids=["non_owner", "misaddressed"])
def test_a_forged_abort_ack_releases_nothing(forged):
    h = rank1_still_writing()
    req = h.decode.reqs[1]
    h.decode.abort(req)
    assert req.unacked == {1} and req.state != WAITING
    peer, src = forged
    h.decode.handle(AbortAck(1, 1, req.abort_token, peer), src)
    assert h.decode.reqs.get(1) is req and req.unacked == {1}  # still held: rank 1 is writing
    assert h.decode.stats["stale_acks" if forged == NON_OWNER else "misaddressed"] == 1
    h.loop.run()
    assert 1 not in h.decode.reqs and h.decode.kv.overwrites == []  # released on rank 1's own ack
