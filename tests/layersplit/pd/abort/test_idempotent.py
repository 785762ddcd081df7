"""Items 1-2: abort is idempotent and state-guarded; a request no rank was told about is released at
once. Each guard is proven twice: the scenario passes with it, and with it monkeypatched away the
same scenario shows the failure."""

from __future__ import annotations

import pytest

from layersplit.pd.abort.backoff import AbortBackoff
from layersplit.pd.abort.decode_side import FAILED, SUCCESS, DecodeConfig, DecodeNode
from layersplit.pd.abort.messages import Abort, TransferRequest
from layersplit.pd.abort.topology import PrefillTopology
from layersplit.pd.abort.transfer_engine import EngineFaults
from tests.layersplit.pd.abort.harness import Harness

SLOW_WRITES = EngineFaults(min_write_s=0.5, max_write_s=0.5)


def drop_abort_guard(monkeypatch) -> None:
    """The old ``abort``: no state check, any request may be aborted any number of times."""
    monkeypatch.setattr(DecodeNode, "_abortable", lambda self, req: True)


@pytest.mark.parametrize("guarded", [True, False], ids=["guarded", "unguarded"])
def test_second_abort_changes_nothing(guarded, monkeypatch):
    if not guarded:
        drop_abort_guard(monkeypatch)
    h = Harness(topology=PrefillTopology(((0,), (1,))), engine_for_rank={0: SLOW_WRITES})
    req = h.decode.submit(rid=1, room=1, n_pages=2)
    h.loop.run(until=0.07)  # rank 0 posted at ~0.06 (landing at ~0.56); rank 1 still computing
    h.decode.abort(req)
    token = req.abort_token
    h.loop.run(until=0.2)  # rank 1 acked at once; rank 0 acks when its writes land
    assert req.unacked == {0}
    sends = h.decode.stats["abort_sends"]
    h.decode.abort(req)  # the client and the router both abort it
    detected = (len(h.finished), req.abort_token != token, req.unacked != {0}, h.decode.stats["abort_sends"] > sends)
    if guarded:
        assert detected == (1, False, False, False) and h.decode.stats["aborts_ignored"] == 1
        h.loop.run()
        assert len({m.token for m in h.sent(Abort)}) == 1 and len(h.decode.kv.free_pages) == 8
    else:
        assert detected == (2, True, True, True)  # on_finish twice, new token, acks reset, a second send chain


@pytest.mark.parametrize("guarded", [True, False], ids=["guarded", "unguarded"])
def test_abort_after_success_frees_nothing_twice(guarded, monkeypatch):
    if not guarded:
        drop_abort_guard(monkeypatch)
    h = Harness(decode=DecodeConfig(num_pages=2, decode_s=0.3))
    first = h.decode.submit(rid=1, room=1, n_pages=2)
    second = h.decode.submit(rid=2, room=2, n_pages=2)  # queued: the pool is full
    h.loop.run(until=0.2)
    assert first.state == SUCCESS  # decoding until ~0.43
    h.decode.abort(first)  # a client cancel that arrives while decode reads the KV
    h.loop.run()
    if guarded:
        assert h.decode.kv.bad_frees == [] and second.state == SUCCESS and h.decode.stats["checksum_mismatches"] == 0
        assert len(h.finished) == 2 and len(h.decode.kv.free_pages) == 2
    else:
        assert h.decode.kv.bad_frees, "the double free went unreported"  # freed at abort, again at finish


def test_abort_of_a_released_request_is_ignored():
    h = Harness()
    req = h.decode.submit(rid=1, room=1, n_pages=2)
    h.loop.run()
    assert req.state == SUCCESS and not h.decode.reqs
    h.decode.abort(req)
    h.decode.abort(req)
    assert h.decode.stats["aborts_ignored"] == 2 and len(h.finished) == 1 and h.decode.kv.bad_frees == []


# item 2: Bootstrapping ---------------------------------------------------------------------------------

DEAD_RANK = DecodeConfig(num_pages=8, wait_timeout_s=1.0, abort_backoff=AbortBackoff(first_s=0.05, max_s=0.2, max_sends=4),
                         fence_after_s=None)  # never fenced: what holds the pages is the guard alone


def tell_everyone(monkeypatch) -> None:
    """The old rule: wait for an ack from every rank, whether or not it was ever given the pages."""
    monkeypatch.setattr(DecodeNode, "_must_ack", lambda self, req: set(self.topology.ranks) - req.done_peers)


@pytest.mark.parametrize("guarded", [True, False], ids=["guarded", "unguarded"])
def test_abort_while_bootstrapping_releases_at_once(guarded, monkeypatch):
    if not guarded:
        tell_everyone(monkeypatch)
    h = Harness(decode=DEAD_RANK)
    h.prefill.crash()
    h.registry.expire(0, 0)  # its lease ran out: the rank is down, bootstrapping cannot resolve it
    req = h.decode.submit(rid=1, room=1, n_pages=3)
    h.loop.run(until=0.99)
    assert req.state == "Bootstrapping" and h.sent(TransferRequest) == []  # no rank was told
    h.loop.run(until=1.0)  # the timeout aborts it
    assert req.state == FAILED
    h.loop.run()  # ends: nothing keeps the loop alive
    if guarded:
        assert h.decode.stats["released_at_once"] == 1 and h.decode.release_latencies == [0.0]
        assert not h.decode.reqs and len(h.decode.kv.free_pages) == 8 and h.sent(Abort) == []
    else:
        assert h.decode.reqs and h.decode.held_aborted_pages == 3  # held for a rank that never heard of it


def test_cancel_of_a_queued_request_never_announces_it():
    h = Harness(decode=DecodeConfig(num_pages=2))
    h.decode.submit(rid=1, room=1, n_pages=2)
    queued = h.decode.submit(rid=2, room=2, n_pages=2)
    h.decode.abort(queued)
    h.loop.run()
    assert queued not in h.decode.queue and not h.decode.reqs and len(h.decode.kv.free_pages) == 2
    assert {m.room for m in h.sent(TransferRequest)} == {1} and h.decode.stats["released_at_once"] == 1
