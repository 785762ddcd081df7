"""Issue 42, item 5: decode's life comes from the bootstrap registry, so a decode process the OS starts
fresh after a crash (a new ``DecodeNode``, not ``restart``) is fenced like a restarted one: the old life's
writes still in flight are refused by the new memory, its replies are dropped, and prefill resets its
floor for the new life. ``self_counted`` is the code before: a fresh process counted its own lives from 0,
and the same runs then show overwrites and false late rejections."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from layersplit.pd.abort.bootstrap import BootstrapRegistry
from tools.pd_check import CheckBounds
from tools.pd_check.state import fingerprint, unclassified
from tools.pd_check.world import apply, build_world
from layersplit.pd.abort.decode_side import FAILED, SUCCESS, DecodeNode
from layersplit.pd.abort.stress import PDStressConfig, failures, run_pd_stress
from layersplit.pd.abort.transfer_engine import EngineFaults
from tests.layersplit.pd.abort.harness import Harness
from tests.paths import ROOT

SLOW_WRITES = EngineFaults(min_write_s=0.5, max_write_s=0.5)


@pytest.fixture(params=["registry", "self_counted"])
def lives(request, monkeypatch):
    """``registry``: the code as it is. ``self_counted``: the code before — the life counted in the process
    (a restart adds 1), so the count dies with it and a fresh process starts at life 0 again."""
    if request.param == "self_counted":
        crash = DecodeNode.crash

        def crash_and_forget(self) -> None:
            crash(self)
            self.registry._decode_lives.clear()

        monkeypatch.setattr(DecodeNode, "crash", crash_and_forget)
    return request.param


def _fresh_decode(h: Harness) -> DecodeNode:
    """The decode process crashes; the OS starts a new one on the same registry and pages."""
    old = h.decode
    old.crash()
    h.loop.drop_owned((old, old.health))  # the dead process's timers die with it
    h.decode = DecodeNode(h.loop, old.rng, old.cfg, h._from_decode, old.topology, h.registry, h.finished.append,
                          h._fence)
    return h.decode


def test_the_registry_issues_each_worker_rising_lives():
    registry = BootstrapRegistry(1)
    assert registry.decode_life() is None
    assert [registry.register_decode() for _ in range(3)] == [0, 1, 2]
    assert registry.register_decode("other") == 0 and registry.decode_life() == 2


def test_a_fresh_node_and_a_restart_both_take_the_next_life():
    h = Harness()
    assert h.decode.life == 0
    h.decode.restart()
    assert h.decode.life == 1
    assert _fresh_decode(h).life == 2 and h.registry.decode_life() == 2
    with pytest.raises(AssertionError, match="not the registry's newest"):
        DecodeNode(h.loop, h.decode.rng, h.decode.cfg, h._from_decode, h.decode.topology, h.registry,
                   h.finished.append, life=1)


def test_old_life_writes_in_flight_never_land_on_a_fresh_process(lives):
    h = Harness(engine=SLOW_WRITES)
    old = h.decode.submit(rid=1, room=1, n_pages=2)
    h.loop.run(until=0.2)  # posted at ~0.11, landing at ~0.61
    assert h.engines[0].in_flight(lambda owner: True) == 1
    fresh = _fresh_decode(h)
    new = fresh.submit(rid=2, room=2, n_pages=2)  # the fresh process hands out the same pages
    h.loop.run()
    assert old.state == FAILED and old.abort_reason == "decode_restart" and old in h.finished
    assert new.pages == [0, 1]
    if lives == "registry":
        assert fresh.life == 1 and fresh.kv.overwrites == [] and fresh.kv.refused_dead_life == 2
        assert new.state == SUCCESS and fresh.stats["checksum_mismatches"] == 0
        assert h.prefill.stats["decode_lives"] == 1 and h.prefill.stats["orphaned"] == 1
    else:
        assert fresh.life == 0 and fresh.kv.overwrites, "the old life's write landed on the fresh process's pages"


def test_a_fresh_process_requests_are_not_rejected_as_late(lives):
    h = Harness()
    rejected = h.close_epoch_zero()
    third = _fresh_decode(h).submit(rid=3, room=3, n_pages=1)  # the fresh process: epoch 0 again
    h.loop.run()
    assert third.epoch == 0
    if lives == "registry":
        assert rejected == [] and third.state == SUCCESS and h.prefill.stats["rejected_late"] == 0
    else:
        assert 3 in rejected and third.state == FAILED and third.abort_reason == "timeout"


def test_stress_fresh_decode_processes_are_fenced_like_restarts(lives):
    """The abort storm (restarts, drops, slow writes, cancels) with two decode crashes, each followed by a
    fresh DecodeNode on the same registry and pages, and one in-place restart between them."""
    report = run_pd_stress(PDStressConfig(requests=300, seed=0, fresh_decode=(1.5, 3.0), restart_decode=(2.2,),
                                          until_s=60.0))  # self_counted: its lost aborts re-send for ever
    counts = {k: report[k] for k in ("overwrites", "false_late_rejections", "checksum_mismatches",
                                     "dead_life_writes_refused", "old_life_messages", "prefill_stale_decode_life",
                                     "fresh_decodes", "decode_restarts", "decode_life")}
    print(f"\n{lives}: {counts} outcomes={report['outcomes']}")
    assert report["fresh_decodes"] == 2 and report["decode_restarts"] == 1
    if lives == "registry":
        assert failures(report) == [], failures(report)
        assert sum(report["outcomes"].values()) == 300 and report["sim_seconds"] < 60.0  # ended on its own
        assert report["decode_life"] == 3  # 0, fresh 1, restart 2, fresh 3
        assert report["dead_life_writes_refused"] > 0 and report["old_life_messages"] > 0  # there was something to fence
    else:
        assert report["decode_life"] == 0  # 0, fresh 0, restart 1, fresh 0
        assert report["overwrites"] > 0 and report["false_late_rejections"] > 0


def test_the_checker_state_holds_the_registry_life_through_a_decode_restart():
    world = build_world(CheckBounds(prefill_ranks=1, requests=1, faults=1, fault_kinds=("decode_restart",)))
    before = fingerprint(world)
    apply(world, ("decode_restart",))
    c = world.cluster
    assert c.decode.life == c.registry.decode_life() == 1  # the fingerprint hashes decode.life: the registry's
    assert fingerprint(world) != before and unclassified(world) == []


_FRESH_PROCESS = """
import random, sys
from pathlib import Path
from layersplit.pd.abort.decode_side import DecodeConfig, DecodeNode
from tools.pd_real.registry_link import DurableRegistry
from layersplit.pd.abort.sim import EventLoop
from layersplit.pd.abort.topology import PrefillTopology
node = DecodeNode(EventLoop(), random.Random(0), DecodeConfig(num_pages=4), lambda rank, msg: None,
                  PrefillTopology(((0,),)), DurableRegistry(1, Path(sys.argv[1])), lambda req: None)
print(node.life, flush=True)
if sys.argv[2] == "crash":
    import os, signal
    os.kill(os.getpid(), signal.SIGKILL)
"""


def test_real_decode_processes_take_rising_lives_from_the_durable_registry(tmp_path):
    """The real pair's registry (``DurableRegistry``) outlives the decode process hosting it: processes the
    OS starts one after another — the first SIGKILLed — register lives 0, 1, 2 (runs without Mooncake)."""
    printed = []
    for how in ("crash", "exit", "exit"):
        out = subprocess.run([sys.executable, "-c", _FRESH_PROCESS, str(tmp_path), how], capture_output=True,
                             text=True, cwd=ROOT, timeout=60)
        assert out.returncode == (-9 if how == "crash" else 0), out.stderr
        printed.append(int(out.stdout))
    assert printed == [0, 1, 2]
