"""The loopback transport and the one-device link-overlap measurement (:mod:`layersplit.gpu_check.link_overlap`),
on the emulated runtime: the transport moves the right bytes into the right buffers and occupies the
right stream for the modelled time; the spin calibration recovers a known rate; ``measure`` passes for
the real schedules and fails when the overlapped schedule is legacy in disguise (the teeth); the engine
stays clean under the stream sanitizer with the loopback transport."""

from __future__ import annotations

import dataclasses
import json
import time

import pytest
import torch
import torch.distributed as dist

from hicache.runtime.streams import get_runtime
from layersplit.engine.comm import CPComm, Link, LoopbackTransport
from layersplit.engine.engine import SCHEDULES, FaultInjection, RankEngine
from layersplit.engine.requests import synthetic_requests
from layersplit.engine.trace import Tracer
from layersplit.gpu_check import link_overlap
from layersplit.plan.config import load_model

SLOW = Link(bytes_per_s=1e4, latency_s=0.006)  # 140 bytes: 14 ms + 6 ms


@pytest.fixture
def rt():
    runtime = get_runtime("emulated")
    yield runtime
    runtime.close()


@pytest.fixture
def one_thread():
    """The emulated comm streams are host threads: leave them a core (see ``measure``)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _comm(rt, rank: int, world: int, channels: int = 2, links=None) -> tuple[CPComm, LoopbackTransport]:
    transport = LoopbackTransport(links or {"main": SLOW, "kv": SLOW}, time.sleep)
    return CPComm(rt, rank, world, Tracer(rank, False), channels=channels, transport=transport), transport


def test_all_gather_fills_every_rank_and_occupies_the_main_stream(rt):
    comm, transport = _comm(rt, rank=1, world=3)
    local = torch.arange(35, dtype=torch.bfloat16).reshape(5, 7)  # 70 bytes
    out = [torch.full((5, 7), float("nan"), dtype=torch.bfloat16) for _ in range(3)]
    start = rt.event(enable_timing=True)
    start.record(comm.streams["main"])
    with rt.compute_stream().active():
        done = comm.all_gather("allgather_new[0]", local, out)
    done.synchronize()
    assert torch.equal(out[1], local)
    assert all(torch.equal(out[r], torch.zeros(5, 7, dtype=torch.bfloat16)) for r in (0, 2))
    assert transport.log == [("main", "gather", 140, pytest.approx(0.020))]  # 2 peers x 70 bytes
    assert 20.0 <= start.elapsed_time(done) < 200.0


@pytest.mark.parametrize("rank", [0, 1], ids=["sender", "receiver"])
def test_broadcast_moves_the_bytes_and_occupies_its_channel(rt, rank):
    comm, transport = _comm(rt, rank=rank, world=2)
    recv = None if rank == 0 else torch.full((2, 70), 0xFF, dtype=torch.uint8)
    start = rt.event(enable_timing=True)
    start.record(comm.streams["kv"])
    with rt.compute_stream().active():
        sent = comm.broadcast("bcast_kv[3]", 0, lambda: torch.ones(2, 70, dtype=torch.uint8), recv, channel="kv")
    sent.done.synchronize()
    assert transport.log == [("kv", "send" if rank == 0 else "recv", 140, pytest.approx(0.020))]
    if recv is not None:
        assert torch.equal(recv, torch.zeros(2, 70, dtype=torch.uint8))
    assert 20.0 <= start.elapsed_time(sent.done) < 200.0


@pytest.mark.parametrize("channels", [2, 1], ids=["overlapped", "legacy"])
def test_stream_structure_kept(rt, channels):
    """A slow KV broadcast delays a later all-gather only on legacy's single FIFO."""
    comm, _ = _comm(rt, 1, 2, channels, {"main": Link(float("inf")), "kv": Link(float("inf"), 0.15)})
    recv = torch.empty(1, 8, dtype=torch.uint8)
    local = torch.ones(1, 8)
    with rt.compute_stream().active():
        kv = comm.broadcast("bcast_kv[0]", 0, lambda: None, recv, channel="kv")
        gathered = comm.all_gather("allgather_new[0]", local, [torch.empty(1, 8), torch.empty(1, 8)])
    gathered.synchronize()
    assert kv.done.query() is (channels == 1)  # legacy: the gather ran after the 150 ms broadcast
    kv.done.synchronize()


def test_loopback_needs_both_channels():
    with pytest.raises(ValueError, match="missing \\['kv'\\]"):
        LoopbackTransport({"main": SLOW}, time.sleep)


def test_calibration_arithmetic_with_a_fake_timer():
    calls = []

    def elapsed_s(cycles: int) -> float:  # a 1.8 GHz spin behind a 7 us launch-and-record cost
        calls.append(cycles)
        return 7e-6 + cycles / 1.8e9
    assert link_overlap.calibrate_cycles_per_s(elapsed_s, cycles=(1000, 9000), repeats=2) == pytest.approx(1.8e9)
    assert calls == [1000, 1000, 9000, 9000]
    with pytest.raises(RuntimeError, match="expected 9000 cycles to take longer"):
        link_overlap.calibrate_cycles_per_s(lambda n: 1e-3, cycles=(1000, 9000))


def test_stream_sleep_is_calibrated_on_the_runtime_and_occupies_the_stream(rt):
    """The path CUDA takes, with the emulated spin: calibration through the runtime's events."""
    sleep, cps = link_overlap.stream_sleep(rt)
    assert cps == pytest.approx(link_overlap.EMULATED_HZ, rel=0.1)
    assert rt.sleep_cycles_per_s == cps
    stream = rt.stream("x")
    start, end = rt.event(enable_timing=True), rt.event(enable_timing=True)
    start.record(stream)
    stream.submit(lambda: sleep(0.03))
    end.record(stream)
    end.synchronize()
    assert 30.0 <= start.elapsed_time(end) < 150.0


def test_quiet_rank_prefers_non_owned_indexer_layers():
    # tiny: 8 layers, indexers on 0, 1, 3, 5, 7; rank 1 does not own 0-3 (three indexer layers)
    assert link_overlap.quiet_rank(load_model("tiny")) == 1


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_measure_overlapped_hides_the_stall(one_thread):
    assert not dist.is_initialized()  # world 2 without a process group: the loopback transport
    out = link_overlap.measure(1024, runtime="emulated", repeats=5)
    json.dumps(out)
    assert "\n" not in out["summary"] and out["summary"].endswith("passed"), out["summary"]
    o, g = out["overlapped"], out["legacy"]
    assert out["passed"], out["summary"]
    assert g["exposed_stall_share_in_waits"] >= link_overlap.LEGACY_MIN
    assert o["exposed_stall_share_in_waits"] <= link_overlap.OVERLAP_MAX_RATIO * g["exposed_stall_share_in_waits"]
    assert o["stalled_kv_bcasts"] == g["stalled_kv_bcasts"] == 8  # 4 sent, 4 received
    assert (o["indexer_after_kv_bcast"], g["indexer_after_kv_bcast"]) == ("0 of 3", "3 of 3")  # evidence only
    assert out["stall_ms"] > 0 and out["rank"] == 1 and out["non_owned_layers"] == 4


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_teeth_overlapped_run_as_legacy_fails(one_thread, monkeypatch):
    real = link_overlap.engine_config
    monkeypatch.setattr(link_overlap, "engine_config",
                        lambda schedule, stall_s, context: real("legacy", stall_s, context))
    out = link_overlap.measure(1024, runtime="emulated", repeats=5)
    assert not out["passed"], out["summary"]
    assert out["summary"].endswith("FAILED")
    assert out["overlapped"]["indexer_after_kv_bcast"] == "3 of 3"  # it really ran legacy


def test_verdict_thresholds():
    assert link_overlap.verdict(0.8, 0.2)[0]
    assert not link_overlap.verdict(0.8, 0.5)[0]  # more than half of legacy's
    assert not link_overlap.verdict(0.3, 0.0)[0]  # the stall was not on legacy's critical path


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.slow
def test_engine_with_loopback_is_sanitizer_clean(rt, sanitized, schedule, rank):
    """Loopback copies into the receive buffers are comm-stream work ordered as the collectives are."""
    model = load_model("tiny")
    transport = LoopbackTransport({"main": Link(1e9, 1e-4), "kv": Link(1e9, 1e-4)}, time.sleep)
    cfg = link_overlap.engine_config(schedule, 0.002, 512)
    res = RankEngine(model, cfg, rank, rt, transport).prefill(synthetic_requests(1, 512, 0.9, model.vocab_size, 0))
    assert not torch.isnan(res.hidden).any()
    assert {op[1] for op in transport.log} == {"send", "recv", "gather"}


def test_teeth_sanitizer_sees_the_loopback_copies(rt):
    """Without the comm stream's issue-time wait, the loopback's writes into the receive buffers (and
    its reads of the zero sources staged on compute) race the compute stream, and are reported."""
    from hicache import sanitizer

    model = load_model("tiny")
    transport = LoopbackTransport({"main": Link(1e9, 1e-4), "kv": Link(1e9, 1e-4)}, time.sleep)
    cfg = dataclasses.replace(link_overlap.engine_config("overlapped", 0.0, 512),
                              faults=FaultInjection(unsafe_skip_edges=frozenset({"compute_wait"})))
    with sanitizer.sanitized() as san:
        RankEngine(model, cfg, 1, rt, transport).prefill(synthetic_requests(1, 512, 0.9, model.vocab_size, 0))
    hazards = [str(h) for h in san.hazards]
    assert any("stream comm" in h and "aten::copy_" in h and "comm.py" in h for h in hazards), "\n".join(hazards)
