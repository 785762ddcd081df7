"""Short abort storms on real parts: decode and two prefill ranks as OS processes, Mooncake TCP for the
KV, ZMQ through the fault proxy for control, the protocol's own nodes. With SIGKILLs (a prefill rank,
decode), drops, delays and a partition the safe protocol shows no overwrite, stale read, leak or held
page; the legacy immediate release over the same transport is caught by the landing checker."""

from __future__ import annotations

import pytest

from layersplit.pd.abort.decode_side import DecodeConfig
from tools.pd_real.process import RealRun
from tools.pd_real.storm import StormFaults, failures, run_real_storm
from layersplit.pd.abort.stress_config import PDStressConfig
from layersplit.pd.abort.topology import PrefillTopology

pytestmark = pytest.mark.timeout(120)
FAULTS = StormFaults(drop=0.05, max_delay_s=0.01, restart_after_s=1.0, timeout_s=90)


def _storm(tmp_path, fence_after_s=30.0, fence_unreachable_s=None, **kw):
    cfg = PDStressConfig(requests=200, seed=kw.pop("seed", 1), topology=PrefillTopology(((0,), (1,))),
                         restart_mean_s=None, **kw,
                         decode=DecodeConfig(fence_after_s=fence_after_s, fence_unreachable_s=fence_unreachable_s))
    report = run_real_storm(RealRun(cfg), FAULTS, tmp_path / "storm")
    assert report["malformed_frames"] == report["refused_frames"] == 0, report  # every frame of the pair's is taken
    return report


def _events(report):
    return [(e["event"], e.get("process", e.get("endpoint"))) for e in report["faults"]]


@pytest.mark.slow
def test_kills_a_partition_and_drops_leave_no_overwrite_leak_or_held_page(tmp_path):
    report = _storm(tmp_path, kill=((1, 0.8),), partition=((0, 2.0, 0.5),), restart_decode=(2.4,))
    assert failures(report) == [], report
    assert report["final_outcomes"] == 200 and report["outcomes"]["success"] > 100
    assert _events(report) == [("start", "decode-l0"), ("ready", "decode-l0"), ("sigkill", "prefill1-i0"),
                               ("start", "prefill1-i1"), ("partition", "prefill0"), ("sigkill", "decode-l0"),
                               ("start", "decode-l1")]
    first, second = report["lives"]
    assert 0 < second["pending_at_start"] < 200  # life 1 submits again what life 0 left without an outcome
    assert report["prefill_stats"]["decode_lives"] >= 2  # both ranks heard of the new life
    assert report["proxy"]["dropped"] > 0 and report["proxy"]["cut"] > 0
    assert report["prefill_ranks_dead_at_end"] == 0  # every rank's last process ended and said so
    assert report["landing"]["pages_read"] > 500
    # No assertion that writes failed at the kills: whether one is in flight at a SIGKILL is timing (a
    # clean-clone CI run met 0 engine errors); what matters, no late write on a released page, is failures().


@pytest.mark.slow
def test_a_rank_down_past_its_lease_is_fenced_by_deregistration(tmp_path):
    report = _storm(tmp_path, fence_after_s=1.0, outage=((1, 1.0, 4.0),))
    assert failures(report) == [], report
    assert report["fences"] == 1 and report["released_by_fence"] > 0
    assert report["memory"] == {"deregistrations": 1, "reregistrations": 1}  # fenced, re-admitted as i1
    assert report["registry"]["expiries"] == 1 and report["final_outcomes"] == 200


@pytest.mark.slow
def test_a_partitioned_rank_that_holds_its_lease_is_fenced_as_unreachable_and_comes_back_new(tmp_path):
    """The proxy cuts rank 1's control link for 4 s; its heartbeats still reach the bootstrap server, so
    its lease never expires. With the unreachable fence at 1 s decode deregisters its regions, the
    server answers its next heartbeat *revoked*, the process exits and a new incarnation serves."""
    report = _storm(tmp_path, fence_unreachable_s=1.0, partition=((1, 1.0, 4.0),))
    assert failures(report) == [], report
    assert report["unreachable_fences"] >= 1 and report["fences"] == report["unreachable_fences"]
    assert report["registry"]["expiries"] == 0 and report["registry"]["revoked_sent"] >= 1  # the lease held
    assert ("revoked_exit", "prefill1-i0") in _events(report) and report["memory"]["deregistrations"] >= 1
    assert report["final_outcomes"] == 200


# The freeze: rank 1 frozen 2.5 s into the storm for 5 s, its control link cut for 5.5 s, so no abort reaches
# it and, when it runs again, the forwards it was running finish and post before its heartbeat is answered
# revoked. The pool is larger than the 200 requests ever ask for, so no released page is handed out again
# and a byte written on one after its release is still there when decode's scan looks (with pages reused,
# the new owner's own write can erase that evidence first); arrivals span ~10 s, so the run outlasts the
# freeze and the revoked exit. Not earlier: on a loaded machine the pair's first transfers took ~1.7 s
# (a clean-clone CI run froze rank 1 at 1.0 s before it had posted anything: no late write to find).
FROZEN = dict(requests=200, seed=1, topology=PrefillTopology(((0,), (1,))), restart_mean_s=None,
              mean_arrival_s=0.05, lease_loss=((1, 2.5, 5.0),), partition=((1, 2.5, 5.5),),
              decode=DecodeConfig(fence_after_s=1.0, num_pages=4096))


@pytest.mark.slow
def test_a_frozen_rank_past_its_lease_is_fenced_and_exits_revoked_when_it_runs_again(tmp_path):
    """SIGSTOP rank 1 for 5 s (its link cut too): its heartbeats starve, the lease (2 s) expires while the
    process lives, decode fences it 1 s later by deregistration and releases its pages; on SIGCONT what it
    posts fails (its regions are gone), its heartbeat is answered *revoked*, it exits, a new incarnation
    serves — and nothing it had in flight lands on a released page."""
    report = run_real_storm(RealRun(PDStressConfig(**FROZEN)), FAULTS, tmp_path / "storm")
    assert failures(report) == [], report
    events = _events(report)
    assert events.index(("sigstop", "prefill1-i0")) < events.index(("sigcont", "prefill1-i0")) \
        < events.index(("revoked_exit", "prefill1-i0"))
    assert report["registry"]["expiries"] >= 1 and report["registry"]["revoked_sent"] >= 1
    assert report["fences"] >= 1 and report["unreachable_fences"] == 0 and report["memory"]["deregistrations"] >= 1
    assert report["released_by_fence"] > 0 and report["final_outcomes"] == 200
    # Whether the frozen rank posts at all after the fence (then its batches fail: engine errors) depends on
    # whether one of its forwards finishes before its heartbeat is answered revoked: timing, not the protocol
    # (a clean-clone CI run met 0). That such writes exist and land without the fence is the test below;
    # here failures() holds them to 0 late writes and 0 overwrites either way.


@pytest.mark.slow
def test_with_the_fence_kept_registered_the_frozen_ranks_writes_land_on_released_pages(tmp_path):
    """The teeth of the test above: the same freeze with ``fence-refuses-writes`` off (UNSAFE: decode fences
    by record only and keeps the rank's regions registered). Decode still releases what the rank was told;
    when the rank runs again, the writes its finished forwards post land on those released pages."""
    run = RealRun(PDStressConfig(**FROZEN), guards_off=("fence-refuses-writes",))
    report = run_real_storm(run, FAULTS, tmp_path / "storm")
    assert report["guards_off"] == ["fence-refuses-writes"] and report["unsafe_fences_kept_registered"] >= 1
    assert report["memory"]["deregistrations"] == 0 and report["released_by_fence"] > 0
    assert report["landing"]["late_writes_on_free_pages"] > 0, report  # the fenced writer's bytes, found
    assert all(e["owner"] is None for e in report["overwrite_log"] if e["kind"] == "late_writes_on_free_pages")


@pytest.mark.slow
def test_a_rank_killed_for_good_is_fenced_and_nothing_is_held_at_the_end(tmp_path):
    """SIGKILL rank 1 and never restart it: its lease lapses (2 s), decode fences it 1 s later by
    deregistration and releases what it was told; every request still ends, and nothing is held."""
    cfg = PDStressConfig(requests=200, seed=1, topology=PrefillTopology(((0,), (1,))), restart_mean_s=None,
                         kill=((1, 1.0),), decode=DecodeConfig(fence_after_s=1.0))
    faults = StormFaults(drop=0.05, max_delay_s=0.01, restart_after_s=None, timeout_s=90)
    report = run_real_storm(RealRun(cfg), faults, tmp_path / "storm")
    assert failures(report) == [], report
    assert _events(report) == [("start", "decode-l0"), ("ready", "decode-l0"), ("sigkill", "prefill1-i0")]
    assert report["prefill_ranks_dead_at_end"] == 1 and report["registry"]["expiries"] == 1
    assert report["fences"] == 1 and report["released_by_fence"] > 0
    assert report["memory"] == {"deregistrations": 1, "reregistrations": 0}
    assert report["final_outcomes"] == 200 and report["pages_held_at_end"] == 0
    assert report["quarantined_pages_at_end"] == 0 and report["abort_to_release_s"]["max"] < 5.0  # lease + fence


def test_a_restart_delay_is_seconds_or_never():
    with pytest.raises(ValueError, match="restart_after_s: expected seconds >= 0 or None"):
        StormFaults(restart_after_s=-1.0)


@pytest.mark.slow
def test_the_legacy_immediate_release_is_caught_on_real_memory(tmp_path):
    report = _storm(tmp_path, legacy_immediate_release=True, kill=((1, 1.0),))
    assert report["overwrites"] > 0, report  # late writes of aborted requests on released pages
    writers = {tuple(e["writer"]) for e in report["overwrite_log"] if e["writer"]}
    owners = {tuple(e["owner"]) for e in report["overwrite_log"] if e["owner"]}
    assert writers and not writers & owners  # each named the request that wrote it, never the page's owner
    assert report["acks"] == 0  # the legacy release waits for nothing


@pytest.mark.parametrize("flag", [["--duplicate", "0.1"], ["--misaddress", "0.1"], ["--restart-mean-s", "5"]],
                         ids=lambda f: f[0])
def test_the_tool_refuses_simulation_only_faults_on_the_real_pair(flag, capsys):
    from tools.pd_real.cli import main

    assert main(["storm", *flag]) == 2
    assert f"{flag[0]}: expected it only with layersplit stress pd" in capsys.readouterr().err


def test_the_tool_names_a_bad_restart_delay(capsys):
    from tools.pd_real.cli import main

    assert main(["storm", "--restart-after-s", "soon"]) == 2
    assert "argument --restart-after-s: expected seconds in [0, 1e+06] or never, got 'soon'" in capsys.readouterr().err


def test_the_tool_refuses_a_simulation_only_guard_on_the_real_pair(capsys):
    from tools.pd_real.cli import main

    assert main(["storm", "--guard-off", "owners-only"]) == 2
    assert ("--guard-off: expected fence-refuses-writes on real processes (the other guards are "
            "simulation-only), got 'owners-only'") in capsys.readouterr().err
    with pytest.raises(ValueError, match="guards_off: expected some of fence-refuses-writes"):
        RealRun(PDStressConfig(requests=1), guards_off=("owners-only",))


@pytest.mark.slow
def test_the_tool_runs_a_small_real_storm(tmp_path, capsys):
    import json

    from tools.pd_real.cli import main

    assert main(["storm", "--requests", "60", "--kill-rank", "0@0.5",
                 "--out", str(tmp_path / "run"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["final_outcomes"] == 60 and report["layers_by_rank"] == [[0], [1]]
    assert (tmp_path / "run" / "report.json").exists() and (tmp_path / "run" / "outcomes.jsonl").exists()
