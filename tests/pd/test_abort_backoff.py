"""Item 4: abort re-sends use capped exponential backoff with jitter and a bound; past the bound the
pages are quarantined (counted, logged once, never freed while a write may land) and a dead peer
cannot keep the event loop alive. Item 9: what makes a stress run fail."""

from __future__ import annotations

import json
import logging
import random

import pytest

from pd.abort_backoff import AbortBackoff
from pd.abort_stress import PDStressConfig, failures, run_pd_stress
from pd.channel import ChannelFaults
from pd.decode_side import DecodeConfig
from pd.messages import Abort
from pd.transfer_engine import EngineFaults
from tests.pd.harness import Harness

BACKOFF = AbortBackoff(first_s=0.05, multiplier=2.0, max_s=0.4, jitter=0.5, max_sends=6)


def test_delays_are_capped_exponential_with_jitter():
    rng = random.Random(0)
    for n, base in [(1, 0.05), (2, 0.1), (3, 0.2), (4, 0.4), (5, 0.4), (1000, 0.4)]:
        delays = [BACKOFF.delay(n, rng) for _ in range(200)]
        assert all(base * 0.5 <= d <= base for d in delays)
        assert max(delays) - min(delays) > base * 0.3  # jittered, not a fixed schedule
    assert BACKOFF.exhausted(6) and not BACKOFF.exhausted(5) and not AbortBackoff(max_sends=None).exhausted(10**6)
    with pytest.raises(ValueError, match="jitter: expected a fraction in \\[0, 1\\), got 1.0"):
        AbortBackoff(jitter=1.0)
    with pytest.raises(ValueError, match="max_sends: expected an integer >= 1 or None, got 0"):
        AbortBackoff(max_sends=0)


def dead_after_announce(backoff: AbortBackoff) -> Harness:
    h = Harness(decode=DecodeConfig(num_pages=8, wait_timeout_s=0.5, abort_backoff=backoff))
    h.decode.submit(rid=1, room=1, n_pages=3)
    h.loop.after(0.05, h.prefill.crash)  # told at ~0.01, dies before computing; never comes back
    return h


def test_dead_peer_quarantines_once_and_the_loop_ends(caplog):
    h = dead_after_announce(BACKOFF)
    with caplog.at_level(logging.WARNING, logger="pd.decode_side"):
        h.loop.run()  # returns: nothing is left to do
    assert h.loop.pending == 0 and h.decode.stats["abort_sends"] == 6
    times = [t for t, _, m in h.to_prefill if isinstance(m, Abort)]
    gaps = [b - a for a, b in zip(times, times[1:])]
    for n, gap in enumerate(gaps, start=1):
        base = min(0.4, 0.05 * 2 ** (n - 1))
        assert base * 0.5 - 1e-9 <= gap <= base + 1e-9, (n, gap)
    assert h.decode.stats["quarantines"] == 1 and h.decode.quarantined_pages == 3
    assert len(h.decode.kv.free_pages) == 5  # held, never freed
    assert sum("quarantined" in r.message for r in caplog.records) == 1


def test_unbounded_resends_never_let_the_loop_end():
    """The guard removed (``max_sends=None``, documented UNSAFE): the dead peer is pinged forever."""
    h = dead_after_announce(AbortBackoff(first_s=0.05, max_s=0.4, jitter=0.5, max_sends=None))
    h.loop.run(until=120.0)
    assert h.loop.pending > 0 and h.decode.stats["abort_sends"] > 200 and h.decode.stats["quarantines"] == 0


@pytest.mark.parametrize("unsafe", [False, True], ids=["guarded", "unsafe_free_at_bound"])
def test_quarantined_pages_are_not_freed_while_a_write_may_land(unsafe):
    """A live rank whose writes hang past the bound: the ack comes only when they land."""
    h = Harness(engine=EngineFaults(min_write_s=10.0, max_write_s=10.0),
                decode=DecodeConfig(num_pages=2, wait_timeout_s=0.5, abort_backoff=BACKOFF, unsafe_free_at_bound=unsafe))
    h.decode.submit(rid=1, room=1, n_pages=2)
    second = h.decode.submit(rid=2, room=2, n_pages=2)  # waits for room 1's pages
    h.loop.run()
    if not unsafe:
        assert h.decode.stats["quarantines"] == h.decode.stats["quarantine_released"] == 2  # both rooms hang
        assert h.decode.kv.overwrites == [] and second.pages  # released by the late ack, then reused safely
    else:
        assert h.decode.stats["quarantined_pages_freed"] == 4 and h.decode.kv.overwrites


KILLED = dict(requests=300, seed=1, kill=((0, 1.0),), restart_mean_s=None, channel=ChannelFaults(drop=0.1))


@pytest.mark.parametrize("unsafe", [False, True], ids=["quarantine", "unsafe_free_at_bound"])
def test_a_dead_rank_fails_the_run_and_the_storm_still_ends(unsafe):
    decode = DecodeConfig(abort_backoff=AbortBackoff(max_sends=5), unsafe_free_at_bound=unsafe)
    report = run_pd_stress(PDStressConfig(**KILLED, decode=decode))
    assert report["prefill_crashes"] == 1 and report["aborts"] > 0
    if not unsafe:
        assert report["quarantines"] > 0 and report["requests_still_held"] == report["quarantines"]
        assert any(f.startswith("requests_still_held=") for f in failures(report))
        assert report["leaked_pages"] == 0  # held, not leaked
    else:
        assert report["quarantined_pages_freed"] > 0 and report["requests_still_held"] == 0
        assert any(f.startswith("quarantined_pages_freed=") for f in failures(report))


def test_cli_exits_non_zero_when_requests_are_still_held(capsys):
    from layersplit.cli.app import main

    assert main(["stress", "pd", "--requests", "200", "--kill-rank", "1@1.0", "--json"]) == 1
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert report["requests_still_held"] > 0 and "requests_still_held" in captured.err
