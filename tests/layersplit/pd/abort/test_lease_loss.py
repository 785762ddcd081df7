"""A false suspicion: a live prefill rank's lease expires (heartbeats starved or cut from the bootstrap
server). Past ``fence_after_s`` decode fences a writer that is still running: its writes in flight are
refused, its pages released, and when its heartbeat comes back the server answers revoked, the process
exits and a new incarnation serves. Shorter than that, the lease is renewed and nothing is fenced."""

from __future__ import annotations

import pytest

from layersplit.pd.abort.channel import ChannelFaults
from layersplit.pd.abort.decode_side import DecodeConfig
from layersplit.pd.abort.guards import guards_off
from layersplit.pd.abort.stress import failures, run_pd_stress
from layersplit.pd.abort.stress_config import PDStressConfig
from layersplit.pd.abort.topology import PrefillTopology
from layersplit.pd.abort.transfer_engine import EngineFaults


def _storm(seconds: float, seed: int = 5) -> dict:
    return run_pd_stress(PDStressConfig(
        requests=600, seed=seed, restart_mean_s=None, topology=PrefillTopology(((0, 1), (2, 3))),
        lease_loss=((1, 3.0, seconds),), decode=DecodeConfig(fence_after_s=0.5),
        engine=EngineFaults(slow_write=0.3, slow_write_s=3.0), channel=ChannelFaults(drop=0.05)))


def test_a_live_writer_fenced_on_a_false_suspicion_lands_nothing_and_exits_when_revoked():
    report = _storm(seconds=6.0)
    assert failures(report) == []
    assert report["leases_lost"] == 1 and [(f["rank"], f["incarnation"]) for f in report["fences"]] == [(1, 0)]
    assert report["fenced_writes_refused"] > 0  # the live writer's writes in flight were refused where they land
    assert report["revoked_exits"] == 1  # its heartbeat came back after the fence: revoked, exit, new incarnation
    assert report["pages_held_at_end"] == 0 and report["requests_still_held"] == 0


def test_without_the_fence_the_live_writer_overwrites_released_pages():
    with guards_off(("fence-refuses-writes",)):
        report = _storm(seconds=6.0)
    assert report["fenced_writes_landed"] > 0 and report["overwrites"] > 0  # the teeth of the test above


def test_a_lease_lost_for_less_than_the_fence_delay_is_renewed():
    report = _storm(seconds=0.3)
    assert failures(report) == []
    assert report["leases_lost"] == 1 and report["fences"] == [] and report["revoked_exits"] == 0


def test_lease_loss_names_a_rank_of_the_topology():
    with pytest.raises(ValueError, match="lease_loss: expected ranks in"):
        PDStressConfig(topology=PrefillTopology(((0,), (1,))), lease_loss=((2, 1.0, 1.0),))
