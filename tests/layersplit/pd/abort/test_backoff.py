"""Abort re-sends use capped exponential backoff with jitter; past the bound the request is quarantined
(counted, logged once, never freed while a write may land) and the re-sends go on at the cap, pause
while the rank's lease is expired and resume when it registers again (issue 25: quarantine heals); a
dead rank is fenced and released. What makes a stress run fail."""

from __future__ import annotations

import json
import logging
import random

import pytest

from layersplit.pd.abort.backoff import AbortBackoff
from layersplit.pd.abort.stress import PDStressConfig, failures, run_pd_stress
from layersplit.pd.abort.channel import ChannelFaults
from layersplit.pd.abort.decode_side import DecodeConfig
from layersplit.pd.abort.messages import Abort
from layersplit.pd.abort.transfer_engine import EngineFaults
from tests.layersplit.pd.abort.harness import Harness

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


def dead_after_announce(backoff: AbortBackoff, **decode) -> Harness:
    h = Harness(decode=DecodeConfig(num_pages=8, wait_timeout_s=0.5, abort_backoff=backoff, **decode))
    h.decode.submit(rid=1, room=1, n_pages=3)
    h.loop.after(0.05, h.prefill.crash)  # told at ~0.01, dies before computing; never comes back
    return h


def test_dead_peer_quarantines_once_pauses_when_its_lease_expires_and_the_fence_releases(caplog):
    h = dead_after_announce(BACKOFF, fence_after_s=5.0)
    with caplog.at_level(logging.WARNING, logger="layersplit.pd.abort.decode_side"):
        h.loop.run()  # returns: the fence released the pages, nothing is left to do
    times = [t for t, _, m in h.to_prefill if isinstance(m, Abort)]
    gaps = [b - a for a, b in zip(times, times[1:])]
    for n, gap in enumerate(gaps, start=1):
        base = min(0.4, 0.05 * 2 ** (n - 1))
        assert base * 0.5 - 1e-9 <= gap <= base + 1e-9, (n, gap)  # capped backoff, also past the bound
    lease_expired = 0.05 + h.prefill.cfg.lease_s
    assert times[-1] < lease_expired + 0.4 and len(times) > 6  # re-sent past the bound until the lease expired
    assert h.decode.stats["quarantines"] == 1 and sum("quarantined" in r.message for r in caplog.records) == 1
    assert h.decode.fences == [(0, 0, pytest.approx(lease_expired + 5.0))] and h.engines[0].fenced_upto == 0
    assert not h.decode.reqs and len(h.decode.kv.free_pages) == 8 and h.loop.pending == 0


def test_terminal_quarantine_holds_the_pages_for_ever():
    """The liveness fix off (``unsafe_terminal_quarantine``, documented UNSAFE, and no fence): the old
    behaviour — 6 sends, then nothing ever re-arms them; the pages are held for ever."""
    h = dead_after_announce(BACKOFF, unsafe_terminal_quarantine=True, fence_after_s=None)
    h.loop.run()
    assert h.loop.pending == 0 and h.decode.stats["abort_sends"] == 6 and h.decode.quarantined_pages == 3
    h.prefill.restart()  # even a new process of the rank does not release them
    h.loop.run()
    assert h.decode.quarantined_pages == 3 and len(h.decode.kv.free_pages) == 5


@pytest.mark.parametrize("fixed", [True, False], ids=["heals", "terminal_quarantine"])
def test_a_long_restart_heals_when_the_rank_registers_again(fixed):
    """Down 30 s (past the re-send bound), no fence: the new process's registration resumes the re-sends."""
    h = dead_after_announce(BACKOFF, fence_after_s=None, unsafe_terminal_quarantine=not fixed)
    h.loop.after(30.0, h.prefill.restart)
    h.loop.run()
    assert h.decode.stats["quarantines"] == 1
    if fixed:
        release = h.decode.releases[0][0]
        assert h.decode.stats["resumed_sends"] == 1 and 30.0 < release < 30.01  # one round trip after the heal
        assert not h.decode.reqs and h.decode.kv.overwrites == []
    else:
        assert h.decode.quarantined_pages == 3  # held for ever


def test_unbounded_resends_never_let_the_loop_end():
    """A rank whose lease never expires and never answers (its control link cut): re-sends go on at
    the cap (the liveness fix) — never faster, and the loop stays alive until the link heals."""
    h = dead_after_announce(AbortBackoff(first_s=0.05, max_s=0.4, jitter=0.5, max_sends=None))
    h.registry.expire = lambda rank, incarnation: None  # a partition: the rank keeps its lease
    h.loop.run(until=120.0)
    assert h.loop.pending > 0 and 200 < h.decode.stats["abort_sends"] < 120 / 0.2 + 10
    assert h.decode.stats["quarantines"] == 0


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


@pytest.mark.parametrize("fence", [True, False], ids=["fenced", "never_fenced"])
def test_a_dead_rank_is_fenced_and_released(fence):
    decode = DecodeConfig(abort_backoff=AbortBackoff(max_sends=5), fence_after_s=10.0 if fence else None)
    report = run_pd_stress(PDStressConfig(**KILLED, decode=decode))
    assert report["prefill_crashes"] == 1 and report["aborts"] > 0 and report["leaked_pages"] == 0
    if fence:
        assert [f["rank"] for f in report["fences"]] == [0] and report["kills"][0]["fenced_after_s"] == 12.0
        assert report["requests_still_held"] == 0 and failures(report) == [], failures(report)
        assert report["fenced_writes_landed"] == 0
    else:
        assert report["requests_still_held"] > 0  # held for ever: the outage of issue 25
        assert any(f.startswith("requests_still_held=") for f in failures(report))


def test_unfenced_release_lets_a_dead_writer_overwrite():
    """The fence guard off (the engine no longer refuses a fenced process's writes): releasing after
    the fence lets a write still in flight land on reused pages."""
    from layersplit.pd.abort.guards import guards_off

    engine = EngineFaults(slow_write=0.3, slow_write_s=30.0)
    cfg = PDStressConfig(requests=400, seed=2, kill=((0, 2.0),), restart_mean_s=None, engine=engine,
                         decode=DecodeConfig(fence_after_s=1.0))
    safe = run_pd_stress(cfg)
    assert safe["fenced_writes_refused"] > 0 and failures(safe) == [], failures(safe)
    with guards_off(["fence-refuses-writes"]):
        unsafe = run_pd_stress(cfg)
    assert unsafe["fenced_writes_landed"] > 0 and unsafe["overwrites"] > 0


def test_cli_exits_non_zero_when_requests_are_still_held(capsys):
    from layersplit.cli.app import main

    assert main(["stress", "pd", "--requests", "200", "--kill-rank", "1@1.0", "--fence-after-s", "0", "--json"]) == 1
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert report["requests_still_held"] > 0 and "requests_still_held" in captured.err
    assert main(["stress", "pd", "--requests", "200", "--kill-rank", "1@1.0", "--json"]) == 0  # fenced, released
    assert json.loads(capsys.readouterr().out)["pages_held_at_end"] == 0
