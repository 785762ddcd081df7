"""The peers of the modelled sweep: which run on the chosen GPU, the best available one per length, the
query-moving peer's per-layer time against a hand computation, and the B200 sweep."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from layersplit.cli.app import main
from layersplit.plan import query_moving
from layersplit.plan.capacity import mode_bytes
from layersplit.plan.config import ConfigError, configs_root, load_hardware, load_model
from layersplit.serving.cost_model import CostModel, attention_phase
from layersplit.serving.roofline import Roofline
from layersplit.serving.serving import Batch, Req, Served
from layersplit.serving.sweep import add_best_available_peer
from layersplit.serving.sweep_config import load_sweep


def _simulated_phase(c: float, q: float, o: float, cp: int) -> float:
    """Event by event: share 0 is the owner's own; share k arrives k q after the send (one link in),
    is attended once it arrived and the owner is free, and its output leaves when the link out is free."""
    free = link_out = 0.0
    for k in range(cp):
        free = max(free, k * q) + c
        if k:
            link_out = max(link_out, free) + o
    return max(free, link_out)


@pytest.mark.parametrize("c,q,o,cp,want", [(3.0, 1.0, 0.5, 4, 12.5), (1.0, 2.0, 3.0, 3, 9.0), (2.0, 5.0, 1.0, 1, 2.0),
                                          (1.0, 1.0, 1.0, 2, 3.0)],
                         ids=["compute-bound", "link-out-bound", "cp1", "even"])
def test_attention_phase_by_hand(c, q, o, cp, want):
    assert attention_phase(c, q, o, cp) == pytest.approx(want) == pytest.approx(_simulated_phase(c, q, o, cp))


@given(st.floats(0, 5), st.floats(0, 5), st.floats(0, 5), st.integers(1, 9))
def test_attention_phase_matches_an_event_simulation(c, q, o, cp):
    assert attention_phase(c, q, o, cp) == pytest.approx(_simulated_phase(c, q, o, cp), abs=1e-9)


def _batch(tier: str, prefix: int = 108000, new: int = 12000, n: int = 2) -> Batch:
    return Batch([Served(Req(i, prefix, new), tier) for i in range(n)])


def test_query_moving_batch_cost_by_hand():
    """Per layer: projections, then the owner attends for every rank's share as the queries arrive and
    returns the outputs; the others wait. The bytes are queries in + outputs out of each owner."""
    model, hw = load_model("glm-5"), load_hardware("h200")
    mb = mode_bytes(model, 8, "fp8", "query-moving", 1 << 19, 8, "round-robin", chunk_tokens=65536)
    cost = CostModel(model, hw, 8, "fp8", mb).batch(_batch("L1"))
    roof = Roofline(model, hw, "fp8")
    layers = roof.layers([(108000, 12000)] * 2, 8)
    share = 24000 / 8 / roof.nvlink
    q, o = share * 77_952, share * 65_536
    phases = [attention_phase(t.indexer + t.attention, q, o, 8) for t in layers]
    assert cost.seconds == pytest.approx(sum(t.pre + p + t.mlp for t, p in zip(layers, phases)), rel=1e-12)
    assert cost.owner_wait_s == pytest.approx(sum(7 * (t.indexer + t.attention) for t in layers), rel=1e-12)
    assert cost.exposed_comm_s == pytest.approx(sum(p - 8 * (t.indexer + t.attention) for t, p in zip(layers, phases)))
    assert cost.exposed_reload_s == cost.reload_bytes_per_rank == 0
    assert cost.bcast_bytes == 78 * 21000 * (77_952 + 65_536)  # 7/8 of 24,000 tokens, in and out, every layer
    ls = CostModel(model, hw, 8, "fp8", mode_bytes(model, 8, "fp8", "layersplit", 1 << 19, 8, "round-robin"))
    assert ls.batch(_batch("L1")).seconds < cost.seconds / 3  # no owner doing 8 ranks' attention


def test_query_moving_counts_a_reload_stall_once():
    """Only the owner needs its layer loaded; a stall before its attention is all the host tier adds."""
    model, hw = load_model("glm-5"), load_hardware("h200")
    mb = mode_bytes(model, 8, "bf16", "query-moving", 1 << 19, 8, "contiguous", chunk_tokens=65536)
    hot, cold = (CostModel(model, hw, 8, "bf16", mb).batch(_batch(t, n=1)) for t in ("L1", "L2"))
    assert cold.exposed_reload_s > 0 and cold.reload_bytes_per_rank == 10 * 108032 * 1284
    assert cold.seconds - hot.seconds == pytest.approx(cold.exposed_reload_s, rel=1e-9)
    assert cold.exposed_comm_s == pytest.approx(hot.exposed_comm_s) and cold.owner_wait_s == hot.owner_wait_s


def _point(mode: str, rate: float) -> dict:
    return {"mode": mode, "request_tokens_per_s": rate}


def test_best_available_peer_skips_designs_ours_and_what_does_not_run():
    points = [_point("redundant", 100.0), _point("upstream-layersplit", 120.0), _point("kv-sharding", 200.0),
              _point("kv-sharding-shipped", 180.0), _point("query-moving", 300.0), _point("layersplit", 150.0)]
    add_best_available_peer(points, load_hardware("h200"))
    by = {p["mode"]: p for p in points}
    assert {p["best_available_peer"] for p in points} == {"upstream-layersplit"}
    assert by["layersplit"]["gain_vs_best_available_peer"] == pytest.approx(25.0)
    assert by["kv-sharding-shipped"]["not_available"].startswith("not available on h200 (SM 9")
    assert [by[m]["role"] for m in ("kv-sharding", "query-moving", "layersplit")] == ["design", "design", "ours"]
    add_best_available_peer(points, load_hardware("b200"))  # the same rates on a GPU where it runs
    assert by["layersplit"]["best_available_peer"] == "kv-sharding-shipped"
    assert by["layersplit"]["gain_vs_best_available_peer"] == pytest.approx(100 * (150 / 180 - 1))
    assert by["kv-sharding-shipped"]["not_available"] is None


def _small(tmp_path, name: str, **changes):
    data = yaml.safe_load((configs_root() / "sweeps" / f"{name}.yaml").read_text()) | changes
    path = tmp_path / f"{name}-small.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize("name,runs", [("glm5-h200", False), ("glm5-b200", True)])
def test_sweeps_mark_what_runs_and_beat_the_best_available_peer(tmp_path, capsys, name, runs):
    out = tmp_path / "out"
    config = _small(tmp_path, name, lengths=[40000, 120000], requests=64, sessions=16)
    assert main(["sweep", "--config", str(config), "--out", str(out)]) == 0
    capsys.readouterr()
    points = [json.loads(line) for line in (out / "points.jsonl").read_text().splitlines()]
    for length in (40000, 120000):
        for dtype in ("fp8", "bf16"):
            at = {p["mode"]: p for p in points if p["length"] == length and p["kv_dtype"] == dtype}
            peers = [p for p in at.values() if p["role"] == "peer" and not p["not_available"]]
            best = max(peers, key=lambda p: p["request_tokens_per_s"])
            assert {p["best_available_peer"] for p in at.values()} == {best["mode"]}
            assert at["layersplit"]["gain_vs_best_available_peer"] == pytest.approx(
                100 * (at["layersplit"]["request_tokens_per_s"] / best["request_tokens_per_s"] - 1))
            if dtype == "fp8":
                assert (at["kv-sharding-shipped"]["not_available"] is None) == runs
    table = (out / "table.md").read_text()
    hw = name.split("-")[1]
    assert ("**not available**" in table) == (not runs)
    assert (f"**Not available on {hw}: kv-sharding-shipped**" in table) == (not runs)
    assert f"| 120k | kv-sharding-shipped | {'yes' if runs else '**not available**'} |" in table
    assert f"LayerSplit over the best peer that runs on {hw} at fp8 (**modelled**)" in table
    assert "| 40k | query-moving | design bar |" in table and "| 40k | layersplit | ours |" in table


def test_b200_sweep_config_loads():
    cfg = load_sweep("glm5-b200")
    assert (cfg.hardware, cfg.kv_dtype, cfg.kv_dtypes) == ("b200", "fp8", ("fp8", "bf16"))
    h200 = load_sweep("glm5-h200")
    assert replace(h200, name=cfg.name, hardware="b200") == cfg  # only the GPU differs


@pytest.mark.parametrize("name,change,message", [
    ("cpu", {"kv_dtype": ["bf16", "fp8"]}, r"field 'kv_dtype': expected one dtype for the measured engine, "
                                           r"got \['bf16', 'fp8'\]"),
    ("glm5-h200", {"kv_dtype": ["fp8", "fp8"]}, r"field 'kv_dtype': expected a dtype or a list of distinct dtypes"),
    ("glm5-h200", {"kv_dtype": []}, r"field 'kv_dtype': expected a dtype or a list of distinct dtypes, got \[\]"),
    ("glm5-h200", {"kv_dtype": ["fp8", "int4"]}, r"field 'kv_dtype': expected bf16 or fp8, or a list of them, "
                                                 r"got \['fp8', 'int4'\]"),
    ("glm5-h200", {"kv_dtypes": ["fp8"]}, r"unknown field 'kv_dtypes' \(give every dtype as a list in 'kv_dtype'\)"),
], ids=["list-for-measured", "duplicate", "empty", "unknown-dtype", "derived-field"])
def test_kv_dtype_list_errors(tmp_path, name, change, message):
    with pytest.raises(ConfigError, match=message):
        load_sweep(_small(tmp_path, name, **change))


def test_kv_dtypes_travel_with_kv_dtype():
    cfg = load_sweep("glm5-h200")
    with pytest.raises(AssertionError, match="must start with kv_dtype 'bf16': replace both together"):
        replace(cfg, kv_dtype="bf16")
    assert replace(cfg, kv_dtype="bf16", kv_dtypes=("bf16",)).kv_dtypes == ("bf16",)


def test_per_layer_rows_and_queries_by_hand():
    from layersplit.serving import per_layer

    cfg = load_sweep("glm5-h200")
    model, hw = load_model("glm-5"), load_hardware("h200")
    assert per_layer.representative(cfg, 40000) == (8, 36000, 4000)  # 8 requests: 32,000 new tokens
    assert per_layer.representative(cfg, 120000) == (4, 108000, 12000)  # 524,288 context / 120,000
    x = per_layer.compare(cfg, model, hw, 120000, "fp8")
    assert x.rows_bytes == 4 * 108032 * 788  # whole pages of history, KV + indexer key
    assert (x.queries_bytes, x.outputs_bytes) == query_moving.layer_bytes(model, 8, 48000, 3) == (
        42000 * 77_952, 42000 * 65_536)
    assert x.phase_s >= 8 * x.attention_s and x.moving_layer_s > x.layersplit_layer_s
