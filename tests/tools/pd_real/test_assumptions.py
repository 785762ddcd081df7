"""The abort protocol's assumptions about the data and control planes, measured between real processes
on loopback (issue 28, item 4): Mooncake's TCP transport and ZMQ. Each test states the answer it found."""

from __future__ import annotations

import re

import pytest

from tools.pd_real import probes, zmq_order

pytestmark = pytest.mark.timeout(90)


def test_a_no_byte_lands_after_the_batch_is_reported_complete():
    r = probes.after_complete(rounds=3, count=64, page_bytes=64 << 10, watch_s=0.5)
    assert r["status"] == [0, 0, 0], r
    assert r["incomplete_at_report"] == [0, 0, 0], r  # every byte was there when the engine said done
    assert r["changed_after_report"] == [0, 0, 0], r  # and none changed in the next 0.5 s


def test_b_a_dead_writers_bytes_still_land_while_decode_is_stalled():
    """Broken assumption: the writer is SIGKILLed and reaped, yet bytes it had sent (in the kernel's
    socket buffers) land in decode's pages when decode runs again — here 1 s after the death, i.e. for as
    long as decode is stalled. Death of the sender alone does not end its writes."""
    r = probes.after_kill(count=1024, page_bytes=64 << 10, stall_s=1.0, watch_s=1.0)
    assert r["warm_status"] == 0 and r["unread_bytes_at_kill"] >= 64 << 10, r
    assert r["landed_at_death"] < r["pages"], r  # the batch was cut short by the kill
    assert r["pages_changed_after_death"] > 0, r
    assert r["last_change_s_after_death"] >= 1.0, r


@pytest.mark.slow
def test_b_deregistration_on_resume_is_a_fence_for_release():
    """The same stall and kill, and decode deregisters its pages as its first act on resuming: the dead
    writer's buffered bytes may land before the deregistration returns, but none lands after it — so
    decode may release the pages once the deregistration returned (observed here; not a proof)."""
    r = probes.after_kill(count=1024, page_bytes=64 << 10, stall_s=0.5, watch_s=1.0, fence=True)
    assert r["unread_bytes_at_kill"] >= 64 << 10 and r["fence"]["deregister_rc"] == 0, r
    assert r["fence"]["pages_changed_after_fence"] == 0, r


def test_c_a_write_to_deregistered_memory_is_refused():
    r = probes.after_deregister(count=16, page_bytes=64 << 10)
    assert r["deregister_rc"] == 0, r
    assert r["write_status"] < 0, r  # the batch fails ...
    assert r["pages_changed"] == 0 and r["landed"] == 0, r  # ... no byte lands ...
    assert r["decode_alive"], r  # ... and decode does not crash


def test_c_a_write_to_reregistered_memory_lands():
    """Registration fences by address only: once the range is registered again (for another request),
    a write aimed at the old registration lands — re-registration is no fence."""
    r = probes.after_deregister(count=16, page_bytes=64 << 10, reregister=True)
    assert (r["deregister_rc"], r["reregister_rc"], r["write_status"]) == (0, 0, 0), r
    assert r["landed"] == 16, r


@pytest.mark.parametrize("pattern", ["push", "dealer"])
def test_d_zmq_keeps_order_per_connection(pattern):
    r = zmq_order.order(pattern, count=20000)
    assert r["received"] == 20000 and not r["timed_out"], r
    assert (r["out_of_order"], r["duplicates"], r["gaps"]) == (0, 0, 0), r


@pytest.mark.parametrize("pattern", ["push", "dealer"])
def test_d_a_killed_senders_messages_arrive_after_its_successors(pattern):
    """Order holds per incarnation, but messages of a SIGKILLed sender that were already on the wire are
    all delivered, interleaved after the first message of its restarted successor: a receiver must tell
    incarnations apart by a tag in the message, never by arrival order."""
    r = zmq_order.order(pattern, count=3000, kill_first_after=500)
    assert r["first_killed"] and not r["timed_out"], r
    assert r["per_incarnation"] == {"1": 3000, "2": 3000} and r["received"] == 6000, r  # nothing lost
    assert (r["out_of_order"], r["duplicates"], r["gaps"]) == (0, 0, 0), r
    assert r["old_after_new"] > 0, r


def test_the_probe_command_names_its_choices(capsys):
    from tools.pd_real.cli import main

    assert main(["probes", "z"]) == 2
    assert re.search(r"NAME: expected any of \['a', 'a-timeout', 'b'.*got \['z'\]", capsys.readouterr().err)
