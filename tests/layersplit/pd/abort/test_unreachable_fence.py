"""A cut control link (a partition): the rank keeps its bootstrap lease, so the lease path never fences
it, and without a policy decode holds every aborted request's pages until the link heals (up to the
whole pool). With ``fence_unreachable_s`` decode fences a rank that left an abort unacknowledged that
long *and sent nothing at all* meanwhile: its writes are refused from then on, the pages are released,
and the process, told *revoked* at its next heartbeat, comes back as a new incarnation. A rank that is
only slow to drain (it still answers other rooms) is never fenced."""

from __future__ import annotations

import pytest

from layersplit.pd.abort.channel import ChannelFaults
from layersplit.pd.abort.decode_side import DecodeConfig
from layersplit.pd.abort.guards import guards_off
from layersplit.pd.abort.stress import failures, run_pd_stress
from layersplit.pd.abort.stress_config import PDStressConfig
from layersplit.pd.abort.topology import PrefillTopology
from layersplit.pd.abort.transfer_engine import EngineFaults

PARTITION_S = 30.0


def _storm(fence_s: float | None, partition: bool = True, seed: int = 5) -> dict:
    # slow writes (3 s, longer than the 2 s policy) on every rank: a rank still draining must not look cut
    return run_pd_stress(PDStressConfig(
        requests=600, seed=seed, restart_mean_s=None, topology=PrefillTopology(((0, 1), (2, 3))),
        partition=((1, 3.0, PARTITION_S),) if partition else (), decode=DecodeConfig(fence_unreachable_s=fence_s),
        engine=EngineFaults(slow_write=0.3, slow_write_s=3.0), channel=ChannelFaults(drop=0.05)))


def test_without_the_policy_a_partition_holds_pages_until_it_heals():
    report = _storm(None)
    outage = report["outages"][0]
    assert failures(report) == [] and report["unreachable_fences"] == 0 and report["fences"] == []
    assert outage["held_at_heal_pages"] > 0 and outage["longest_abort_hold_s"] >= PARTITION_S - 3.0


def test_an_unreachable_rank_is_fenced_its_writes_refused_and_it_comes_back_new():
    report = _storm(2.0)
    outage = report["outages"][0]
    assert failures(report) == []
    assert report["unreachable_fences"] > 0 and {f["rank"] for f in report["fences"]} == {1}  # never the drainer
    assert report["revoked_exits"] == report["unreachable_fences"]  # each fenced process heard revoked and exited
    assert report["fenced_writes_refused"] > 0 and report["fenced_writes_landed"] == 0
    assert outage["longest_abort_hold_s"] < 2.0 + 3.0 + 1.0  # the policy + one slow drain + re-send slack
    assert report["pages_held_at_end"] == 0 and report["requests_still_held"] == 0


def test_without_the_engine_fence_the_unreachable_rank_overwrites_released_pages():
    with guards_off(("fence-refuses-writes",)):
        report = _storm(2.0)
    assert report["fenced_writes_landed"] > 0 and report["overwrites"] > 0  # the teeth of the test above


def test_a_rank_slow_to_drain_but_heard_from_is_not_fenced():
    report = _storm(2.0, partition=False)
    assert failures(report) == [] and report["unreachable_fences"] == 0 and report["fences"] == []


def test_the_policy_takes_seconds_above_zero():
    with pytest.raises(ValueError, match=r"fence_unreachable_s: expected seconds > 0 \(or None: never\), got 0"):
        DecodeConfig(fence_unreachable_s=0)
