"""PD abort safe-release: storms with each fault kind, scripted stale-ack / late-error / timeout
paths, and the legacy immediate release reproducing the overwrite race."""

from __future__ import annotations

import random

import pytest

from pd.abort_stress import PDStressConfig, run_pd_stress
from pd.channel import ChannelFaults, ControlChannel
from pd.decode_side import FAILED, DecodeConfig, DecodeNode
from pd.messages import AbortAck
from pd.prefill_side import PrefillConfig, PrefillNode
from pd.sim import EventLoop
from pd.transfer_engine import EngineFaults, TransferEngine, WriteTag

QUIET = ChannelFaults()  # delays only

FAULTS = {
    "drop": ChannelFaults(drop=0.2),
    "duplicate": ChannelFaults(duplicate=0.3),
    "delay": ChannelFaults(min_delay_s=0.0, max_delay_s=0.4),  # a round trip may take most of the timeout
    "cross-endpoint-reorder": ChannelFaults(min_delay_s=0.0, max_delay_s=0.3),  # FIFO per pair only
}


def clean(report: dict) -> None:
    assert report["overwrites"] == 0, "a write landed on a page owned by someone else"
    assert report["checksum_mismatches"] == 0 and report["leaked_pages"] == 0
    assert report["requests_still_held"] == 0


@pytest.mark.parametrize("fault", list(FAULTS))
def test_each_fault_kind_keeps_pages_safe(fault):
    cfg = PDStressConfig(requests=600, seed=3, channel=FAULTS[fault], prefill_peers=3 if "reorder" in fault else 2)
    report = run_pd_stress(cfg)
    clean(report)
    assert report["aborts"] > 0 and report["success"] > 0
    if fault == "drop":
        assert report["channel"]["dropped"] > 0 and report["abort_resends"] > 0  # lost aborts were re-sent
    if fault == "duplicate":
        assert report["channel"]["duplicated"] > 0 and report["stale_acks_ignored"] > 0
        assert report["late_transfers_rejected"] > 0  # re-sent transfer requests hit a tombstone


@pytest.mark.parametrize("fault", list(FAULTS))
def test_legacy_release_reproduces_the_race(fault):
    report = run_pd_stress(PDStressConfig(requests=600, seed=3, channel=FAULTS[fault], legacy_immediate_release=True))
    assert report["overwrites"] > 0


def test_storm_all_faults_short():
    clean(run_pd_stress(PDStressConfig(requests=2000, seed=0)))
    assert run_pd_stress(PDStressConfig(requests=2000, seed=0, legacy_immediate_release=True))["overwrites"] > 0


# scripted paths ------------------------------------------------------------------------------------


class Harness:
    """One decode node and one prefill peer with fixed delays (no randomness that matters)."""

    def __init__(self, engine: EngineFaults = EngineFaults(min_write_s=0.01, max_write_s=0.01),
                 prefill: PrefillConfig = PrefillConfig(min_compute_s=0.1, max_compute_s=0.1),
                 decode: DecodeConfig = DecodeConfig(num_pages=8, wait_timeout_s=1.0), dead_peer: bool = False):
        self.loop = EventLoop()
        self.channel = ControlChannel(self.loop, random.Random(0), ChannelFaults(min_delay_s=0.001, max_delay_s=0.001))
        self.finished = []
        self.decode = DecodeNode(self.loop, random.Random(1), decode,
                                 lambda peer, msg: self.channel.send("decode", "prefill0", msg),
                                 lambda rid: (0,), self.finished.append)
        self.landed = []
        self.engine = TransferEngine(self.loop, random.Random(2), self._land, engine)
        self.prefill = PrefillNode(0, self.loop, random.Random(3), prefill, self.engine,
                                   lambda msg: self.channel.send("prefill0", "decode", msg))
        self.sent_by_prefill = []
        self.channel.register("decode", self._to_decode)
        self.channel.register("prefill0", (lambda msg: None) if dead_peer else self.prefill.handle)

    def _land(self, page, tag, payload):
        self.landed.append(self.loop.now)
        self.decode.kv.land(page, tag, payload)

    def _to_decode(self, msg):
        self.sent_by_prefill.append((self.loop.now, msg))
        self.decode.handle(msg)


def test_stale_ack_of_a_reused_request_id_releases_nothing():
    h = Harness(prefill=PrefillConfig(min_compute_s=5.0, max_compute_s=5.0))  # never in time
    h.decode.submit(rid=7, room=1, n_pages=2)
    h.loop.run(until=1.5)  # timed out, aborted, acked
    first = h.decode.stats["acks"]
    old_token = [m for _, m in h.sent_by_prefill if isinstance(m, AbortAck)][0].token
    h.decode.submit(rid=7, room=2, n_pages=2)  # the router retries rid 7 as a new incarnation
    h.loop.run(until=2.0)
    req = h.decode.reqs[2]
    h.decode.abort(req)  # aborted; its acks are still in flight
    free_before = len(h.decode.kv.free_pages)
    h.decode.handle(AbortAck(7, 1, old_token, 0))  # a stale ack: the earlier incarnation's room
    h.decode.handle(AbortAck(7, 2, old_token, 0))  # the right room with another abort's token
    assert len(h.decode.kv.free_pages) == free_before and 2 in h.decode.reqs
    assert h.decode.stats["stale_acks"] == 2 and first == 1
    h.loop.run(until=3.0)  # the real ack arrives
    assert 2 not in h.decode.reqs and len(h.decode.kv.free_pages) == 8


def test_error_reported_while_writes_still_land():
    """The batch reports failure first; prefill must ack only after the data stopped landing."""
    h = Harness(engine=EngineFaults(min_write_s=0.5, max_write_s=0.5, error=1.0))
    h.decode.submit(rid=1, room=1, n_pages=4)
    h.loop.run()
    acks = [t for t, m in h.sent_by_prefill if isinstance(m, AbortAck)]
    assert h.engine.stats["errors"] >= 1 and h.decode.stats["aborts"] == 1
    assert acks and acks[0] >= max(h.landed), "ack sent before every posted write landed"
    assert not h.decode.kv.overwrites and len(h.decode.kv.free_pages) == 8


def test_timeout_aborts_and_late_compute_never_writes():
    h = Harness(prefill=PrefillConfig(min_compute_s=2.0, max_compute_s=2.0))
    h.decode.submit(rid=1, room=1, n_pages=3)
    h.loop.run()
    assert h.finished[0].state == FAILED and h.decode.stats["aborts"] == 1
    assert h.landed == [] and len(h.decode.kv.free_pages) == 8  # the tombstone stopped the posting


def test_unacknowledged_pages_are_quarantined_never_freed(caplog):
    h = Harness(decode=DecodeConfig(num_pages=8, wait_timeout_s=0.5, abort_retry_s=0.2, release_deadline_s=1.0),
                dead_peer=True)
    h.decode.submit(rid=1, room=1, n_pages=3)
    h.loop.run(until=10.0)
    assert h.decode.stats["quarantines"] == 1 and h.decode.quarantined_pages == 3
    assert len(h.decode.kv.free_pages) == 5 and h.decode.stats["abort_sends"] > 10
    assert "quarantined" in caplog.text


def test_legacy_race_in_one_script():
    """Free on abort: the page goes to the next request, then the old write lands on it."""
    h = Harness(engine=EngineFaults(min_write_s=1.5, max_write_s=1.5),
                decode=DecodeConfig(num_pages=2, wait_timeout_s=1.0, legacy_immediate_release=True))
    h.decode.submit(rid=1, room=1, n_pages=2)
    h.loop.run(until=1.2)  # timed out and freed at 1.0; writes posted at 0.1 land at 1.6
    h.decode.submit(rid=2, room=2, n_pages=2)
    h.loop.run()
    assert h.decode.kv.overwrites and h.decode.kv.overwrites[0][1] == WriteTag(1, h.decode.kv.overwrites[0][1].generation)


def test_channel_is_fifo_per_endpoint():
    loop, got = EventLoop(), []
    ch = ControlChannel(loop, random.Random(0), ChannelFaults(min_delay_s=0.0, max_delay_s=1.0))
    ch.register("b", got.append)
    for i in range(200):
        ch.send("a", "b", i)
    loop.run()
    assert got == list(range(200))
    with pytest.raises(ValueError, match="drop: expected a probability in \\[0, 1\\), got 1.5"):
        ChannelFaults(drop=1.5)


def test_cli(capsys):
    import json

    from layersplit.cli import main

    assert main(["stress", "pd", "--requests", "300", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["overwrites"] == 0 and "simulation" in report["note"]
    assert main(["stress", "pd", "--requests", "300", "--legacy-immediate-release", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["overwrites"] > 0
