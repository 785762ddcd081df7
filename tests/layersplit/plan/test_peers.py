"""Which SGLang 0.5.23 layouts run on which GPU, the best available peer, and the query-moving peer's
sizes (arXiv 2606.01502), each against a hand computation."""

from __future__ import annotations

import json

import pytest

from layersplit.cli.app import main
from layersplit.plan import query_moving
from layersplit.plan.capacity import MODES, PlanRequest, ROLE, capacity_plan, mode_bytes, modes_at, unavailable_reason
from layersplit.plan.config import load_hardware, load_model


@pytest.mark.parametrize("hardware,gpu", [("h200", "SM 9"), ("h800", "SM 9"), ("cpu", "no CUDA device")])
def test_kv_sharding_shipped_is_not_available_off_blackwell(hardware, gpu):
    why = unavailable_reason("kv-sharding-shipped", load_hardware(hardware))
    assert why.startswith(f"not available on {hardware} ({gpu}; needs SM 10): ")
    assert "kv_shard_hook.py:45-54" in why and "overrides.py:715-716" in why and "fmhaRunner.cuh:37-38" in why


@pytest.mark.parametrize("hardware", ["b200", "h200", "h800", "cpu"])
def test_every_other_layout_has_no_sm_gate(hardware):
    hw = load_hardware(hardware)
    gated = {m for m in MODES if unavailable_reason(m, hw)}
    assert gated == (set() if hardware == "b200" else {"kv-sharding-shipped"})


def test_roles_and_like_with_like():
    assert {m for m in MODES if ROLE[m] == "peer"} == {"redundant", "redundant-shared-host", "upstream-layersplit",
                                                        "kv-sharding-shipped"}
    assert {m for m in MODES if ROLE[m] == "design"} == {"kv-sharding", "query-moving"}
    assert "kv-sharding-shipped" not in modes_at(MODES, "bf16") and modes_at(MODES, "fp8") == MODES


def _plan(capsys, hardware: str, dtype: str, text: bool = False):
    argv = ["plan", "--model", "glm-5", "--cp", "8", "--hardware", hardware, "--kv-dtype", dtype]
    assert main(argv + ([] if text else ["--json"])) == 0
    out = capsys.readouterr().out
    return out if text else json.loads(out)


@pytest.mark.parametrize("hardware,dtype,best", [
    ("h200", "fp8", "upstream-layersplit"),  # shipped KV sharding would hold more, but does not run on SM 9
    ("h200", "bf16", "upstream-layersplit"),
    ("b200", "fp8", "kv-sharding-shipped"),  # it runs on SM 10, at fp8
    ("b200", "bf16", "upstream-layersplit"),  # and has no bf16 layout: never the bf16 peer
])
def test_best_available_peer_by_capacity(capsys, hardware, dtype, best):
    r = _plan(capsys, hardware, dtype)
    assert r["best_available_peer"] == best
    assert r["tokens_per_rank_best_available_peer"] == r[f"tokens_per_rank_{best.replace('-', '_')}"]
    assert ("kv-sharding-shipped" in r["unavailable"]) == (hardware == "h200")
    if hardware == "h200" and dtype == "fp8":  # the bar it cannot be: more tokens than the best that runs
        assert r["tokens_per_rank_kv_sharding_shipped"] > r["tokens_per_rank_best_available_peer"]


def test_plan_text_marks_what_does_not_run(capsys):
    h200 = _plan(capsys, "h200", "fp8", text=True)
    assert "NOT AVAILABLE on h200 (SM 9; a design bar here)" in h200
    assert "NOT AVAILABLE on h200: kv-sharding-shipped" in h200 and "shipped 7.298x not available on h200" in h200
    assert "upstream-layersplit, 2,445,029 tokens: LayerSplit holds 1.089x" in h200
    b200 = _plan(capsys, "b200", "fp8", text=True)
    assert "NOT AVAILABLE" not in b200 and "kv-sharding-shipped, 7,465,945 tokens" in b200


# query-moving: bytes by hand ----------------------------------------------------------------------

def test_query_and_output_bytes_glm5():
    m = load_model("glm-5")  # 64 heads, latent 512 + rope 64, indexer 32 x 128 on every layer
    q = 64 * (512 + 64) * 2 + 32 * 128 + 32 * 4  # bf16 absorbed query, fp8 indexer query, fp32 weights
    o = 64 * 512 * 2
    assert (q, o) == (77_952, 65_536)
    assert all(query_moving.query_bytes_per_token(m, layer) == q for layer in range(78))
    assert all(query_moving.output_bytes_per_token(m, layer) == o for layer in range(78))
    # a 65,536-token batch on CP8: 7/8 of it travels to the owner and back
    assert query_moving.layer_bytes(m, 8, 65536, 3) == (57344 * q, 57344 * o) == (4_470_079_488, 3_758_096_384)
    assert query_moving.layer_bytes(m, 1, 65536, 3) == (0, 0)
    # against LayerSplit's rows: (7/8)(q + o) / (KV + indexer key) cached tokens per new one
    assert query_moving.crossover_prefix_ratio(m, 8, "bf16", 3) == pytest.approx(7 / 8 * (q + o) / 1284)
    assert query_moving.crossover_prefix_ratio(m, 8, "fp8", 3) == pytest.approx(7 / 8 * (q + o) / 788)
    assert query_moving.scratch_bytes(m, 8, 65536) == 2 * 8192 * (q + o)
    assert query_moving.scratch_bytes(m, 1, 65536) == 0


def test_query_and_output_bytes_reuse_and_128_heads():
    m = load_model("glm-5.2")  # indexer on 0, 1, 2, 6, 10, ...: layers 3-5 reuse layer 2's top-k
    q, o, topk = 64 * 576 * 2 + 32 * 128 + 32 * 4, 64 * 512 * 2, 2048 * 4
    per_layer = [(query_moving.query_bytes_per_token(m, layer), query_moving.output_bytes_per_token(m, layer))
                 for layer in range(8)]
    assert per_layer == [(q, o), (q, o), (q, o + topk), (64 * 576 * 2 + topk, o), (64 * 576 * 2 + topk, o),
                         (64 * 576 * 2 + topk, o), (q, o + topk), (64 * 576 * 2 + topk, o)]
    v32 = load_model("deepseek-v3.2")  # 128 heads, indexer 64 x 128
    assert query_moving.query_bytes_per_token(v32, 5) == 128 * 576 * 2 + 64 * 128 + 64 * 4 == 155_904
    assert query_moving.output_bytes_per_token(v32, 5) == 128 * 512 * 2


def test_query_moving_layout_holds_owned_layers():
    m = load_model("glm-5")
    mb = mode_bytes(m, 8, "bf16", "query-moving", 1 << 19, 8, "round-robin", chunk_tokens=65536)
    assert mb.bytes_per_token == 10 * 1284 and mb.broadcast == "queries" and mb.stripe == 1
    assert mb.held_layers[0] == tuple(range(0, 78, 8))
    assert mb.scratch_bytes == query_moving.scratch_bytes(m, 8, 65536)
    striped = mode_bytes(m, 8, "bf16", "query-moving", 1 << 19, 8, "round-robin-striped", chunk_tokens=65536)
    assert striped == mb  # no page striping: the owner attends for everyone
    r = capacity_plan(m, load_hardware("h200"), PlanRequest(cp=8, max_batch_tokens=65536, ownership="round-robin"))
    assert r["tokens_per_rank_query_moving"] == int((r["kv_budget_bytes_per_rank"] - mb.scratch_bytes) // (10 * 1284))
    assert r["query_moving_bytes_per_layer"] == query_moving.layer_bytes(m, 8, 65536, 77)
