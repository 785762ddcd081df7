"""``layersplit plan``: capacity numbers from first principles, JSON/text output, CLI errors."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from layersplit.plan.capacity import PlanRequest, capacity_plan
from layersplit.cli.app import main
from layersplit.plan.config import load_hardware, load_model
from layersplit.plan.ownership import plan_ownership


def run_json(capsys, *argv: str) -> dict:
    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_glm5_cp8_h200_bf16(capsys):
    r = run_json(capsys, "--model", "glm-5", "--cp", "8", "--hardware", "h200", "--kv-dtype", "bf16")
    assert 7.0 <= r["capacity_ratio"] <= 7.8
    assert r["max_owned_layers"] == 10 and r["capacity_ratio_ideal"] == pytest.approx(78 / 10)
    assert r["capacity_ratio_upstream"] == pytest.approx(78 / 11, rel=1e-4)
    assert r["bytes_per_token_redundant"] == 78 * (1152 + 132)
    assert r["bytes_per_token_layersplit"] == 10 * (1152 + 132)
    # first principles: (budget - 2 scratch slots) / 10 layers vs budget / 78 layers
    budget, scratch = r["kv_budget_bytes_per_rank"], 2 * (131072 // 64 + 8) * 64 * 1284  # 2 slots, 8 partial pages
    assert r["scratch_bytes"] == scratch
    assert r["tokens_per_rank_layersplit"] == int((budget - scratch) // (10 * 1284))
    assert r["tokens_per_rank_redundant"] == int(budget // (78 * 1284))
    assert r["broadcast_bytes_per_layer"] == 131072 * 1284
    assert r["broadcast_bytes_per_layer"] < r["broadcast_bytes_per_layer_upstream"]
    # the SGLang plug-in (batch landing): 10 owned layers, two staging slots of rows and index pages
    # (the engine's 2056 pages), an 8-byte remap entry per 64-token page (+ 2 spare entries)
    staging = 2 * (131072 // 64 + 8) * (64 * 1152 + 64 * 132)
    assert r["sglang_plugin_staging_bytes"] == staging == 337_907_712
    assert r["tokens_per_rank_sglang_plugin"] == int((budget - staging - 16) * 64 // (10 * 1284 * 64 + 8))
    assert r["sglang_plugin_capacity_ratio"] == r["capacity_ratio_sglang_plugin"] >= 7.6
    assert r["capacity_ratio_upstream"] < r["sglang_plugin_capacity_ratio"] <= r["capacity_ratio"]
    # with upstream's pool-sized landing layer kept (LAYERSPLIT_SGLANG_LANDING=pool): 11 layers a token
    assert r["tokens_per_rank_sglang_plugin_pool_landing"] == int((budget - staging) // (11 * 1284))
    assert r["sglang_plugin_capacity_ratio_pool_landing"] < r["capacity_ratio_upstream"]


def test_fp8_and_glm52_bytes(capsys):
    r = run_json(capsys, "--model", "glm-5", "--cp", "8", "--hardware", "h200", "--kv-dtype", "fp8")
    assert r["kv_bytes_per_token_layer"] == 656 and r["bytes_per_token_redundant"] == 78 * (656 + 132)
    # the plug-in with fp8 KV: against redundant fp8 and against redundant bf16 in the same budget
    budget, fp8 = r["kv_budget_bytes_per_rank"], r["sglang_plugin_by_kv_dtype"]["fp8"]
    staging = 2 * (131072 // 64 + 8) * (64 * 656 + 64 * 132)
    assert fp8["staging_bytes"] == r["sglang_plugin_staging_bytes"] == staging
    assert fp8["tokens_per_rank"] == r["tokens_per_rank_sglang_plugin_fp8"] == int(
        (budget - staging - 16) * 64 // (10 * 788 * 64 + 8))
    assert fp8["tokens_per_rank_redundant_bf16"] == int(budget // (78 * 1284))
    assert r["sglang_plugin_capacity_ratio_fp8_vs_redundant_fp8"] == fp8["tokens_per_rank"] / int(budget // (78 * 788))
    assert r["sglang_plugin_capacity_ratio_fp8_vs_redundant_bf16"] > 12  # ~1.6x more tokens than bf16 on top
    r = run_json(capsys, "--model", "glm-5.2", "--cp", "8", "--hardware", "h200")
    assert r["bytes_per_token_redundant"] == 78 * 1152 + 21 * 132
    assert r["indexer_layers"] == 21


def test_text_output_labels_the_model(capsys):
    assert main(["plan", "--model", "deepseek-v3.2", "--cp", "8", "--hardware", "h200"]) == 0
    out = capsys.readouterr().out
    assert "capacity ratio" in out and "(model)" in out and "deepseek-v3.2 / h200 / 8 ranks" in out


def test_scratch_shrinks_ratio_with_batch_size():
    m, hw = load_model("glm-5"), load_hardware("h200")
    small = capacity_plan(m, hw, PlanRequest(cp=8, max_batch_tokens=8192))
    big = capacity_plan(m, hw, PlanRequest(cp=8, max_batch_tokens=1 << 20))
    assert big["capacity_ratio"] < small["capacity_ratio"] < small["capacity_ratio_ideal"]


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--cp", "0"], "argument --cp: expected an integer >= 1, got 0"),
        (["--cp", "eight"], "argument --cp: expected an integer >= 1, got 'eight'"),
        (["--cp", "8", "--mem-fraction", "1.5"], "argument --mem-fraction/--mem-fraction-static: expected a number in (0, 1], got 1.5"),
        (["--cp", "8", "--kv-dtype", "fp4"], "argument --kv-dtype/--kv-cache-dtype: expected one of ('bf16', 'fp8', 'auto', 'bfloat16', 'fp8_e4m3'), got 'fp4'"),
    ],
    ids=["cp-zero", "cp-word", "mem-fraction", "kv-dtype"],
)
def test_cli_argument_errors(capsys, argv, message):
    assert main(["plan", "--model", "glm-5", "--hardware", "h200", *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--model", "glm-6", "--cp", "8", "--hardware", "h200"], "model 'glm-6': expected one of"),
        (["--model", "glm-5", "--cp", "100", "--hardware", "h200"], "--cp: expected <= num_layers (78)"),
        (["--model", "glm-5", "--cp", "8", "--hardware", "h800", "--weight-shards", "1"], "KV budget: expected > 0"),
    ],
    ids=["unknown-model", "cp-above-layers", "weights-do-not-fit"],
)
def test_cli_value_errors(capsys, argv, message):
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("layersplit plan: error:") and message in err


@given(layers=st.integers(1, 200), cp=st.integers(1, 64), strategy=st.sampled_from(["contiguous", "round-robin", "round_robin"]))
def test_ownership_covers_every_layer_once(layers, cp, strategy):
    if cp > layers:
        with pytest.raises(ValueError, match="cp_size: expected <= num_layers"):
            plan_ownership(layers, cp, strategy)
        return
    plan = plan_ownership(layers, cp, strategy)
    owned = [plan.owned_layers(r) for r in range(cp)]
    assert sorted(sum(owned, ())) == list(range(layers))
    assert max(map(len, owned)) == math.ceil(layers / cp) == plan.max_owned
    if strategy == "contiguous":
        assert all(list(o) == list(range(o[0], o[-1] + 1)) for o in owned)


def test_ownership_errors():
    with pytest.raises(ValueError, match="strategy: expected one of"):
        plan_ownership(8, 2, "random")
    with pytest.raises(ValueError, match="world_size: expected the CP group size 2, got 4"):
        plan_ownership(8, 2, world_size=4)


def test_budget_terms_by_placement(capsys):
    """SGLang's prefill CP: every rank holds all but the routed experts whole; the routed experts are
    split over EP. The budget starts from the HBM the device reports and keeps 1 - mem fraction back."""
    m, hw = load_model("glm-5"), load_hardware("h200")
    assert m.replicated_params() + m.routed_expert_params() == m.param_count()
    assert m.routed_expert_params() == 75 * 256 * 3 * 6144 * 2048  # 75 MoE layers x 256 experts
    r = run_json(capsys, "--model", "glm-5", "--cp", "8", "--hardware", "h200")
    assert r["weight_placement"] == "ep" and r["hbm_reported_bytes"] == hw.hbm_reported_bytes
    # fp8: one byte a weight, but embedding + LM head stay bf16; the MTP layer (an MLA + indexer + MoE
    # layer and its 2h x h eh_proj) is loaded too, its routed experts split like the others
    embed = 2 * 154880 * 6144
    moe_layer = 3 * 6144 * 12288 // 6 * 257 + 6144 * 256  # 257 experts of 3 x 6144 x 2048, the router
    routed_mtp = 256 * 3 * 6144 * 2048
    mtp_replicated = m.attention_params(0) + moe_layer - routed_mtp + 2 * 6144 * 6144
    assert r["weight_bytes_replicated"] == m.replicated_params() + embed + mtp_replicated
    assert r["weight_bytes_expert_parallel"] == (m.routed_expert_params() + routed_mtp) / 8
    no_mtp = run_json(capsys, "--model", "glm-5", "--cp", "8", "--hardware", "h200", "--no-mtp")
    assert no_mtp["weight_bytes_replicated"] == m.replicated_params() + embed
    assert 1.3 * 2**30 < r["weight_bytes_per_rank"] - no_mtp["weight_bytes_per_rank"] < 1.5 * 2**30
    assert no_mtp["kv_budget_bytes_per_rank"] / 2**30 == pytest.approx(21.13, abs=0.01)  # 22.90 GiB before bf16
    assert r["kv_budget_bytes_per_rank"] == pytest.approx(
        hw.hbm_reported_bytes * 0.9 - r["weight_bytes_replicated"] - r["weight_bytes_expert_parallel"])
    assert r["hbm_reserved_bytes"] == pytest.approx(hw.hbm_reported_bytes * 0.1)
    even = run_json(capsys, "--model", "glm-5", "--cp", "8", "--hardware", "h200", "--weight-placement", "even")
    assert even["weight_bytes_per_rank"] == pytest.approx(
        (m.param_count() + embed + mtp_replicated + routed_mtp) / 8)  # all split, embedding + head at 2 B
    assert even["kv_budget_bytes_per_rank"] > r["kv_budget_bytes_per_rank"] + 15e9  # replicated weights cost ~17 GB
    ratios = r["capacity_ratios"]
    assert list(ratios) == ["redundant", "upstream-layersplit", "kv-sharding", "kv-sharding-shipped", "query-moving",
                            "sglang-plugin", "layersplit"]
    assert ratios["redundant"] == 1.0 < ratios["upstream-layersplit"] < ratios["sglang-plugin"] <= ratios["layersplit"]
    # page-level sharding balances 78 layers over 8 ranks exactly (LayerSplit's worst rank owns 10)
    assert 7.8 > ratios["layersplit"] and ratios["layersplit"] < ratios["kv-sharding"] < 8 < ratios["kv-sharding-shipped"]


def test_kv_sharding_bytes_as_read_from_sglang():
    """1/N of every layer a token; the designed scratch is batch-sized, the shipped one holds 8 full
    contexts + the chunk + a trash page, two slots, KV + indexer row (fp8, required by its gate)."""
    from layersplit.plan.capacity import mode_bytes

    m = load_model("glm-5")
    mb = mode_bytes(m, 8, "bf16", "kv-sharding", 1 << 19, 8)
    assert mb.bytes_per_token == 78 * 1284 // 8 and mb.stripe == 8 and mb.kv_dtype == "bf16"
    assert mb.scratch_bytes == 2 * ((1 << 19) // 64 + 8 * 7 + 1) * 64 * 1284
    shipped = mode_bytes(m, 8, "bf16", "kv-sharding-shipped", 1 << 19, 8, context_len=131072, chunk_tokens=65536)
    assert shipped.kv_dtype == "fp8" and shipped.bytes_per_token == -(-78 * 788 // 8)
    assert shipped.scratch_bytes == 2 * (8 * 131072 + 65536 + 64) * (656 + 128 + 4)
    assert mode_bytes(m, 8, "bf16", "kv-sharding", 1 << 19, 8, context_len=7).scratch_bytes == mb.scratch_bytes
