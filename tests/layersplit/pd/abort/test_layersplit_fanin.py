"""Item 7: LayerSplit topology — every prefill CP rank writes only the layers it owns, and decode
releases an aborted request only after every rank acknowledged. Item 8: the lossy control plane
(drop / duplicate / delay) storm at CP 8, with abort->release latencies. The ownership comes from
``layersplit``'s plan as plain data: ``pd`` itself never imports ``layersplit``."""

from __future__ import annotations

import json

import pytest

from layersplit.plan.ownership import plan_ownership
from layersplit.pd.abort.stress import PDStressConfig, failures, run_pd_stress
from layersplit.pd.abort.channel import ChannelFaults
from layersplit.pd.abort.decode_side import FAILED, SUCCESS, DecodeConfig, DecodeNode
from layersplit.pd.abort.messages import AbortAck
from layersplit.pd.abort.topology import PrefillTopology
from layersplit.pd.abort.transfer_engine import EngineFaults
from tests.layersplit.pd.abort.harness import Harness


def split(layers: int, cp: int) -> PrefillTopology:
    plan = plan_ownership(layers, cp, "contiguous")
    return PrefillTopology.of([plan.owned_layers(r) for r in range(cp)])


def test_each_rank_writes_only_its_owned_layers():
    topology = split(10, 4)
    h = Harness(topology=topology)
    req = h.decode.submit(rid=1, room=1, n_pages=3)
    h.loop.run()
    written = {rank: set() for rank in topology.ranks}
    for _, rank, (page, layers), _ in h.landed:
        written[rank].update(layers)
    assert written == {r: set(topology.layers_by_rank[r]) for r in topology.ranks}
    assert len(h.landed) == 3 * 4  # every rank wrote every page, once
    assert req.state == SUCCESS and h.decode.stats["checksum_mismatches"] == 0


def test_a_missing_rank_leaves_its_layers_unwritten():
    """The checksum covers every layer: a rank whose layers never landed cannot pass as a success."""
    h = Harness(topology=split(6, 3))
    req = h.decode.submit(rid=1, room=1, n_pages=2)
    h.loop.run(until=0.02)
    assert not h.decode.kv.intact(req.pages, req.room)


def one_ack_per_room(monkeypatch) -> None:
    """Upstream's MLA fan-out bug: one ack per room is collected, from whichever rank answers."""
    monkeypatch.setattr(DecodeNode, "_must_ack", lambda self, req: {min(req.told - req.done_peers)})


@pytest.mark.parametrize("guarded", [True, False], ids=["guarded", "one_ack_per_room"])
def test_release_waits_for_every_rank(guarded, monkeypatch):
    if not guarded:
        one_ack_per_room(monkeypatch)
    h = Harness(topology=split(8, 4), decode=DecodeConfig(num_pages=2), engine=EngineFaults(min_write_s=0.3, max_write_s=0.3),
                engine_for_rank={3: EngineFaults(min_write_s=2.0, max_write_s=2.0)})
    first = h.decode.submit(rid=1, room=1, n_pages=2)
    h.loop.after(0.15, h.decode.abort, first)  # every rank has posted (rank r at 0.025 * (r + 1)), none landed
    h.decode.submit(rid=2, room=2, n_pages=2)  # waits for room 1's pages
    h.loop.run()
    assert first.state == FAILED
    if guarded:
        assert {m.peer for _, m in h.received(AbortAck) if m.room == 1} == {0, 1, 2, 3}
        reused = min(t for t, _, _, tag in h.landed if tag.room == 2)
        assert reused > max(t for t, _, _, tag in h.landed if tag.room == 1) and h.decode.kv.overwrites == []
    else:
        assert h.decode.kv.overwrites, "rank 3's late layers landed on a reused page"


def test_lossy_control_plane_at_cp8():
    cfg = PDStressConfig(requests=500, seed=21, topology=split(61, 8), channel=ChannelFaults(drop=0.3, duplicate=0.05))
    report = run_pd_stress(cfg)
    assert failures(report) == [], failures(report)
    assert report["prefill_cp"] == 8 and report["channel"]["dropped"] > 0.25 * report["channel"]["sent"]
    latency = report["abort_to_release_s"]
    assert latency["n"] == report["aborts"] and 0 < latency["p50"] <= latency["p99"] <= latency["max"]
    assert report["success"] > 0 and report["abort_resends"] > 0
    legacy = run_pd_stress(PDStressConfig(**{**cfg.__dict__, "legacy_immediate_release": True}))
    assert legacy["overwrites"] > 0


def test_cli_takes_the_layersplit_plan_and_the_fault_rates(capsys):
    from layersplit.cli.app import main

    argv = ["stress", "pd", "--requests", "150", "--prefill-cp", "4", "--layers", "10", "--drop", "0.3",
            "--duplicate", "0.1", "--max-delay-s", "0.05", "--json"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["layers_by_rank"] == [list(split(10, 4).layers_by_rank[r]) for r in range(4)]
    assert report["channel"]["dropped"] > 0 and report["channel"]["duplicated"] > 0
    assert main(["stress", "pd", "--prefill-cp", "9", "--layers", "8"]) == 2  # every rank must own a layer
    assert "expected <= num_layers (8)" in capsys.readouterr().err


def test_bad_inputs_are_rejected():
    with pytest.raises(ValueError, match="expected layers 0..3 each owned by exactly one rank"):
        PrefillTopology.of([[0, 1], [1, 3]])
    with pytest.raises(ValueError, match="each owning >= 1 layer"):
        PrefillTopology.of([[0], []])
    with pytest.raises(ValueError, match="restart_mean_s: expected seconds > 0"):
        PDStressConfig(restart_mean_s=-1.0)
    with pytest.raises(ValueError, match="kill: expected ranks in \\(0, 1\\), got 5"):
        PDStressConfig(kill=((5, 1.0),))
